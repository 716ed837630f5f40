"""Block-scaled element math: exact powers of two, MX scale exponents, element rounding.

Everything works on float32 bit patterns where float arithmetic would lose the exact answer: XLA on a CPU
flushes float32 subnormals to zero (inputs and results), so a block amax, a ``2**-127`` scale or a subnormal
element are read and scaled through their bits. Values here are blocks ``x[..., nblocks, block]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fmp._core._dtypes import BlockFormat

SCALE_MODES = ("rceil", "floor", "ceil", "even")
E8M0_NAN = 255  # the e8m0 byte of a NaN scale
_MANT = np.int32(0x7FFFFF)
_ABS = np.int32(0x7FFFFFFF)
_INF_BITS = 0x7F800000


def bits(x: jax.Array) -> jax.Array:
    """The int32 bit pattern of float32 ``x``."""
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


def exp2i(e: jax.Array) -> jax.Array:
    """``2.0**e`` in float32 for integer ``e`` in ``[-126, 127]`` (built from bits; smaller ``e`` gives 0)."""
    e = e.astype(jnp.int32)
    value = lax.bitcast_convert_type(lax.shift_left(jnp.clip(e + 127, 1, 254), np.int32(23)), jnp.float32)
    return jnp.where(e < -126, jnp.float32(0.0), value)


def mul_pow2(x: jax.Array, e: jax.Array) -> jax.Array:
    """``x * 2**e`` (float32 ``x``, int ``e`` in ``[-300, 300]``), exact wherever the result is a normal float32.

    A subnormal ``x`` is read from its bits (XLA's CPU arithmetic would take it for zero); a result below the
    normal range comes out as a signed zero, which every element format here rounds it to anyway.
    """
    x = x.astype(jnp.float32)
    e = jnp.asarray(e, jnp.int32)
    half = lax.shift_right_arithmetic(e, np.int32(1))
    normal = x * exp2i(half) * exp2i(e - half)
    b = bits(x)
    mant = lax.bitwise_and(b, _MANT).astype(jnp.float32) * jnp.float32(2.0**-23)  # x = mant * 2**-126
    rest = e - 126
    rhalf = lax.shift_right_arithmetic(rest, np.int32(1))
    sub = jnp.where(b < 0, -mant, mant) * exp2i(rhalf) * exp2i(rest - rhalf)
    is_sub = lax.bitwise_and(b, np.int32(_INF_BITS)) == 0
    return jnp.where(is_sub, sub, normal)


def mul_exact(a: jax.Array, t: jax.Array) -> jax.Array:
    """``a * t`` in float32, rounded once, with a subnormal ``a`` read from its bits (lifted by ``2**64``,
    multiplied, brought back); exact wherever the product is a normal float32."""
    a = a.astype(jnp.float32)
    is_sub = lax.bitwise_and(bits(a), np.int32(_INF_BITS)) == 0
    lifted = mul_pow2(mul_pow2(a, jnp.int32(64)) * t, jnp.int32(-64))
    return jnp.where(is_sub, lifted, a * t)


def amax_bits(blocks: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """The bit pattern of the largest magnitude over ``axes`` (kept as size 1), read without flushing
    subnormals; above ``0x7F800000`` when the block holds a NaN, equal to it when its largest is an inf."""
    return jnp.max(lax.bitwise_and(bits(blocks), _ABS), axis=axes, keepdims=True)


def as_float(b: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(b, jnp.float32)


def _exponent(b: jax.Array) -> jax.Array:
    """The unbiased exponent field of non-negative float32 bits (-127 for zero and subnormals)."""
    return lax.shift_right_logical(b, np.int32(23)) - 127


def mx_exponent(amax: jax.Array, fmt: BlockFormat, mode: str) -> jax.Array:
    """The unbiased exponent ``e`` of each block's e8m0 scale ``2**e`` (int32; 128 marks a NaN scale).

    ``amax`` holds the blocks' largest-magnitude bits (``amax_bits``). ``"floor"`` is the OCP rule
    (exponent of amax minus the element's ``emax``), ``"ceil"`` adds one when amax is not a power of two,
    ``"even"`` first rounds amax to ``mbits`` mantissa bits (to nearest, ties away), then floors.
    ``"rceil"`` rounds ``amax / element_max`` up to a power of two: the smallest scale under which no element
    saturates (Transformer Engine's, cuBLAS's and torchao's training default). Exponents are clamped to
    ``[-127, 127]``; a NaN amax gives the NaN scale (128), an infinite one the largest (127).
    """
    nan = amax > _INF_BITS
    if mode == "rceil":
        # amax / element_max, exactly rounded; a small amax is lifted by 2**64 first, so that a subnormal
        # quotient is not flushed to zero on the way (its ceil-exponent can still be -126)
        value = as_float(amax)
        small = amax < (64 << 23)  # amax < 2**-63
        lifted = jnp.where(small, mul_pow2(value, jnp.int32(64)), value)
        quotient = lifted / jnp.float32(fmt.element_max)
        d = bits(quotient)
        e = _exponent(d) + (lax.bitwise_and(d, _MANT) != 0).astype(jnp.int32)
        e = jnp.where(small, e - 64, e)
        # a quotient below 2**-126 is a subnormal float32: its steps are 2**-149, so round it to them (as
        # the unlifted division would) before asking whether it lies above 2**-127
        steps = lax.round(quotient * jnp.float32(2.0**85), lax.RoundingMethod.TO_NEAREST_EVEN)
        e = jnp.where(small & (quotient < 2.0**-62), jnp.where(steps > 2.0**22, -126, -127), e)
        e = jnp.where(amax == 0, -127, e)
    else:
        b = amax
        if mode == "even":
            b = lax.bitwise_and(b + np.int32(1 << (22 - fmt.mbits)), np.int32(_INF_BITS))
        e = _exponent(b) - fmt.emax
        if mode == "ceil":
            e = e + (lax.bitwise_and(b, _MANT) != 0).astype(jnp.int32)
    e = jnp.clip(e, -127, 127)
    return jnp.where(nan, 128, e)


def element_shift(e: jax.Array, mode: str) -> jax.Array:
    """The power of two the elements of a block are multiplied by before rounding, as torchao's ``to_mx``
    applies it: ``-e``, except for the smallest scale (``e = -127``), where ``"rceil"`` multiplies by 1 and the
    other modes divide by ``2**-126`` (torchao clamps the float32 scale to the smallest normal number)."""
    if mode == "rceil":
        return jnp.where(e == -127, 0, -e)
    return jnp.where(e == -127, 126, -e)


def saturate(y: jax.Array, top: float) -> jax.Array:
    """``y`` clipped to ``[-top, top]``; NaN stays NaN."""
    return jnp.clip(y, -jnp.float32(top), jnp.float32(top))


_NORMAL_EMIN = {"float8_e4m3fn": -6, "float8_e5m2": -14, "float4_e2m1fn": 0}


def round_elements(y: jax.Array, fmt: BlockFormat, key: jax.Array | None) -> jax.Array:
    """``y`` (float32, within the format's range) in the element dtype: rounded to nearest even, or, with a
    ``key``, stochastically: up to the next representable value with probability equal to the distance
    from the one below over the spacing (unbiased: the expected result is ``y``)."""
    dtype = jnp.dtype(fmt.element)
    if key is None:
        return y.astype(dtype)
    mag = jnp.abs(y)
    exponent = jnp.maximum(_exponent(bits(mag)), _NORMAL_EMIN[fmt.element]) - fmt.mbits
    steps = mul_pow2(mag, -exponent)  # mag in units of the spacing: exact
    low = jnp.floor(steps)
    up = jax.random.uniform(key, y.shape, jnp.float32) < (steps - low)
    rounded = mul_pow2(low + up.astype(jnp.float32), exponent)
    return jnp.where(y < 0, -rounded, rounded).astype(dtype)
