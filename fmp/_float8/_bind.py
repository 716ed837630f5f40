"""The one entry the autocast interpreter calls for an equation in the ``float8`` category."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from fmp._float8 import _block_dot, _dot, _state
from fmp._float8._recipe import BLOCK_SCALINGS, Float8Recipe

SUPPORTED = ("dot_general", "conv_general_dilated")

_MSG_UNSUPPORTED = (
    "the float8 category runs dot_general and conv_general_dilated only, got {name!r}. Move it to "
    "'lower_precision' with fmp.DEFAULT_RULES.derive(lower_precision=[{name!r}])."
)


def output_dtype(recipe: Float8Recipe, compute_dtype: Any) -> Any:
    """The dtype a float8 product comes out in."""
    return jnp.dtype(jnp.float32) if recipe.output == "float32" else jnp.dtype(compute_dtype)


def bind_float8(
    prim: Any,
    invals: Sequence[Any],
    params: Mapping[str, Any],
    recipe: Float8Recipe,
    out_dtype: Any,
    history: jax.Array | None = None,
    key: jax.Array | None = None,
    weight_first: bool = False,
) -> jax.Array:
    """Runs one ``dot_general``/``conv_general_dilated`` equation in float8; returns its output.

    ``history`` is the site's amax history for delayed scaling (``None``: the
    recipe runs with current scaling; a delayed recipe then falls back to
    tensorwise current scaling). ``key`` rounds a block-scaled recipe's gradients stochastically (NVFP4);
    ``weight_first``: the weight is the first operand (NVFP4 gives the weight 16 x 16 tiles).
    """
    name = prim.name
    if name not in SUPPORTED:
        raise ValueError(_MSG_UNSUPPORTED.format(name=name))
    lhs, rhs = invals
    if name == "conv_general_dilated":
        conv_params = dict(params, preferred_element_type=jnp.dtype(jnp.float32))

        def conv(x: jax.Array, w: jax.Array) -> jax.Array:
            return prim.bind(x, w, **conv_params)

        return _dot.float8_conv(conv, lhs, rhs, recipe, out_dtype)
    dims = params["dimension_numbers"]
    if recipe.scaling in BLOCK_SCALINGS:
        return _block_dot.block_dot_general(lhs, rhs, dims, recipe, out_dtype, key, weight_first)
    if recipe.scaling == "delayed":
        if history is None:
            return _dot.float8_dot_general(lhs, rhs, dims, dataclasses.replace(recipe, scaling="tensorwise"), out_dtype)
        return _state.delayed_dot_general(lhs, rhs, dims, history, recipe, out_dtype)
    return _dot.float8_dot_general(lhs, rhs, dims, recipe, out_dtype)


def scaling_label(recipe: Float8Recipe, prim_name: str, has_site: bool) -> str:
    """How a site was scaled, for explain: ``"tensorwise"``, ``"delayed"``, ...

    Convolutions always run tensorwise; a delayed site without a state (none given,
    or in a while_loop or custom-derivative body) runs tensorwise current scaling.
    """
    if prim_name == "conv_general_dilated" and recipe.scaling != "tensorwise":
        return "tensorwise (conv)"
    if recipe.scaling == "delayed" and not has_site:
        return "tensorwise (no state)"
    return recipe.scaling
