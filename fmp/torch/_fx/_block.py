"""Block-scaled matmuls (MXFP8, MXFP4, NVFP4) in FX graphs: the JAX side's arithmetic on torch tensors.

``block_linear`` hands its operands to ``fmp._float8._block_dot`` (the one implementation of the formats and
their training recipes, checked bit for bit against torchao's ``to_mx``) through NumPy and brings the result
back, so a torch model and its JAX twin quantise and multiply alike, bit for bit. Emulated, on the CPU; NVFP4's
stochastic rounding of gradients needs a key, which the torch side has none of: its gradients round to nearest.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor

from fmp._float8 import _block_dot

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
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
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
