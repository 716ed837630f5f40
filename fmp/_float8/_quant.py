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

from fmp._core import _dtypes
from fmp._core._dtypes import SCALE_MAX, SCALE_MIN

E4M3 = jnp.dtype(_dtypes.E4M3)
E5M2 = jnp.dtype(_dtypes.E5M2)
F32 = np.float32  # a scalar constant operand (lax broadcasts it)


def float8_max(dtype: jax.typing.DTypeLike) -> float:
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
    scale = lax.select(ok, lax.div(F32(float8_max(dtype)), lax.select(ok, amax, one)), one)
    if margin:
        scale = lax.div(scale, F32(2.0**margin))
    scale = lax.min(F32(SCALE_MAX), lax.max(F32(SCALE_MIN), scale))
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
    top = float8_max(dtype)
    y = lax.mul(_f32(x), _f32(scale))
    return lax.convert_element_type(lax.min(F32(top), lax.max(F32(-top), y)), dtype)


def dequantize(q: jax.Array, scale: jax.Array) -> jax.Array:
    """``q * (1 / scale)`` in float32 (the inverse scale is what a float8 GEMM takes; XLA would rewrite
    a division by a broadcast scale into this product anyway, so writing it out keeps jit and eager equal)."""
    scale = _f32(scale)
    return lax.mul(_f32(q), lax.div(F32(1.0), scale))


_MM = (((2,), (1,)), ((0,), (0,)))  # [b, m, k] @ [b, k, n]


def float8_gemm_available() -> bool:
    """Whether the default backend runs a matmul of float8 operands as a float8 GEMM (a GPU of compute
    capability 8.9 or newer: Ada, Hopper, Blackwell); elsewhere XLA would widen the operands first."""
    if jax.default_backend() != "gpu":
        return False
    cc = getattr(jax.devices()[0], "compute_capability", None)
    try:
        return cc is None or tuple(int(p) for p in str(cc).split(".")[:2]) >= (8, 9)
    except ValueError:  # pragma: no cover - an unexpected version string: let XLA decide
        return True


def scaled_matmul(
    a: jax.Array, sa: jax.Array, da: jax.typing.DTypeLike, b: jax.Array, sb: jax.Array, db: jax.typing.DTypeLike,
    gemm: bool,
) -> jax.Array:  # fmt: skip
    """``a[b, m, k] @ b[b, k, n]`` through float8: each operand quantised with its scale, float32 result.

    ``sa`` and ``sb`` must be constant along the contraction (a scalar, ``sa[b, m, 1]``, ``sb[b, 1, n]``).
    ``gemm``: the float8 values go into the matmul and the inverse scales multiply its float32 result (the
    form of a float8 GEMM and of ``torch._scaled_mm``); otherwise each operand is dequantised to float32 first
    (the emulation of torchao's ``emulate=True``). With power-of-two scales both give the same bits on a CPU.
    """
    qa, qb = quantize(a, sa, da), quantize(b, sb, db)
    if gemm:
        out = lax.dot_general(qa, qb, _MM, preferred_element_type=jnp.float32)
        inv = [lax.div(F32(1.0), _f32(s)) for s in (sa, sb)]  # a scalar or one per row / column
        inv = [lax.broadcast_in_dim(v, out.shape, tuple(range(v.ndim)) if v.ndim else ()) for v in inv]
        return lax.mul(lax.mul(out, inv[0]), inv[1])
    return matmul_f32(dequantize(qa, sa), dequantize(qb, sb))


def matmul_f32(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a[b, m, k] @ b[b, k, n]`` of float32 operands, in full float32 precision."""
    return jax.lax.dot_general(a, b, _MM, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def row_scales(
    x: jax.Array, dtype: jax.typing.DTypeLike, scaling: str, pow2: bool, first: bool
) -> jax.Array:  # fmt: skip
    """The scale of ``x`` (an ``a[b, m, k]`` if ``first`` else a ``b[b, k, n]``) for ``"tensorwise"`` or
    ``"rowwise"``: a scalar, or one per index of the non-contracting dimension (``[b, m, 1]``, ``[b, 1, n]``)."""
    if scaling == "tensorwise":
        return scale_from_amax(abs_max(x), dtype, pow2=pow2)
    return scale_from_amax(abs_max(x, 2 if first else 1), dtype, pow2=pow2)


def abs_max(x: jax.Array, axis: object = None) -> jax.Array:
    """The largest magnitude over ``axis`` (an int, a tuple, or None: all), the reduced axes kept as size 1."""
    y = lax.abs(_f32(x))
    if axis is None:
        return lax.reduce_max(y, tuple(range(y.ndim)))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    return lax.expand_dims(lax.reduce_max(y, axes), axes)


def pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def qdq_first(x: jax.Array, dtype: jax.typing.DTypeLike, scaling: str, block: int, pow2: bool) -> jax.Array:
    """Quantise-dequantise the first operand ``x[b, m, k]`` of a product (float32 result)."""
    if scaling in ("tensorwise", "rowwise"):
        s = row_scales(x, dtype, scaling, pow2, first=True)
        return dequantize(quantize(x, s, dtype), s)
    bsz, m, k = x.shape
    xp = pad_to(x, 2, block).reshape(bsz, m, -1, block)  # 1 x block tiles along k
    s = scale_from_amax(abs_max(xp, 3), dtype, pow2=pow2)
    return dequantize(quantize(xp, s, dtype), s).reshape(bsz, m, -1)[:, :, :k]


def qdq_second(
    x: jax.Array, dtype: jax.typing.DTypeLike, scaling: str, block: int, pow2: bool, tiles: bool = False
) -> jax.Array:
    """Quantise-dequantise the second operand ``x[b, k, n]`` of a product (float32 result).

    ``blockwise``: ``block x block`` blocks, or with ``tiles`` (an activation gradient) ``block x 1`` tiles
    along the contraction ``k``.
    """
    if scaling in ("tensorwise", "rowwise"):  # rowwise: one scale per output column n (amax over k)
        s = row_scales(x, dtype, scaling, pow2, first=False)
        return dequantize(quantize(x, s, dtype), s)
    bsz, k, n = x.shape
    cols = 1 if tiles else block
    xp = pad_to(pad_to(x, 1, block), 2, cols)
    xp = xp.reshape(bsz, xp.shape[1] // block, block, xp.shape[2] // cols, cols)
    s = scale_from_amax(abs_max(xp, (2, 4)), dtype, pow2=pow2)
    out = dequantize(quantize(xp, s, dtype), s)
    return out.reshape(bsz, xp.shape[1] * block, xp.shape[3] * cols)[:, :k, :n]
