"""The float8 matmul the FX pass puts in a graph: ``float8_linear``, through ``torch._scaled_mm`` or emulated.

Both kernels quantise the operands to ``float8_e4m3fn`` with current scaling (one scale per tensor, or per
row of the input and per output row of the weight) and, in the backward, the output gradient to the
recipe's ``grad_dtype`` the same way, with fmp's scale rules from the same recipe as the JAX side: scale
``fp8_max / amax`` from a float64 division, 1 at a zero amax, clamped to normal float32 numbers, rounded
down to a power of two if the recipe says so, NaN for a group holding an inf or NaN. They differ in the
product, as torchao's ``Float8Linear`` does between ``emulate=True`` and ``emulate=False``:

* ``"emulated"``: the dequantised operands (float8 value divided by its scale) multiplied in float32.
* ``"scaled_mm"``: ``torch._scaled_mm`` on the float8 data with the reciprocal scales, called as torchao calls
  it: the forward product with ``use_fast_accum=True``, the two backward products without; a rowwise product
  comes out in bfloat16 (CUDA's rowwise kernel has no float32 output), and a backward rowwise product is a
  unit-scale product in bfloat16 multiplied by the two scales afterwards.

``block_linear`` is the block-scaled matmul (MXFP8, MXFP4, NVFP4): it hands its operands to
``fmp._float8._block_dot`` (the one implementation of the formats and their training recipes, checked bit for
bit against torchao's ``to_mx``) through NumPy and brings the result back, so a torch model and its JAX twin
quantise and multiply alike, bit for bit. Always emulated; NVFP4's stochastic rounding of gradients needs a
key, which the torch side has none of: its gradients round to nearest.

The emulated products run with autocast off (autocast has no ``_scaled_mm`` kernel), so the module computes the
same under an outer ``torch.autocast``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp
import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor

from fmp._core._dtypes import E4M3, E5M2, SCALE_MAX, SCALE_MIN
from fmp._float8 import _block_dot

KERNELS = ("scaled_mm", "emulated")
_FWD = getattr(torch, E4M3)


def _scale(amax: torch.Tensor, dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    """``fp8_max / amax`` (float64 division, float32 result), 1 at zero, clamped, NaN at inf/NaN amax."""
    ok = (amax > 0) & torch.isfinite(amax)
    top = torch.finfo(dtype).max
    scale = torch.where(ok, top / torch.where(ok, amax, 1).to(torch.float64), 1.0).to(torch.float32)
    scale = scale.clamp(SCALE_MIN, SCALE_MAX)
    if pow2:  # 2**floor(log2(scale)) exactly: clear the mantissa bits of a normal float32
        scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)
    return torch.where(torch.isfinite(amax), scale, torch.nan)


def quantise(x: torch.Tensor, dtype: torch.dtype, dim: int | None, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale)``: ``x`` scaled and saturated into ``dtype``, with one scale per tensor (``dim=None``)
    or per slice along ``dim`` (the amax runs over ``dim``; the scale keeps it as a size-1 dimension)."""
    x = x.to(torch.float32)
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    scale = _scale(amax, dtype, pow2)
    top = torch.finfo(dtype).max
    return (x * scale).clamp(-top, top).to(dtype), scale


def qdq(x: torch.Tensor, dtype: torch.dtype, dim: int | None, pow2: bool) -> torch.Tensor:
    """Quantise-dequantise ``x`` (float32 result), scales as in `quantise`."""
    data, scale = quantise(x, dtype, dim, pow2)
    return data.to(torch.float32) / scale


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    with torch.autocast(a.device.type, enabled=False):
        return torch.mm(a, b)


def _scaled(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor], out: torch.dtype, fast: bool):
    """``a @ b`` of float8 ``(data, scale)`` pairs through ``torch._scaled_mm``, in ``out``."""
    (a, sa), (b, sb) = a, b
    if a.stride(0) <= a.stride(1):  # the kernel's layouts: a row-major, b column-major
        a = a.contiguous()
    if b.stride(0) > b.stride(1):
        b = b.t().contiguous().t()
    inv_a, inv_b = sa.reciprocal(), sb.reciprocal()
    if sa.ndim == 0:  # (autocast has no kernel for _scaled_mm on any device: no region needed)
        return torch._scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=out, use_fast_accum=fast)
    if fast:
        y = torch._scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=torch.bfloat16, use_fast_accum=True)
    else:
        one = inv_a.new_ones(())
        y = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        y = (y * (inv_a * inv_b)).to(torch.bfloat16)
    return y.to(out)


class _Float8MM(torch.autograd.Function):
    """``x[m, k] @ w_t[k, n]`` with float8-quantised operands, accumulated in float32 and returned in ``out``;
    each gradient product comes out in the output gradient's dtype (a scaled mm's ``out_dtype``), as torchao's."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        w_t: torch.Tensor,
        rowwise: bool,
        pow2: bool,
        grad: torch.dtype,
        kernel: str,
        out: torch.dtype,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, w_t)
        ctx.rowwise, ctx.pow2, ctx.grad_dtype, ctx.kernel = rowwise, pow2, grad, kernel
        row, col = (-1, 0) if rowwise else (None, None)
        if kernel == "emulated":
            return _mm(qdq(x, _FWD, row, pow2), qdq(w_t, _FWD, col, pow2)).to(out)
        return _scaled(quantise(x, _FWD, row, pow2), quantise(w_t, _FWD, col, pow2), out, fast=True)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w_t = ctx.saved_tensors
        pow2, gdt, out = ctx.pow2, ctx.grad_dtype, grad.dtype
        row, col = (-1, 0) if ctx.rowwise else (None, None)
        if ctx.kernel == "emulated":
            dx = _mm(qdq(grad, gdt, row, pow2), qdq(w_t, _FWD, row, pow2).t()).to(out)
            dw_t = _mm(qdq(grad, gdt, col, pow2).t(), qdq(x, _FWD, col, pow2)).t().to(out)
        else:
            (w, sw), (g, sg) = quantise(w_t, _FWD, row, pow2), quantise(grad, gdt, col, pow2)
            dx = _scaled(quantise(grad, gdt, row, pow2), (w.t(), sw.t()), out, fast=False)
            dw_t = _scaled((g.t(), sg.t()), quantise(x, _FWD, col, pow2), out, fast=False).t()
        return dx.to(x.dtype), dw_t.to(w_t.dtype), None, None, None, None, None


def float8_linear(
    x: torch.Tensor,
    w_t: torch.Tensor,
    bias: torch.Tensor | None,
    scaling: str,
    pow2: bool,
    out: torch.dtype | None,
    grad: str = E5M2,
    kernel: str = "emulated",
) -> torch.Tensor:
    """``x @ w_t (+ bias)`` as a float8 matmul; ``w_t[k, n]`` is the weight, ``out`` the result dtype
    (None: float32), ``bias`` added in that dtype, ``grad`` the output gradient's float8 format, ``kernel``
    one of `KERNELS`."""
    shape, out = x.shape, torch.float32 if out is None else out
    y = _Float8MM.apply(x.reshape(-1, shape[-1]), w_t, scaling == "rowwise", pow2, getattr(torch, grad), kernel, out)
    y = y.reshape(*shape[:-1], y.shape[-1])
    return y if bias is None else y + bias.to(y.dtype)


@functools.cache
def scaled_mm_error(device: str, rowwise: bool) -> str | None:
    """None if ``torch._scaled_mm`` runs every product of the kernel on ``device`` (tried once on a tiny
    example), else why not."""
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    try:
        with torch.no_grad(), torch._subclasses.fake_tensor.unset_fake_temporarily():
            x = torch.ones(16, 16, device=device)
            pair = (x.to(_FWD), torch.ones((16, 1) if rowwise else (), device=device))
            _scaled(pair, (pair[0].t(), pair[1].t()), torch.float32, fast=True)
            _scaled((x.to(getattr(torch, E5M2)), pair[1]), (pair[0].t(), pair[1].t()), torch.float32, fast=False)
    except (RuntimeError, NotImplementedError, ValueError, TypeError, AssertionError) as err:
        return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    return None


_NO_KEY = np.zeros(2, np.uint32)


def _jax(t: torch.Tensor) -> Any:
    return jnp.asarray(t.detach().to(torch.float32).cpu().numpy())[None]


def _torch(a: Any, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.array(a[0], np.float32)).to(device=like.device, dtype=dtype)


class _BlockMM(torch.autograd.Function):
    """``x[m, k] @ w_t[k, n]`` in a block-scaled format, result in ``out``; each gradient in its operand's
    dtype, rounded once from float32 (as the JAX side's)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w_t: torch.Tensor, scaling: str, grad: str, mode: str, out: torch.dtype):
        ctx.save_for_backward(x, w_t)
        ctx.args = (scaling, jnp.dtype(grad), mode)
        if isinstance(x, FakeTensor) or isinstance(w_t, FakeTensor):  # shape propagation: no values to give
            return x.new_empty((x.shape[0], w_t.shape[1]), dtype=out)
        y = _block_dot.block_forward(_jax(x), _jax(w_t), *ctx.args, jnp.float32)
        return _torch(y, x, out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w_t = ctx.saved_tensors
        dx, dw = _block_dot.block_grads(_jax(x), _jax(w_t), _jax(grad), _NO_KEY, *ctx.args, False)
        return _torch(dx, x, x.dtype), _torch(dw, w_t, w_t.dtype), None, None, None, None


def block_linear(
    x: torch.Tensor,
    w_t: torch.Tensor,
    bias: torch.Tensor | None,
    scaling: str,
    out: torch.dtype | None,
    grad: str,
    mode: str,
) -> torch.Tensor:
    """``x @ w_t (+ bias)`` in the block-scaled format ``scaling``; ``w_t[k, n]`` is the weight, ``out`` the
    result dtype (None: float32), ``bias`` added in that dtype, ``grad`` the MXFP8 gradients' element format,
    ``mode`` the MX scale rounding."""
    shape, out = x.shape, torch.float32 if out is None else out
    y = _BlockMM.apply(x.reshape(-1, shape[-1]), w_t, scaling, grad, mode, out)
    y = y.reshape(*shape[:-1], y.shape[-1])
    return y if bias is None else y + bias.to(y.dtype)
