"""Float8 quantisation: scales from amax, the saturating cast, and per-granularity scale layouts.

Every function here works on the canonical batched-matmul operands ``a[b, m, k]``
(first operand, contraction last) and ``b[b, k, n]`` (second operand, contraction
in the middle); ``_dot.py`` brings any ``dot_general`` to that form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)
_SCALE_MIN, _SCALE_MAX = 2.0**-126, 2.0**126  # a scale and its inverse stay normal float32 numbers
F32 = np.float32  # a scalar constant operand (lax broadcasts it)


def fp8_max(dtype: jax.typing.DTypeLike) -> float:
    """The largest finite value of a float8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return float(jnp.finfo(dtype).max)


def _f32(x: jax.Array) -> jax.Array:
    return lax.convert_element_type(x, jnp.float32)


def _full(value: float, like: jax.Array) -> jax.Array:
    """``value`` in float32, shaped like ``like`` (a select's operands agree in shape)."""
    return lax.full_like(like, value, jnp.float32)


def scale_from_amax(amax: jax.Array, dtype: jax.typing.DTypeLike, *, pow2: bool = False, margin: int = 0) -> jax.Array:
    """``fp8_max / amax`` in float32; 1 where ``amax`` is zero, NaN where it is inf or NaN.

    ``margin`` divides by ``2**margin``; the result is clamped to ``[2**-126, 2**126]``, so that the scale and
    its inverse are normal float32 numbers (never 0 or inf, whatever finite amax: a tiny one gets ``2**126``);
    ``pow2`` then rounds down to a power of two. A non-finite amax gives a NaN scale (see ``keep_non_finite``).

    Written with ``lax`` operations (as the rest of this module): every float8 matmul traces these, and a
    ``jnp`` function costs a traced call of its own per new shape.
    """
    amax = _f32(amax)
    one = _full(1.0, amax)
    ok = lax.bitwise_and(lax.gt(amax, F32(0.0)), lax.is_finite(amax))
    scale = lax.select(ok, lax.div(F32(fp8_max(dtype)), lax.select(ok, amax, one)), one)
    if margin:
        scale = lax.div(scale, F32(2.0**margin))
    scale = lax.min(F32(_SCALE_MAX), lax.max(F32(_SCALE_MIN), scale))
    if pow2:  # clear the mantissa bits of a normal positive float32: 2**floor(log2(scale)), exactly
        bits = lax.bitcast_convert_type(scale, jnp.int32)
        bits = lax.bitwise_and(bits, np.int32(0x7F800000))
        scale = lax.bitcast_convert_type(bits, jnp.float32)
    return keep_non_finite(scale, amax)


def keep_non_finite(scale: jax.Array, amax: jax.Array) -> jax.Array:
    """``scale``, NaN where ``amax`` (the operand's, same shape) is inf or NaN.

    The saturating cast would turn an inf into the float8 maximum and the product would come out finite and
    wrong; a NaN scale instead makes the whole scaling group (tensor, row or block) NaN after the cast, so an
    overflow reaches every finite check downstream (a loss scaler skips the step), as in torchao. One select
    on the scales, no pass over the operand.
    """
    scale = _f32(scale)
    return lax.select(lax.is_finite(amax), scale, _full(float("nan"), scale))


def quantize(x: jax.Array, scale: jax.Array, dtype: jax.typing.DTypeLike) -> jax.Array:
    """``x * scale`` in float32, saturated to the float8 range (finite values; a NaN scale gives NaN), cast."""
    top = fp8_max(dtype)
    y = lax.mul(_f32(x), _f32(scale))
    return lax.convert_element_type(lax.min(F32(top), lax.max(F32(-top), y)), dtype)


def dequantize(q: jax.Array, scale: jax.Array) -> jax.Array:
    """``q * (1 / scale)`` in float32 (the inverse scale is what a float8 GEMM takes; XLA would rewrite
    a division by a broadcast scale into this product anyway, so writing it out keeps jit and eager equal)."""
    scale = _f32(scale)
    return lax.mul(_f32(q), lax.div(F32(1.0), scale))


def abs_max(x: jax.Array, axis: object = None) -> jax.Array:
    """The largest magnitude over ``axis`` (an int, a tuple, or None: all), the reduced axes kept as size 1."""
    y = lax.abs(_f32(x))
    if axis is None:
        return lax.reduce_max(y, tuple(range(y.ndim)))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    return lax.expand_dims(lax.reduce_max(y, axes), axes)


def _pad(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def qdq_first(x: jax.Array, dtype: jax.typing.DTypeLike, scaling: str, block: int, pow2: bool) -> jax.Array:
    """Quantise-dequantise the first operand ``x[b, m, k]`` of a product (float32 result)."""
    if scaling == "tensorwise":
        s = scale_from_amax(abs_max(x), dtype, pow2=pow2)
        return dequantize(quantize(x, s, dtype), s)
    if scaling == "rowwise":
        s = scale_from_amax(abs_max(x, 2), dtype, pow2=pow2)
        return dequantize(quantize(x, s, dtype), s)
    bsz, m, k = x.shape
    xp = _pad(x, 2, block).reshape(bsz, m, -1, block)  # 1 x block tiles along k
    s = scale_from_amax(abs_max(xp, 3), dtype, pow2=pow2)
    return dequantize(quantize(xp, s, dtype), s).reshape(bsz, m, -1)[:, :, :k]


def qdq_second(
    x: jax.Array, dtype: jax.typing.DTypeLike, scaling: str, block: int, pow2: bool, tiles: bool = False
) -> jax.Array:
    """Quantise-dequantise the second operand ``x[b, k, n]`` of a product (float32 result).

    ``blockwise``: ``block x block`` blocks, or with ``tiles`` (an activation gradient) ``block x 1`` tiles
    along the contraction ``k``.
    """
    if scaling == "tensorwise":
        s = scale_from_amax(abs_max(x), dtype, pow2=pow2)
        return dequantize(quantize(x, s, dtype), s)
    if scaling == "rowwise":  # one scale per output column n: the amax runs over the contraction k
        s = scale_from_amax(abs_max(x, 1), dtype, pow2=pow2)
        return dequantize(quantize(x, s, dtype), s)
    bsz, k, n = x.shape
    cols = 1 if tiles else block
    xp = _pad(_pad(x, 1, block), 2, cols)
    xp = xp.reshape(bsz, xp.shape[1] // block, block, xp.shape[2] // cols, cols)
    s = scale_from_amax(abs_max(xp, (2, 4)), dtype, pow2=pow2)
    out = dequantize(quantize(xp, s, dtype), s)
    return out.reshape(bsz, xp.shape[1] * block, xp.shape[3] * cols)[:, :k, :n]
