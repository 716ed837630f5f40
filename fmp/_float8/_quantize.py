"""``fmp.quantize``: a tensor in a block-scaled format (MXFP8, MXFP4, NVFP4) as a pytree of arrays."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from fmp._core._dtypes import BLOCK_FORMATS, BlockFormat
from fmp._float8 import _blocks, _nvfp4
from fmp._float8._quant import pad_to

BLOCKS = ("1x16", "16x16")

_MSG_FMT = (
    "quantize(x, fmt): fmt must be one of {choices}, got {got!r}. 'mxfp8' (e4m3 elements, a power-of-two "
    "scale per 32) is the safe start; 'mxfp4' and 'nvfp4' have 4-bit elements."
)
_MSG_ROUNDING = (
    "quantize(..., scale_rounding=...) must be one of {choices}, got {got!r}: 'rceil' (the default: the "
    "smallest power of two under which no element saturates, as Transformer Engine, cuBLAS and torchao's "
    "training recipes compute it), 'floor' (the OCP spec's rule), 'ceil' or 'even'."
)
_MSG_BLOCK = (
    "quantize(..., block=...) must be '1x16' (one scale per 16 consecutive elements along `axis`) or "
    "'16x16' (one per 16 x 16 tile of the last two dimensions, NVFP4's weight layout), got {got!r}; "
    "MX formats always use 32-element blocks along `axis` (leave `block` unset)."
)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["data", "scale", "tensor_scale"],
                   meta_fields=["fmt", "axis", "tiles"])  # fmt: skip
@dataclasses.dataclass(frozen=True)
class Quantized:
    """A tensor in a block-scaled format: element codes, one scale per block, and NVFP4's tensor scale.

    Attributes:
      data: The elements, ``x``'s shape, in the format's element dtype.
      scale: One per block: ``x``'s shape with ``axis`` divided by the block length (rounded up), or for
        16 x 16 tiles the last two dimensions divided by 16; ``float8_e8m0fnu`` (MX) or ``float8_e4m3fn``
        (NVFP4). A NaN scale marks a block that held an inf or NaN.
      tensor_scale: NVFP4's float32 encode scale ``448 * 6 / amax`` (a scalar); ``None`` for MX.
      fmt: The format's name.
      axis: The (non-negative) axis the blocks run along.
      tiles: Whether the scales belong to 16 x 16 tiles of the last two dimensions.

    Examples:
      >>> q = fmp.quantize(jnp.arange(40.0).reshape(2, 20), "nvfp4", axis=0)
      >>> q.data.shape, q.scale.shape, q.axis
      ((2, 20), (1, 20), 0)
    """

    data: jax.Array
    scale: jax.Array
    tensor_scale: jax.Array | None
    fmt: str
    axis: int
    tiles: bool = False

    def dequantize(self) -> jax.Array:
        """The float32 values the codes and scales stand for (NaN across a block that held an inf or NaN).

        Examples:
          >>> q = fmp.quantize(jnp.array([1.0, -3.0, 0.1, 448.0]), "mxfp8")
          >>> q.dequantize().tolist()
          [1.0, -3.0, 0.1015625, 448.0]
        """
        mx = BLOCK_FORMATS[self.fmt].scale == "float8_e8m0fnu"
        scale = jax.lax.bitcast_convert_type(self.scale, jnp.uint8).astype(jnp.int32) if mx else self.scale
        scale = scale if mx else scale.astype(jnp.float32)
        per_element = _per_element(scale, self.data.shape, self.axis, self.tiles, BLOCK_FORMATS[self.fmt].block)
        codes = self.data.astype(jnp.float32)
        if mx:
            values = _blocks.mul_pow2(codes, per_element - 127)
            return jnp.where(per_element == _blocks.E8M0_NAN, jnp.float32(jnp.nan), values)
        tensor_scale = jnp.float32(1.0) if self.tensor_scale is None else self.tensor_scale
        return codes * _nvfp4.decode_factor(per_element, tensor_scale)


def _per_element(scale: jax.Array, shape: tuple[int, ...], axis: int, tiles: bool, size: int) -> jax.Array:
    """Each block's scale repeated over the block's elements, cut to ``shape``."""
    if tiles:
        full = jnp.repeat(jnp.repeat(scale, 16, axis=-2), 16, axis=-1)
        return full[..., : shape[-2], : shape[-1]]
    full = jnp.repeat(scale, size, axis=axis)
    return jax.lax.slice_in_dim(full, 0, shape[axis], axis=axis)


def _check(x: Any, fmt: Any, axis: Any, scale_rounding: Any, block: Any) -> tuple[jax.Array, BlockFormat, int]:
    if fmt not in BLOCK_FORMATS:
        raise ValueError(_MSG_FMT.format(choices=", ".join(map(repr, BLOCK_FORMATS)), got=fmt))
    if scale_rounding not in _blocks.SCALE_MODES:
        raise ValueError(_MSG_ROUNDING.format(choices=", ".join(map(repr, _blocks.SCALE_MODES)), got=scale_rounding))
    if block not in BLOCKS or (block == "16x16" and fmt != "nvfp4"):
        raise ValueError(_MSG_BLOCK.format(got=block))
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"quantize(x, ...): x must be a floating array, got dtype {x.dtype}")
    if not isinstance(axis, int) or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"quantize(..., axis=...) must be an int axis of x (ndim {x.ndim}), got {axis!r}")
    axis %= x.ndim
    if block == "16x16" and (x.ndim < 2 or axis < x.ndim - 2):
        raise ValueError(
            f"quantize(..., block='16x16') tiles the last two dimensions: x needs ndim >= 2 and axis one of "
            f"them, got shape {x.shape} and axis {axis}"
        )
    return x, BLOCK_FORMATS[fmt], axis


def quantize(
    x: jax.typing.ArrayLike,
    fmt: str,
    *,
    axis: int = -1,
    scale_rounding: str = "rceil",
    block: str = "1x16",
    key: jax.Array | None = None,
) -> Quantized:
    """Quantises ``x`` to a block-scaled format; emulated with ordinary array operations (any device).

    MX formats (OCP Microscaling v1.0): ``"mxfp8"`` (``float8_e4m3fn`` elements), ``"mxfp8_e5m2"``
    and ``"mxfp4"`` (``float4_e2m1fn``), one power-of-two ``float8_e8m0fnu`` scale per 32 consecutive
    elements along ``axis``, bit for bit with torchao's ``to_mx`` in each ``scale_rounding`` mode (except
    that a block holding an inf gets the NaN scale, see below). ``"nvfp4"``: ``float4_e2m1fn`` elements, one
    ``float8_e4m3fn`` scale per 16 elements (``block="1x16"``) or per 16 x 16 tile of the last two dimensions
    (``block="16x16"``, the layout of NVIDIA's recipe for weights) and a float32 tensor scale, Transformer
    Engine's scale chain. A length that is not a multiple of the block is padded with zeros (the amax does
    not change). A block that holds an inf or NaN gets a NaN scale, so it dequantises to NaN: an overflow
    stays visible, as under the float8 policies.

    Args:
      x: A floating array.
      fmt: ``"mxfp8"``, ``"mxfp8_e5m2"``, ``"mxfp4"`` or ``"nvfp4"``.
      axis: The axis the blocks run along (a matmul's contraction axis).
      scale_rounding: How an MX scale's power of two is chosen from the block's amax: ``"rceil"`` (the
        default: ``amax / element_max`` rounded up, so no element saturates), ``"floor"`` (the OCP rule:
        may saturate the largest elements), ``"ceil"`` or ``"even"``. NVFP4's scales are e4m3 values.
      block: NVFP4's scale layout, ``"1x16"`` or ``"16x16"``.
      key: A ``jax.random`` key: round elements stochastically (unbiased; the same key gives the same bits).

    Returns:
      A ``Quantized`` pytree (``.data``, ``.scale``, ``.tensor_scale``, ``.dequantize()``).

    Raises:
      ValueError: An unknown ``fmt``, ``scale_rounding`` or ``block``, or an axis ``x`` does not have.

    Examples:
      >>> q = fmp.quantize(jnp.linspace(-1.0, 1.0, 32), "mxfp8")
      >>> q.data.dtype, q.scale.shape, q.scale.dtype, q.tensor_scale
      (dtype(float8_e4m3fn), (1,), dtype(float8_e8m0fnu), None)
      >>> q = fmp.quantize(jnp.ones((16, 32)), "nvfp4", block="16x16")
      >>> q.scale.shape, float(q.tensor_scale), float(q.dequantize()[0, 0])
      ((1, 2), 2688.0, 1.0)
    """
    x, spec, axis = _check(x, fmt, axis, scale_rounding, block)
    if spec.name == "nvfp4":
        data, scale, s_enc = _nvfp4_parts(x.astype(jnp.float32), axis, block == "16x16", key)
        return Quantized(data, scale, s_enc, spec.name, axis, block == "16x16")
    data, scale = _mx_parts(x.astype(jnp.float32), spec.name, axis, scale_rounding, key)
    return Quantized(data, scale, None, spec.name, axis)


def _blocked(x: jax.Array, axis: int, size: int) -> jax.Array:
    """``x`` with ``axis`` moved last, zero-padded to a multiple of ``size`` and split into blocks."""
    moved = pad_to(jnp.moveaxis(x, axis, -1), -1, size)
    return moved.reshape(*moved.shape[:-1], moved.shape[-1] // size, size)


def _unblocked(blocks: jax.Array, axis: int, n: int) -> jax.Array:
    flat = blocks.reshape(*blocks.shape[:-2], -1)[..., :n]
    return jnp.moveaxis(flat, -1, axis)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _mx_parts(x: jax.Array, name: str, axis: int, mode: str, key: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    fmt = BLOCK_FORMATS[name]
    blocks = _blocked(x, axis, fmt.block)
    amax = _blocks.amax_bits(blocks, (-1,))
    e = _blocks.mx_exponent(amax, fmt, mode)
    scaled = _blocks.mul_pow2(blocks, _blocks.element_shift(e, mode))
    data = _blocks.round_elements(_blocks.saturate(scaled, fmt.element_max), fmt, key)
    byte = jnp.where(amax >= 0x7F800000, _blocks.E8M0_NAN, e + 127).astype(jnp.uint8)[..., 0]
    scale = jax.lax.bitcast_convert_type(byte, jnp.float8_e8m0fnu)
    return _unblocked(data, axis, x.shape[axis]), jnp.moveaxis(scale, -1, axis)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _nvfp4_parts(x: jax.Array, axis: int, tiles: bool, key: jax.Array | None) -> tuple[jax.Array, ...]:
    s_enc = _nvfp4.tensor_scale(_blocks.amax_bits(x, tuple(range(x.ndim))).reshape(()))
    if tiles:
        m, n = x.shape[-2:]
        padded = pad_to(pad_to(x, -2, 16), -1, 16)
        tiled = padded.reshape(*padded.shape[:-2], padded.shape[-2] // 16, 16, padded.shape[-1] // 16, 16)
        s_dec = _nvfp4.block_scale(_blocks.amax_bits(tiled, (-3, -1)), s_enc)
        codes = _nvfp4.encode(tiled, s_dec, s_enc, key).reshape(padded.shape)[..., :m, :n]
        return codes, s_dec[..., 0, :, 0].astype(jnp.float8_e4m3fn), s_enc
    blocks = _blocked(x, axis, 16)
    s_dec = _nvfp4.block_scale(_blocks.amax_bits(blocks, (-1,)), s_enc)
    codes = _nvfp4.encode(blocks, s_dec, s_enc, key)
    return (
        _unblocked(codes, axis, x.shape[axis]),
        jnp.moveaxis(s_dec[..., 0].astype(jnp.float8_e4m3fn), -1, axis),
        s_enc,
    )
