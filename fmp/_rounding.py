"""Rounding float32 values into bfloat16/float16: stochastic (unbiased) and the update that lands on a value.

Pure array math on the float32 bit pattern, no optax: the optax transformations in ``fmp.optax`` and the
state-dtype wrapper build on it.

Stochastic rounding of ``x`` into a narrower dtype picks one of the two neighbours ``lo <= x <= hi`` with
probability proportional to closeness, so ``E[round(x)] == x`` exactly (to the float32 value's own bits):

* bfloat16 is the top half of float32, so adding 16 uniform random bits to the low half of ``x``'s bit pattern
  and truncating them carries into the kept half with probability ``(x - lo) / (hi - lo)`` (torchao's rule);
  signs, subnormals, infinities and NaN need nothing special.
* float16 has a narrower exponent range: the significand (with its leading one) is shifted right by the number
  of bits float16 cannot hold at ``x``'s exponent (13 in the normal range, more for float16 subnormals) after
  adding as many random bits, and the result is scaled back by a power of two.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

ROUNDED_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def is_rounded(x: jax.typing.ArrayLike) -> bool:
    """True for the dtypes stochastic rounding and Kahan updates work on (bfloat16, float16)."""
    return np.dtype(jnp.result_type(x)) in ROUNDED_DTYPES


def _bf16(x: jax.Array, bits: jax.Array) -> jax.Array:
    u = jax.lax.bitcast_convert_type(x, jnp.uint32)
    u = (u + (bits & jnp.uint32(0xFFFF))) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(u, jnp.float32).astype(jnp.bfloat16)  # exact: the low half is zero


def _f16(x: jax.Array, bits: jax.Array) -> jax.Array:
    u = jax.lax.bitcast_convert_type(x, jnp.uint32)
    exp = ((u >> 23) & 0xFF).astype(jnp.int32) - 127  # unbiased float32 exponent (-127 for zero/subnormal)
    sig = (u & jnp.uint32(0x7FFFFF)) | jnp.uint32(0x800000)  # 24-bit significand: x = sig * 2**(exp - 23)
    # float16's spacing at x: 2**(exp - 10) in the normal range, 2**-24 below it
    grid = jnp.maximum(exp - 10, -24)
    shift = grid - (exp - 23)  # >= 13
    s = jnp.minimum(shift, 31).astype(jnp.uint32)
    kept = (sig + (bits & ((jnp.uint32(1) << s) - 1))) >> s  # <= 2**11, exact in float32
    kept = jnp.where(shift >= 32, jnp.uint32(0), kept)  # below 2**-32: rounds to zero (bias under 2**-32)
    mag = kept.astype(jnp.float32) * jnp.exp2(grid.astype(jnp.float32))
    out = jnp.where(u >> 31 == 1, -mag, mag)
    # float32 zeros and subnormals (|x| < 2**-126) are 0 in float16; inf/NaN stay what they are
    out = jnp.where(exp == -127, x * 0.0, out)
    return jnp.where(jnp.isfinite(x), out, x).astype(jnp.float16)


def round_stochastic(x: jax.typing.ArrayLike, dtype: jax.typing.DTypeLike, bits: jax.Array) -> jax.Array:
    """``x`` (float32) rounded to ``dtype`` (bfloat16 or float16) up or down at random, unbiased.

    Args:
      x: float32 values.
      dtype: bfloat16 or float16.
      bits: uint32 random bits shaped like ``x`` (e.g. ``jax.random.bits(key, x.shape, jnp.uint32)``).

    Returns:
      ``x`` in ``dtype``: each value one of its two neighbours, ``E[result] == x``.
    """
    x = jnp.asarray(x, jnp.float32)
    dtype = np.dtype(dtype)
    if dtype == np.dtype(jnp.bfloat16):
        return _bf16(x, bits)
    if dtype == np.dtype(jnp.float16):
        return _f16(x, bits)
    raise ValueError(f"round_stochastic: dtype must be bfloat16 or float16, got {dtype.name}")


def update_to(target: jax.Array, params: jax.Array) -> jax.Array:
    """The update ``u`` (in the params' dtype) for which ``optax.apply_updates`` lands ``params`` on ``target``.

    ``u = target - params`` rounded to the params' dtype, and ``-0.0`` (the exact identity of ``p + u``) where
    ``target`` is ``params`` bit for bit. ``params + u`` is exactly ``target`` whenever ``target - params`` is
    representable in the params' dtype: always for two values of the same sign within a factor of two of each
    other (Sterbenz's lemma), so for every ordinary step, and for most others; a step that crosses zero to a
    value much smaller than the old one, or moves across many binades at once, can land one rounding of the
    difference away. `landed` gives the value it lands on.
    """
    dtype = params.dtype
    same = jax.lax.bitcast_convert_type(target, _UINT[dtype.itemsize]) == jax.lax.bitcast_convert_type(
        params, _UINT[dtype.itemsize]
    )
    diff = (target.astype(jnp.float32) - params.astype(jnp.float32)).astype(dtype)
    return jnp.where(same, jnp.full(params.shape, -0.0, dtype), diff)


def landed(params: jax.Array, update: jax.Array) -> jax.Array:
    """What ``optax.apply_updates`` computes for one leaf: ``params + update`` in the params' dtype."""
    return jnp.asarray(params + update).astype(params.dtype)


_UINT = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}
