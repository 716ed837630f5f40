"""The float8 rewrite of one matmul or convolution, under a policy that carries a float8 recipe.

The rule table puts ``dot_general`` and ``conv_general_dilated`` in the ``float8`` category; under a policy
without a recipe they are ordinary lower-precision ops (``_leaf``), under one with a recipe ``_leaf`` hands
them here. The quantisation math and the scaling state live in ``fmp._float8``; this module only decides the
output dtype, picks a delayed-scaling history row, binds, and records the explain row.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import JaxprEqn

from fmp._autocast._engine import _rows
from fmp._autocast._engine._context import Context, aval_of, float_names, source_of
from fmp._core import _dtypes
from fmp._core._dtypes import BLOCK_FORMATS
from fmp._core._rules import Category
from fmp._float8 import _bind
from fmp._float8._block_dot import block_stats
from fmp._float8._recipe import BLOCK_SCALINGS
from fmp._policy import Policy


def float8(
    eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str, policy: Policy, out_dtype: Any, why: str = ""
) -> list[Any]:
    """A float8-category op quantised from its inputs as they come (a float32 parameter from float32).

    ``out_dtype`` is the compute dtype (or the op's preferred element type mapped to it); a recipe with
    ``output="float32"`` overrides it. Delayed scaling takes one history row per ``dot_general`` from the
    feeder of the body it is in (``_hops._float8_rows``: a scan body's row is its iteration's). ``why``: the scope
    rule's reason (``_leaf._float8_scope``), for the explain row.
    """
    recipe = policy.float8
    if recipe.output == "float32":
        out_dtype = np.dtype(jnp.float32)
    site = recipe.scaling == "delayed" and ctx.fp8_sites is not None and eqn.primitive.name == "dot_general"
    history = ctx.fp8_sites.take(f"{eqn.primitive.name}@{scope}") if site else None
    weight_first = why.startswith("weight operand (lhs")
    block = recipe.scaling in BLOCK_SCALINGS
    key = ctx.site_key() if block and recipe.scaling == "nvfp4" else None
    outs = [_bind.bind_float8(eqn.primitive, invals, eqn.params, recipe, out_dtype, history, key, weight_first)]
    quantised = BLOCK_FORMATS[recipe.scaling].element if block else _dtypes.E4M3
    if ctx.records is not None:
        stats = {}
        if block and eqn.primitive.name == "dot_general" and not any(isinstance(v, jax.core.Tracer) for v in invals):
            flushed, saturated = block_stats(*invals, eqn.params["dimension_numbers"], recipe, weight_first)
            stats = {"block_flushed": flushed, "block_saturated": saturated}
        ctx.record(
            **stats,
            op=eqn.primitive.name,
            source=source_of(eqn, ctx),
            scope=scope,
            category=Category.FLOAT8.value,
            in_before=float_names([v.aval for v in eqn.invars]),
            in_after=(quantised, quantised),
            out_before=float_names([v.aval for v in eqn.outvars]),
            out_after=float_names([aval_of(x) for x in outs]),
            flops=_rows.flops(eqn),
            detail=_bind.scaling_label(recipe, eqn.primitive.name, site),
            why=why,
            gemm=_rows.gemm(eqn, "lhs" if weight_first else "rhs"),
        )
    return outs
