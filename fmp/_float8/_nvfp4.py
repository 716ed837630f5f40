"""NVFP4: e2m1 elements, an e4m3 scale per 16-element block (or 16 x 16 tile), a float32 scale per tensor.

The scale chain is Transformer Engine's (``common/cast/nvfp4/core_nvfp4.cuh``, as its NVFP4 guide and the
NVFP4 training paper, arXiv 2509.25149, describe it), in float32:

* ``S_enc = min(448 * 6 / amax, FLT_MAX)``, 1 where the tensor's amax is 0 or not finite, or ``S_enc`` is 0;
* ``S_dec = e4m3(min(block_amax * (S_enc * (1/6)), 448))``: rounded once to nearest, no lower clamp (a block
  whose scale underflows gets scale 0 and quantises to zeros);
* ``code = e2m1(x * min(1 / (S_dec * (1/S_enc)), FLT_MAX))``, rounded to nearest even and saturating.

The random Hadamard transform of the weight-gradient inputs uses Transformer Engine's fixed sign vector
(``transformer_engine/pytorch/tensor/nvfp4_tensor.py``, ``get_wgrad_sign_vector``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fmp._core._dtypes import BLOCK_FORMATS, E4M3_MAX
from fmp._float8 import _blocks

FORMAT = BLOCK_FORMATS["nvfp4"]
FLT_MAX = float(np.finfo(np.float32).max)
ENCODE_TOP = E4M3_MAX * FORMAT.element_max  # 2688
WGRAD_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def tensor_scale(amax_bits: jax.Array) -> jax.Array:
    """``S_enc`` from the tensor's amax bits (float32 scalar)."""
    amax = _blocks.as_float(amax_bits)
    finite = (amax_bits < 0x7F800000) & (amax > 0)
    s = jnp.minimum(jnp.float32(ENCODE_TOP) / jnp.where(finite, amax, 1.0), jnp.float32(FLT_MAX))
    return jnp.where(finite & (s > 0), s, jnp.float32(1.0))


def block_scale(block_amax_bits: jax.Array, s_enc: jax.Array) -> jax.Array:
    """``S_dec`` per block as float32 (an e4m3 value; NaN where the block holds an inf or NaN)."""
    amax = _blocks.as_float(block_amax_bits)
    s = jnp.minimum(_blocks.mul_exact(amax, s_enc * jnp.float32(1.0 / 6.0)), jnp.float32(E4M3_MAX))
    s = s.astype(jnp.float8_e4m3fn).astype(jnp.float32)
    return jnp.where(block_amax_bits < 0x7F800000, s, jnp.float32(np.nan))


def encode(blocks: jax.Array, s_dec: jax.Array, s_enc: jax.Array, key: jax.Array | None) -> jax.Array:
    """The e2m1 codes of ``blocks`` (float32, the block dims broadcasting against ``s_dec``)."""
    factor = jnp.minimum(jnp.float32(1.0) / (s_dec * (jnp.float32(1.0) / s_enc)), jnp.float32(FLT_MAX))
    y = _blocks.saturate(_blocks.mul_exact(blocks, factor), FORMAT.element_max)
    return _blocks.round_elements(y, FORMAT, key)


def decode_factor(s_dec: jax.Array, s_enc: jax.Array) -> jax.Array:
    """What a code is multiplied by to dequantise: ``S_dec * (1/S_enc)`` (the inverse of the encode factor)."""
    return s_dec * (jnp.float32(1.0) / s_enc)


def hadamard16(signs: tuple[int, ...] = WGRAD_SIGNS) -> np.ndarray:
    """``diag(signs) @ H16 / 4`` (Sylvester's Hadamard matrix, orthonormal after the 1/4) in float32."""
    h = np.ones((1, 1))
    while h.shape[0] < 16:
        h = np.block([[h, h], [h, -h]])
    return (np.diag(np.asarray(signs, np.float64)) @ h / 4.0).astype(np.float32)


def random_hadamard(x: jax.Array, axis: int) -> jax.Array:
    """The random Hadamard transform along ``axis`` (its length a multiple of 16): each 16 consecutive values
    multiplied by ``diag(s) H16 / 4``, in float32, the result rounded to bfloat16 as Transformer Engine's
    kernel writes it. Orthogonal: the product of two transformed operands equals the untransformed one."""
    moved = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
    n = moved.shape[-1]
    groups = moved.reshape(*moved.shape[:-1], n // 16, 16)
    out = jnp.einsum("...i,ij->...j", groups, hadamard16(), precision=jax.lax.Precision.HIGHEST)
    out = out.astype(jnp.bfloat16).astype(jnp.float32).reshape(moved.shape)
    return jnp.moveaxis(out, -1, axis)
