"""``ShardedGradScaler``: torch.distributed.fsdp's sharded loss scaler on the facade's ``GradScaler``.

A subclass, as torch's is of its own ``GradScaler``. What differs from ``GradScaler`` is what torch's
``ShardedGradScaler`` changes (torch 2.13):

* the inf flags are always reduced over a process group (``None``: the default group), because under FSDP
  each rank holds only its shard of the gradients;
* ``unscale_`` accepts float16 gradients (FSDP with ``keep_low_precision_grads``, or a float16 model);
* ``scale`` returns the loss in its own dtype (FSDP's mixed-precision loss stays bfloat16/float16);
* a rank without gradients still gets a flag; float16 sparse gradients are coalesced in float32;
* with the scale on the CPU, the scale is multiplied in float32 (``scale *= factor``), not through the
  float64 product of ``_amp_update_scale_``.

And what fmp does differently from torch's, on purpose: the flag is one 0/1 value reduced with ``MAX``
(torch's ``SUM`` gives 2.0 under FSDP2, whose DTensor check already reduced it, and fused Adam then steps on
inf gradients); the fused-optimizer path reduces it too (torch's checks without any all-reduce, so ranks of a
FSDP1 run diverge); a grown scale that would be inf is not taken (torch's CPU path takes it).
"""

from __future__ import annotations

from typing import Any

import torch

from fmp._core import _scaler_rule
from fmp.torch._scaler._found_inf import coalesce_via_float32
from fmp.torch._scaler._grad_scaler import GradScaler
from fmp.torch._scaler._messages import MSG_UNSUPPORTED_DEVICE
from fmp.torch._scaler._torch_ops import TorchOps

__all__ = ["ShardedGradScaler"]


class _Float32ProductOps(TorchOps):
    """torch's CPU ShardedGradScaler multiplies the float32 scale by the factor in float32."""

    @staticmethod
    def mul_f64(scale: torch.Tensor, factor: float) -> torch.Tensor:  # the protocol's name; the product is float32
        return scale * factor


_FLOAT32_PRODUCT_OPS = _Float32ProductOps()


def _is_supported_device(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda or tensor.device.type in (
        "xla",
        "cpu",
        "hpu",
        "mtia",
        "xpu",
        torch._C._get_privateuse1_backend_name(),
    )


class ShardedGradScaler(GradScaler):
    """Loss scaling for FSDP (and DDP) with ``torch.distributed.fsdp.ShardedGradScaler``'s API and behaviour.

    A drop-in for torch's ``ShardedGradScaler``: the same arguments in the same order (note
    ``backoff_factor`` before ``growth_factor``), messages and ``state_dict``, and parameters bit-identical
    to torch's on FSDP1 and FSDP2. Every rank makes the same skip decision: the inf flags of a step are
    made one 0/1 flag and all-reduced with ``MAX`` over ``process_group``, for every optimizer kind
    (torch's fused-optimizer path skips that all-reduce, and its ``SUM`` can hand fused Adam a 2.0).

    Args:
      device: Device type of the scaler; a ``"cuda"`` scaler without CUDA warns and disables itself.
      init_scale: Initial scale.
      backoff_factor: Factor applied after a step with inf/NaN gradients (< 1).
      growth_factor: Factor applied after ``growth_interval`` finite steps (> 1).
      growth_interval: Consecutive finite steps before the scale grows.
      enabled: If False, ``scale`` returns its input, ``step`` calls ``optimizer.step()`` and the other
        methods do nothing.
      process_group: The ``torch.distributed`` group the flags are reduced over; ``None`` (default) is the
        default group, as in torch (whose default, ``dist.group.WORLD``, is None at import time). It is
        not pickled.
      max_consecutive_overflows: fmp's own, as in `fmp.torch.GradScaler`.

    Raises:
      AssertionError: ``growth_factor <= 1`` or ``backoff_factor >= 1`` on an enabled scaler; ``scale`` of
        a tensor on an unsupported device (torch's type and messages).

    Examples:
      >>> import torch, torch.distributed as dist, fmp.torch
      >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
      >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))  # float16 grads are accepted
      >>> opt = torch.optim.SGD([w], lr=0.5)
      >>> scaler = fmp.torch.ShardedGradScaler("cpu", init_scale=4.0, growth_interval=1)
      >>> loss = scaler.scale((w * w).sum())
      >>> loss.dtype  # the loss keeps its dtype
      torch.float16
      >>> loss.backward()
      >>> _ = scaler.step(opt); scaler.update()
      >>> w.detach().tolist(), scaler.get_scale()
      ([0.0, 0.0], 8.0)
      >>> dist.destroy_process_group()
    """

    _allow_fp16 = True
    _found_inf_shape = (1,)
    _coalesce_fp16 = staticmethod(coalesce_via_float32)

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: Any = None,
        *,
        max_consecutive_overflows: int = _scaler_rule.DEFAULT_MAX_CONSECUTIVE_OVERFLOWS,
    ) -> None:
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
            max_consecutive_overflows=max_consecutive_overflows,
        )
        if self._enabled:
            self.process_group = process_group

    def _found_inf_group(self) -> tuple[bool, Any]:
        return True, self.process_group

    def _check_output(self, output: torch.Tensor) -> None:
        if not _is_supported_device(output):
            raise AssertionError(MSG_UNSUPPORTED_DEVICE.format(output.device))

    def _scaled(self, output: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        # FSDP's mixed-precision loss is bfloat16/float16: the scaled loss keeps that dtype
        return (output * scale).type(output.dtype)

    def _update_ops(self, scale: torch.Tensor) -> Any:
        return _FLOAT32_PRODUCT_OPS if scale.device.type == "cpu" else super()._update_ops(scale)

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool = True,
    ) -> dict[torch.device, torch.Tensor]:
        found = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if not found:
            # a rank whose shards are all empty (use_orig_params=True) still has a flag for the all-reduce
            scale = self._check_scale_growth_tracker("unscale_")[0]
            found = {scale.device: found_inf.to(scale.device, copy=True)}
        return found

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divides the optimizer's gradients by the scale in place and reduces the inf flag over the group.

        Like `fmp.torch.GradScaler.unscale_`, but float16 gradients are accepted, and the flag is
        all-reduced (one collective) so every rank sees the same answer.

        Raises:
          RuntimeError: called twice, or after ``step``, since the last ``update``.
          AssertionError: ``scale`` was never called.
        """
        super().unscale_(optimizer)
