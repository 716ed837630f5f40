"""Block-scaled matmuls (MXFP8, MXFP4, NVFP4) with a ``custom_vjp``: the peers' training recipes, emulated.

Any ``dot_general`` is brought to ``a[b, m, k] @ b[b, k, n]`` (``_dot.canonical``). Each operand is quantised
and dequantised (``fmp.quantize``) and the float32 values multiplied in float32, which is what a block-scaled
GEMM computes up to its accumulation order.

* MX (torchao's MXFP8 linear, Transformer Engine's ``MXFP8BlockScaling``): every operand of all three products
  is quantised along that product's own contraction: ``a`` and ``b`` along ``k`` forward; for
  ``da = g @ b^T`` the gradient and ``b`` along ``n``; for ``db = a^T @ g`` ``a`` and the gradient along ``m``.
  So a weight is quantised twice, once per layout. Gradients use the recipe's ``grad_dtype`` elements
  (e4m3 by default; e5m2 gives ``mxfp8_e5m2`` gradients).
* NVFP4 (Transformer Engine's recipe, arXiv 2509.25149): the activation and the gradient in 16-element
  blocks, the weight in 16 x 16 tiles (one quantisation serves the forward product and, transposed, the
  input-gradient product); the weight-gradient product's inputs go through the random Hadamard transform
  along its contraction (the tokens) first; gradients are rounded stochastically from a key when one is
  given.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fmp._float8 import _nvfp4, _quant
from fmp._float8._dot import canonical
from fmp._float8._quantize import quantize
from fmp._float8._recipe import Float8Recipe

_MSG_MX_BACKEND = (
    "Float8Recipe('mxfp8', emulate=False) runs MX blocks through jax.nn.scaled_dot_general, which has no "
    "lowering on the {backend!r} backend. Leave emulate unset (emulated: runs anywhere, bit for bit with the "
    "format's codes) or run on a GPU with MX tensor cores (Blackwell)."
)
_NO_KEY = (0, 0)
_LOG = logging.getLogger("fmp")
# whether the one-time note that block-scaled matmuls are emulated was logged (once per process)
EMULATION_NOTED: list[bool] = []
_MSG_EMULATED = (
    "fmp: block-scaled matmuls (%s) are emulated on this %s device: operands quantised and dequantised, the "
    "product a float32 matmul (bit for bit with the formats' codes, slower than bfloat16); "
    "Float8Recipe('mxfp8', emulate=False) runs jax.nn.scaled_dot_general where the device has MX tensor cores."
)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def qdq(x: jax.Array, fmt: str, axis: int, mode: str, tiles: bool, key: jax.Array | None = None) -> jax.Array:
    """``x`` quantised to ``fmt`` along ``axis`` (or in 16 x 16 tiles of its last two dims) and dequantised."""
    block = "16x16" if tiles else "1x16"
    return quantize(x, fmt, axis=axis, scale_rounding=mode, block=block, key=key).dequantize()


def _swap(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, 1, 2)


def _formats(recipe_scaling: str, grad_dtype: Any) -> tuple[str, str]:
    """(operand format, gradient format) of a recipe."""
    if recipe_scaling == "mxfp8":
        return "mxfp8", "mxfp8" if jnp.dtype(grad_dtype) == jnp.float8_e4m3fn else "mxfp8_e5m2"
    return recipe_scaling, recipe_scaling


def _keys(key_data: jax.Array, stochastic: bool) -> tuple[jax.Array | None, jax.Array | None]:
    if not stochastic:
        return None, None
    k = jax.random.wrap_key_data(key_data)
    return jax.random.fold_in(k, 1), jax.random.fold_in(k, 2)


def block_forward(a, b, scaling, grad_dtype, mode, out_dtype):
    """The forward product of ``block_matmul`` (``a[b, m, k] @ b[b, k, n]``), without a derivative."""
    fmt, _ = _formats(scaling, grad_dtype)
    nv = scaling == "nvfp4"
    qa, qb = qdq(a, fmt, 2, mode, False), qdq(b, fmt, 1, mode, nv)
    return _quant.matmul_f32(qa, qb).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def block_matmul(a, b, key_data, scaling, grad_dtype, mode, out_dtype, stochastic):
    """``a[b, m, k] @ b[b, k, n]`` in a block-scaled format, result in ``out_dtype``."""
    return block_forward(a, b, scaling, grad_dtype, mode, out_dtype)


def _fwd(a, b, key_data, scaling, grad_dtype, mode, out_dtype, stochastic):
    return block_forward(a, b, scaling, grad_dtype, mode, out_dtype), (a, b, key_data)


def _bwd(scaling, grad_dtype, mode, out_dtype, stochastic, res, g):
    a, b, key_data = res
    da, db = block_grads(a, b, g, key_data, scaling, grad_dtype, mode, stochastic)
    return da.astype(a.dtype), db.astype(b.dtype), None


def block_grads(a, b, g, key_data, scaling, grad_dtype, mode, stochastic):
    """The two gradient products of ``block_matmul`` for the output gradient ``g[b, m, n]`` (float32)."""
    fmt, gfmt = _formats(scaling, grad_dtype)
    g = g.astype(jnp.float32)
    k1, k2 = _keys(key_data, stochastic)
    if scaling == "nvfp4":
        da = _quant.matmul_f32(qdq(g, gfmt, 2, mode, False, k1), _swap(qdq(b, fmt, 1, mode, True)))
        ah = _nvfp4.random_hadamard(_quant.pad_to(a.astype(jnp.float32), 1, 16), 1)
        gh = _nvfp4.random_hadamard(_quant.pad_to(g, 1, 16), 1)
        db = _quant.matmul_f32(_swap(qdq(ah, fmt, 1, mode, False)), qdq(gh, gfmt, 1, mode, False, k2))
    else:
        da = _quant.matmul_f32(qdq(g, gfmt, 2, mode, False, k1), _swap(qdq(b, fmt, 2, mode, False)))
        db = _quant.matmul_f32(_swap(qdq(a, fmt, 1, mode, False)), qdq(g, gfmt, 1, mode, False, k2))
    return da, db


block_matmul.defvjp(_fwd, _bwd)

# one jitted call per shape and recipe, gradient rule included (as ``_dot._float8_matmul_call``): JAX
# differentiates and transposes that one body for every matmul alike
_block_matmul_call = jax.jit(block_matmul, static_argnums=(3, 4, 5, 6, 7))


def block_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    recipe: Float8Recipe,
    out_dtype: Any,
    key: jax.Array | None = None,
    weight_first: bool = False,
) -> jax.Array:
    """``lax.dot_general(lhs, rhs, dimension_numbers)`` in ``recipe``'s block-scaled format.

    ``weight_first``: the weight is ``lhs`` (NVFP4 tiles the weight); ``key``: stochastic rounding of the
    gradients (NVFP4).

    Examples:
      >>> from fmp._float8._block_dot import block_dot_general
      >>> x, w = jnp.ones((4, 32)), jnp.full((32, 2), 0.5)
      >>> block_dot_general(x, w, (((1,), (0,)), ((), ())), fmp.Float8Recipe("mxfp8"), jnp.float32)[0]
      Array([16., 16.], dtype=float32)
    """
    if recipe.scaling == "mxfp8" and recipe.emulate is False:
        return _scaled_dot_general(lhs, rhs, dimension_numbers, out_dtype)
    if not EMULATION_NOTED:
        EMULATION_NOTED.append(True)
        _LOG.info(_MSG_EMULATED, recipe.scaling, jax.default_backend())
    lperm, rperm, ashape, bshape, oshape = canonical(lhs.shape, rhs.shape, dimension_numbers)
    a = jnp.transpose(lhs, lperm).reshape(ashape)
    b = jnp.transpose(rhs, rperm).reshape(bshape)
    stochastic = key is not None and recipe.scaling == "nvfp4"
    key_data = _key_data(key) if stochastic else jnp.asarray(_NO_KEY, jnp.uint32)
    args = (recipe.scaling, jnp.dtype(recipe.grad_dtype), recipe.scale_rounding, jnp.dtype(out_dtype), stochastic)
    if weight_first and recipe.scaling == "nvfp4":  # out^T = b^T @ a^T, with the weight second
        return _swap(_block_matmul_call(_swap(b), _swap(a), key_data, *args)).reshape(oshape)
    return _block_matmul_call(a, b, key_data, *args).reshape(oshape)


def _block_amax(x: np.ndarray, axis: int, size: int, tiles: bool) -> np.ndarray:
    """The largest magnitude of each block of ``x`` (``size`` along ``axis``, or 16 x 16 tiles of the last two
    dims), zero-padded as ``fmp.quantize`` pads."""
    x = np.abs(x)
    if tiles:
        m, n = x.shape[-2:]
        x = np.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, -m % 16), (0, -n % 16)])
        return x.reshape(*x.shape[:-2], x.shape[-2] // 16, 16, x.shape[-1] // 16, 16).max(axis=(-3, -1))
    x = np.moveaxis(x, axis, -1)
    x = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, -x.shape[-1] % size)])
    return np.moveaxis(x.reshape(*x.shape[:-1], -1, size).max(-1), -1, axis)


def block_stats(
    lhs: Any, rhs: Any, dimension_numbers: Any, recipe: Float8Recipe, weight_first: bool = False
) -> tuple[float, float]:
    """For an explain row (concrete operands): the share of the forward operands' nonzero elements that
    quantise to zero, and the share of their nonzero blocks whose scale saturates (an MX exponent at -127 or
    127; an NVFP4 scale that underflows to 0)."""
    lperm, rperm, ashape, bshape, _ = canonical(lhs.shape, rhs.shape, dimension_numbers)
    a = jnp.transpose(lhs, lperm).reshape(ashape).astype(jnp.float32)
    b = jnp.transpose(rhs, rperm).reshape(bshape).astype(jnp.float32)
    nv = recipe.scaling == "nvfp4"
    if nv and weight_first:  # the weight is the first operand: tile it, as block_dot_general does
        layouts = [(jnp.swapaxes(a, 1, 2), 1, True), (b, 1, False)]
    else:
        layouts = [(a, 2, False), (b, 1, nv)]
    flushed = nonzero = blocks = saturated = 0
    size = 16 if nv else 32
    for x, axis, tiles in layouts:
        q = quantize(x, recipe.scaling, axis=axis, scale_rounding=recipe.scale_rounding,
                     block="16x16" if tiles else "1x16")  # fmt: skip
        xs, codes = np.asarray(x), np.asarray(q.data.astype(jnp.float32))
        nonzero += int((xs != 0).sum())
        flushed += int(((xs != 0) & (codes == 0)).sum())
        live = _block_amax(xs, axis, size, tiles) > 0
        if nv:
            hit = np.asarray(q.scale.astype(jnp.float32)) == 0
        else:
            byte = np.asarray(q.scale).view(np.uint8)
            hit = (byte == 0) | (byte == 254)
        blocks += int(live.sum())
        saturated += int((hit & live).sum())
    return flushed / max(nonzero, 1), saturated / max(blocks, 1)


def _key_data(key: jax.Array) -> jax.Array:
    """The uint32 data of a typed key (``jax.random.key``) or a raw one (``jax.random.PRNGKey``)."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    return jnp.asarray(key, jnp.uint32)


def _scaled_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, out_dtype: Any) -> jax.Array:
    backend = jax.default_backend()
    if backend != "gpu":
        raise ValueError(_MSG_MX_BACKEND.format(backend=backend))
    return jax.nn.scaled_dot_general(lhs, rhs, dimension_numbers, preferred_element_type=jnp.dtype(out_dtype))
