"""Float8 matmuls and convolutions with a ``custom_vjp``: e4m3 forward, e5m2 (or e4m3) output gradient.

Any ``dot_general`` is brought to a batched matmul ``a[b, m, k] @ b[b, k, n]``
(transposes and reshapes JAX differentiates by itself); ``float8_matmul`` then
quantises both operands and either multiplies the float8 values with float32
accumulation and applies the inverse scales to the result (a float8 GEMM on a
GPU that has one), or multiplies the dequantised float32 values (the exact
emulation, the default on a CPU; ``Float8Recipe(emulate=...)`` chooses), and
casts the product to the output dtype.
Its backward recomputes the quantisation of the saved operands for the new
contraction and quantises the output gradient to the recipe's ``grad_dtype``
(``float8_e5m2`` by default) for both products: ``da = g @ b^T`` and
``db = a^T @ g``. Block-wise, activations and gradients get ``1 x 128`` tiles
along each product's contraction and weights ``128 x 128`` blocks, DeepSeek-V3's
tiling (whose gradients are e4m3: ``grad_dtype="float8_e4m3fn"``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from fmp._float8 import _quant
from fmp._float8._recipe import Float8Recipe

F32 = jnp.dtype(jnp.float32)


# jitted: traced once per shape, dtype and recipe, then reused from JAX's cache for every matmul alike (the
# layers of a model repeat their shapes), which keeps the quantisation's ops out of each site's own trace
@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6, 7, 8))
def _product(
    a: jax.Array, b: jax.Array, da: Any, db: Any, scaling: str, block: int, pow2: bool, gemm: bool,
    b_tiles: bool = False,
) -> jax.Array:  # fmt: skip
    """``a[b, m, k] @ b[b, k, n]`` through float8, float32 result; ``b_tiles``: ``b`` is a gradient.

    ``gemm`` (tensorwise and rowwise, whose scales are constant along the contraction): float8 operands into
    the matmul, scales on the result; blockwise always dequantises first (its scales vary along ``k``).
    """
    if scaling in ("tensorwise", "rowwise"):
        sa = _quant.row_scales(a, da, scaling, pow2, first=True)
        sb = _quant.row_scales(b, db, scaling, pow2, first=False)
        return _quant.scaled_matmul(a, sa, da, b, sb, db, gemm)
    qa = _quant.qdq_first(a, da, scaling, block, pow2)
    qb = _quant.qdq_second(b, db, scaling, block, pow2, tiles=b_tiles)
    return _quant.matmul_f32(qa, qb)


def _swap(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, 1, 2)


def _forward(a, b, scaling, block, pow2, gemm, out_dtype) -> jax.Array:
    return _product(a, b, _quant.E4M3, _quant.E4M3, scaling, block, pow2, gemm).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7))
def float8_matmul(
    a: jax.Array, b: jax.Array, scaling: str, block: int, pow2: bool, gemm: bool, out_dtype: Any, grad_dtype: Any
) -> jax.Array:
    """``a[b, m, k] @ b[b, k, n]`` with float8 operands, result in ``out_dtype``; gradient in ``grad_dtype``."""
    return _forward(a, b, scaling, block, pow2, gemm, out_dtype)


def _fwd(a, b, scaling, block, pow2, gemm, out_dtype, grad_dtype):  # the product itself, not a nested custom_vjp
    return _forward(a, b, scaling, block, pow2, gemm, out_dtype), (a, b)


def _bwd(scaling, block, pow2, gemm, out_dtype, grad_dtype, res, g):
    a, b = res
    da = _product(g, _swap(b), grad_dtype, _quant.E4M3, scaling, block, pow2, gemm)
    db = _product(_swap(a), g, _quant.E4M3, grad_dtype, scaling, block, pow2, gemm, b_tiles=True)
    return da.astype(a.dtype), db.astype(b.dtype)


def use_gemm(recipe: Float8Recipe) -> bool:
    """Whether ``recipe``'s matmuls take float8 operands (a float8 GEMM) or dequantise first (``emulate``)."""
    return _quant.float8_gemm_available() if recipe.emulate is None else not recipe.emulate


float8_matmul.defvjp(_fwd, _bwd)

# the whole product, gradient rule included, traced once per shape, dtype and recipe: JAX then differentiates
# and transposes that one body for every matmul alike (its caches key on the body), where a custom_vjp at each
# site has its backward traced again at each site
_float8_matmul_call = jax.jit(float8_matmul, static_argnums=(2, 3, 4, 5, 6, 7))


def _ints(dims: Sequence[int]) -> list[int]:
    return [int(d) for d in dims]


def canonical(lhs_shape: Sequence[int], rhs_shape: Sequence[int], dimension_numbers: Any) -> tuple:
    """Permutations and shapes bringing a ``dot_general`` to ``[b, m, k] @ [b, k, n]``."""
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = _ints(lc), _ints(rc), _ints(lb), _ints(rb)
    lf = [d for d in range(len(lhs_shape)) if d not in lc and d not in lb]
    rf = [d for d in range(len(rhs_shape)) if d not in rc and d not in rb]
    bshape = [lhs_shape[d] for d in lb]
    mshape = [lhs_shape[d] for d in lf]
    nshape = [rhs_shape[d] for d in rf]
    k = math.prod(lhs_shape[d] for d in lc)
    return (
        lb + lf + lc,
        rb + rc + rf,
        (math.prod(bshape), math.prod(mshape), k),
        (
            math.prod(bshape),
            k,
            math.prod(nshape),
        ),
        bshape + mshape + nshape,
    )


def float8_dot_general(
    lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, recipe: Float8Recipe, out_dtype: Any
) -> jax.Array:
    """``lax.dot_general(lhs, rhs, dimension_numbers)`` in float8 under ``recipe``, result in ``out_dtype``.

    Examples:
      >>> from fmp._float8._dot import float8_dot_general
      >>> x, w = jnp.ones((4, 8)), jnp.full((8, 2), 0.5)
      >>> float8_dot_general(x, w, (((1,), (0,)), ((), ())), fmp.Float8Recipe(), jnp.float32)[0]
      Array([4., 4.], dtype=float32)
    """
    if recipe.scaling == "delayed":
        raise ValueError("delayed scaling reads its scales from an fmp.Float8State; use fmp._float8._state.delayed_dot")
    lperm, rperm, ashape, bshape, oshape = canonical(lhs.shape, rhs.shape, dimension_numbers)
    a = jnp.transpose(lhs, lperm).reshape(ashape)
    b = jnp.transpose(rhs, rperm).reshape(bshape)
    out = _float8_matmul_call(
        a, b, recipe.scaling, recipe.block_size, recipe.pow2_scales, use_gemm(recipe), jnp.dtype(out_dtype),
        jnp.dtype(recipe.grad_dtype),
    )  # fmt: skip
    return out.reshape(oshape)


def float8_conv(
    conv: Callable[[jax.Array, jax.Array], jax.Array], x: jax.Array, w: jax.Array, recipe: Float8Recipe, out_dtype: Any
) -> jax.Array:
    """``conv(x, w)`` with tensorwise float8 operands (e4m3) and output gradient (the recipe's ``grad_dtype``).

    ``conv`` must compute in float32 (``preferred_element_type=float32``). Every
    recipe quantises convolutions per tensor (a convolution has no single
    contraction axis to tile).
    """
    return _conv(conv, recipe.pow2_scales, jnp.dtype(out_dtype), jnp.dtype(recipe.grad_dtype), x, w)


@functools.partial(jax.jit, static_argnums=(1, 2))  # traced once per shape, as ``_product``
def _qdq_tensor(x: jax.Array, dtype: Any, pow2: bool) -> jax.Array:
    s = _quant.scale_from_amax(_quant.abs_max(x), dtype, pow2=pow2)
    return _quant.dequantize(_quant.quantize(x, s, dtype), s)


def _conv_forward(conv, pow2, out_dtype, x, w):
    return conv(_qdq_tensor(x, _quant.E4M3, pow2), _qdq_tensor(w, _quant.E4M3, pow2)).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _conv(conv, pow2, out_dtype, grad_dtype, x, w):
    return _conv_forward(conv, pow2, out_dtype, x, w)


def _conv_fwd(conv, pow2, out_dtype, grad_dtype, x, w):
    return _conv_forward(conv, pow2, out_dtype, x, w), (x, w)


def _conv_bwd(conv, pow2, out_dtype, grad_dtype, res, g):
    x, w = res
    qx, qw = _qdq_tensor(x, _quant.E4M3, pow2), _qdq_tensor(w, _quant.E4M3, pow2)
    _, vjp = jax.vjp(conv, qx, qw)
    dx, dw = vjp(_qdq_tensor(g, grad_dtype, pow2))
    return dx.astype(x.dtype), dw.astype(w.dtype)


_conv.defvjp(_conv_fwd, _conv_bwd)
