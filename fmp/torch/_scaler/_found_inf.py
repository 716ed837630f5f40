"""The inf/NaN flags of the torch facade's scalers: unscale-and-check, one 0/1 flag, the cross-rank reduction.

``found_inf`` is a float32 flag that torch's fused optimizers (Adam, AdamW, SGD) read as "skip when it is
exactly 1.0" and subtract from their step counts. A sum of flags is therefore wrong as soon as two of them
are set (two devices, or two ranks after an all-reduce): the fused kernel steps on inf gradients and moves
its step count backwards. Every flag this module hands out is 0.0 or 1.0, and the cross-rank reduction is
a MAX of flags that already are.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from fmp.torch._scaler._messages import MSG_FP16


class PerDevice:
    """Lazily made per-device copies of a tensor (one copy per device, then reused)."""

    def __init__(self, master: torch.Tensor) -> None:
        self.master = master
        self.copies: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        out = self.copies.get(device)
        if out is None:
            out = self.copies[device] = self.master.to(device=device, non_blocking=True, copy=True)
        return out


def coalesce_in_place(param: torch.Tensor) -> torch.Tensor:
    """``GradScaler``'s way: coalesce the float16 sparse gradient as it is."""
    param.grad = param.grad.coalesce()
    return param.grad


def coalesce_via_float32(param: torch.Tensor) -> torch.Tensor:
    """``ShardedGradScaler``'s way: coalesce in float32 (some backends have no float16 coalesce), then back."""
    param.grad = param.grad.float().coalesce().half()
    return param.grad


def unscale_and_check(
    optimizer: torch.optim.Optimizer,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    allow_fp16: bool,
    coalesce_fp16: Any = coalesce_in_place,
) -> dict[torch.device, torch.Tensor]:
    """Multiplies every gradient by ``inv_scale`` in place and sets per-device copies of ``found_inf``.

    One call of torch's ``_amp_foreach_non_finite_check_and_unscale_`` per (device, dtype) bucket, so the
    unscaled gradients are torch's bits. Returns ``{device: flag}`` for the devices that hold gradients.

    Raises:
      ValueError: a float16 gradient and ``allow_fp16=False`` (torch's message).
    """
    inv = PerDevice(inv_scale)
    found = PerDevice(found_inf)
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    with torch.no_grad():
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if not allow_fp16 and grad.dtype == torch.float16:
                    raise ValueError(MSG_FP16)
                if grad.is_sparse:
                    # duplicates of an fp16 sparse grad may overflow only once summed: check the coalesced values
                    if grad.dtype is torch.float16:
                        grad = coalesce_fp16(param)
                    grad = grad._values()
                buckets.setdefault((grad.device, grad.dtype), []).append(grad)
        for (device, _), grads in buckets.items():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found.get(device), inv.get(device))
    return found.copies


def one_flag(flags: Iterable[torch.Tensor], device: torch.device, shape: tuple[int, ...] = ()) -> torch.Tensor:
    """1.0 if any of ``flags`` is non-zero, else 0.0: one float32 tensor of ``shape`` on ``device``.

    No host sync. With no flags at all the answer is a fresh 0.0 (a rank without gradients still takes
    part in a collective with it).
    """
    out = torch.zeros(shape, dtype=torch.float32, device=device)
    for flag in flags:
        out = torch.maximum(out, flag.to(device=device, non_blocking=True).reshape(shape))
    return torch.clamp(out, max=1.0)


def all_reduce_flag(flag: torch.Tensor, group: Any) -> torch.Tensor:
    """MAX-reduces a 0/1 flag over ``group`` (``None``: the default group) in place; returns it."""
    import torch.distributed as dist

    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag
