"""``GradScaler``: torch.amp's stateful loss scaler over fmp's shared update rule.

The class keeps torch's names, signatures, per-optimizer stages, exception types
and messages (``torch.amp.GradScaler`` 2.13), and its private attribute names
(``_scale``, ``_growth_tracker``, ``_per_optimizer_states``, ...) so code that
peeks at them keeps working. What is fmp's own:

* the scale / growth-tracker update goes through
  ``fmp._core._scaler_rule.update_scale`` (the rule the JAX ``GradScaler``
  uses) with a torch array adapter; settings and checkpoint live in
  ``fmp.torch._scaler._state`` (a ``state_dict()`` loads into
  ``fmp.GradScaler.from_state_dict`` and back);
* ``process_group=``: the inf flags are made one 0/1 flag and all-reduced (MAX)
  over the group in ``GradScaler.unscale_``, so every rank skips the same
  steps, fused optimizers included;
* a fused optimizer always gets a 0/1 ``found_inf`` (torch sums the per-device
  flags); see ``fmp.torch._scaler._found_inf``.

The hooks ``_allow_fp16``, ``_found_inf_shape``, ``_coalesce_fp16``,
``_found_inf_group``, ``_check_output``, ``_scaled`` and ``_update_ops`` are
what `fmp.torch.ShardedGradScaler` overrides.

Unscaling calls torch's own ``_amp_foreach_non_finite_check_and_unscale_``
kernel once per (device, dtype) bucket, so unscaled gradients are bit-identical
to torch's. ``unscale_`` makes no host sync; ``step`` makes the one torch makes
(reading the inf flag to decide whether to call ``optimizer.step``).
"""

from __future__ import annotations

import importlib.util
import inspect
import warnings
from collections import abc, defaultdict
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from fmp._core import _scaler_rule
from fmp.torch._scaler._found_inf import PerDevice, all_reduce_flag, coalesce_in_place, one_flag, unscale_and_check
from fmp.torch._scaler._messages import (
    MSG_BACKOFF,
    MSG_CLOSURE,
    MSG_FOREIGN_OUTPUTS,
    MSG_GRAD_SCALER_KWARG,
    MSG_GROWTH,
    MSG_NEW_SCALE,
    MSG_NO_CUDA,
    MSG_NO_INF_CHECKS,
    MSG_NO_INF_CHECKS_OPT,
    MSG_OUTPUTS,
    MSG_SCALE_NONE,
    MSG_STEP_TWICE,
    MSG_UNSCALE_AFTER_STEP,
    MSG_UNSCALE_TWICE,
    MSG_WHERE_TORCH,
)
from fmp.torch._scaler._state import ScalerSettings
from fmp.torch._scaler._torch_ops import TORCH_OPS

__all__ = ["GradScaler"]


def _fresh_optimizer_state() -> dict[str, Any]:
    # module level (not a lambda) so the defaultdict pickles
    return {"stage": OptState.READY, "found_inf_per_device": {}}


def _cuda_definitely_unavailable() -> bool:
    return not (torch.cuda.is_available() or importlib.util.find_spec("torch_xla"))


class GradScaler(ScalerSettings):
    """Dynamic loss scaling for torch optimizers, with torch.amp's API and behaviour.

    A drop-in for ``torch.amp.GradScaler``: ``scale(loss)`` multiplies the loss by
    the scale, ``step(optimizer)`` unscales the gradients and skips
    ``optimizer.step()`` if any is inf/NaN, ``update()`` adapts the scale with
    fmp's shared rule (bit-identical to ``torch._amp_update_scale_``).

    Args:
      device: Device type of the scaler (``"cuda"``, ``"cpu"``, ...). A ``"cuda"``
        scaler on a machine without CUDA warns and disables itself, like torch's.
      init_scale: Initial scale.
      growth_factor: Factor applied after ``growth_interval`` finite steps (> 1).
      backoff_factor: Factor applied after a step with inf/NaN gradients (< 1).
      growth_interval: Consecutive finite steps before the scale grows.
      enabled: If False, ``scale`` returns its input, ``step`` calls
        ``optimizer.step()`` and the other methods do nothing.
      process_group: Optional ``torch.distributed`` process group; if given, the
        inf flags found by ``unscale_`` are reduced over it (one all-reduce of a
        0/1 flag, MAX) so every rank skips together. ``None`` (default) keeps the ranks independent, as torch's
        ``GradScaler`` does. The group is not pickled: set ``_process_group``
        again (or build a new scaler and ``load_state_dict``) after loading.
      max_consecutive_overflows: fmp's own: after this many iterations in a row
        whose ``step`` skipped the optimizer, ``update()`` warns once
        (`fmp.ScaleHealthWarning`). It counts the decisions ``step``
        already read on the host, so it costs no extra sync; iterations decided
        on the device (fused optimizers) leave the count as it is.

    Raises:
      AssertionError: ``growth_factor <= 1`` or ``backoff_factor >= 1`` on an
        enabled scaler (torch's type and message).

    Examples:
      >>> import torch, fmp.torch
      >>> w = torch.nn.Parameter(torch.ones(2))
      >>> opt = torch.optim.SGD([w], lr=0.5)
      >>> scaler = fmp.torch.GradScaler("cpu", init_scale=4.0, growth_interval=1)
      >>> scaler.scale((w * w).sum()).backward()
      >>> _ = scaler.step(opt); scaler.update()
      >>> w.detach().tolist(), scaler.get_scale()
      ([0.0, 0.0], 8.0)
    """

    # what ShardedGradScaler changes (torch's subclass differs from GradScaler in exactly these)
    _allow_fp16 = False  # unscale_ refuses float16 gradients
    _found_inf_shape: tuple[int, ...] = ()
    _coalesce_fp16 = staticmethod(coalesce_in_place)

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        process_group: Any = None,
        max_consecutive_overflows: int = _scaler_rule.DEFAULT_MAX_CONSECUTIVE_OVERFLOWS,
    ) -> None:
        _scaler_rule.check_limit(max_consecutive_overflows, "max_consecutive_overflows")
        self._max_consecutive_overflows = max_consecutive_overflows
        self._consecutive_overflows = 0  # host-side count, from the decisions step() already synced
        self._device = device
        self._enabled = enabled
        self._process_group = process_group
        if device == "cuda" and enabled and _cuda_definitely_unavailable():
            warnings.warn(MSG_NO_CUDA, stacklevel=2)
            self._enabled = False
        if self._enabled:
            if growth_factor <= 1.0:
                raise AssertionError(MSG_GROWTH)
            if backoff_factor >= 1.0:
                raise AssertionError(MSG_BACKOFF)
            self._init_scale = init_scale
            self._scale: torch.Tensor | None = None
            self._growth_factor = growth_factor
            self._backoff_factor = backoff_factor
            self._growth_interval = growth_interval
            self._init_growth_tracker = 0
            self._growth_tracker: torch.Tensor | None = None
            self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(_fresh_optimizer_state)

    # --- internals -------------------------------------------------------------------------------------------

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self._scale is None or self._growth_tracker is None:
            raise AssertionError(MSG_SCALE_NONE.format(funcname))
        return self._scale, self._growth_tracker

    def _lazy_init_scale_growth_tracker(self, device: torch.device) -> None:
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=device)

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        return unscale_and_check(
            optimizer, inv_scale, found_inf, allow_fp16=allow_fp16, coalesce_fp16=self._coalesce_fp16
        )

    def _found_inf_group(self) -> tuple[bool, Any]:
        """Whether to reduce the inf flags across ranks, and over which group (None: the default group)."""
        return self._process_group is not None, self._process_group

    def _sync_found_inf(self, state: dict[str, Any]) -> None:
        """Makes this optimizer's inf flags one 0/1 flag and MAX-reduces it over the group (one collective)."""
        sync, group = self._found_inf_group()
        if not sync:
            return
        scale = self._scale
        if scale is None:  # pragma: no cover - guarded by the callers
            raise AssertionError(MSG_SCALE_NONE.format("unscale_"))
        device = scale.device
        if self._device != "cpu" and device.type == "cpu":
            device = torch.device(self._device)  # the collective runs on the scaler's device (NCCL has no CPU)
        flag = one_flag(state["found_inf_per_device"].values(), device, self._found_inf_shape)
        state["found_inf_per_device"] = {device: all_reduce_flag(flag, group)}

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        one = torch.full((), 1.0, dtype=torch.float32, device=scale.device)
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=scale.device)
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, one, found_inf, True)
        self._sync_found_inf(state)
        return state["found_inf_per_device"]

    def _check_output(self, output: torch.Tensor) -> None:
        """A hook for ``scale``: ShardedGradScaler rejects tensors on devices it does not support."""

    def _scaled(self, output: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """One leaf of ``scale``: GradScaler lets type promotion decide the dtype (a 0-d float16 loss becomes float32)."""
        return output * scale

    def _update_ops(self, scale: torch.Tensor) -> Any:
        """The array adapter of the scale update (float64 products, torch's ``_amp_update_scale_``)."""
        return TORCH_OPS

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    # --- public API ------------------------------------------------------------------------------------------

    def scale(self, outputs: Any) -> Any:
        """Multiplies a tensor, or a (nested) list/tuple/iterable of tensors, by the scale.

        Lists and tuples are rebuilt with their type; other iterables come back
        as a lazy ``map`` (torch's behaviour). Disabled: returns ``outputs``.

        Raises:
          ValueError: a leaf is neither a tensor nor an iterable, or is another framework's array (a JAX or
            NumPy array, which torch would iterate into a lazy ``map`` that scales nothing).
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            self._check_output(outputs)
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(outputs.device)
            scale = self._check_scale_growth_tracker("scale")[0]
            return self._scaled(outputs, scale.to(device=outputs.device, non_blocking=True))
        copies: list[PerDevice] = []

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                self._check_output(value)
                if not copies:
                    if self._scale is None:
                        self._lazy_init_scale_growth_tracker(value.device)
                    copies.append(PerDevice(self._check_scale_growth_tracker("scale")[0]))
                return self._scaled(value, copies[0].get(value.device))
            if hasattr(value, "dtype") or hasattr(value, "__array__") or hasattr(value, "__dlpack__"):
                kind = f"{type(value).__module__}.{type(value).__qualname__}"
                raise ValueError(MSG_FOREIGN_OUTPUTS.format(kind=kind))
            if isinstance(value, abc.Iterable):
                mapped = map(apply, value)
                return type(value)(mapped) if isinstance(value, list | tuple) else mapped
            raise ValueError(MSG_OUTPUTS)

        return apply(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divides the optimizer's gradients by the scale, in place, and records inf/NaN.

        Call it at most once per optimizer between ``update()`` calls, after all
        gradients are accumulated (e.g. to clip them). Makes no host sync.

        Raises:
          RuntimeError: called twice, or after ``step``, since the last ``update``.
          ValueError: a gradient is float16.
          AssertionError: ``scale`` was never called.
        """
        if not self._enabled:
            return
        scale, _ = self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(MSG_UNSCALE_TWICE)
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError(MSG_UNSCALE_AFTER_STEP)
        # the reciprocal in float64, as torch (float32 division can be inexact under some compile options)
        inv_scale = scale.double().reciprocal().float() if scale.device.type != "mps" else scale.reciprocal()
        found_inf = torch.full(self._found_inf_shape, 0.0, dtype=torch.float32, device=scale.device)
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, inv_scale, found_inf, self._allow_fp16)
        self._sync_found_inf(state)
        state["stage"] = OptState.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscales (unless ``unscale_`` ran) and calls ``optimizer.step`` unless a gradient was inf/NaN.

        ``args`` and ``kwargs`` are forwarded to ``optimizer.step``. Optimizers with
        ``_step_supports_amp_scaling`` (fused Adam/AdamW/SGD) get ``grad_scale`` and
        ``found_inf`` attributes for the step and unscale themselves.

        Returns:
          What ``optimizer.step`` returned, or None if the step was skipped.

        Raises:
          RuntimeError: a ``closure=`` keyword, or ``step`` twice since ``update``.
          AssertionError: no gradient was checked for this optimizer.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError(MSG_CLOSURE)
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError(MSG_STEP_TWICE)
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._fused_step(optimizer, state, args, kwargs)
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if len(state["found_inf_per_device"]) == 0:
            raise AssertionError(MSG_NO_INF_CHECKS_OPT)
        retval = None
        # the one host sync of an iteration: is any flag set?
        state["host_found_inf"] = bool(sum(v.item() for v in state["found_inf_per_device"].values()))
        if not state["host_found_inf"]:
            retval = optimizer.step(*args, **kwargs)
        state["stage"] = OptState.STEPPED
        return retval

    def _fused_step(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any], args: tuple, kwargs: dict[str, Any]
    ) -> Any:
        passes_self = "grad_scaler" in inspect.signature(optimizer.step).parameters
        if passes_self:
            warnings.warn(MSG_GRAD_SCALER_KWARG, FutureWarning, stacklevel=3)
            kwargs.update({"grad_scaler": self})
        else:
            if state["stage"] is OptState.READY:
                self._check_inf_per_device(optimizer)
            scale = self._check_scale_growth_tracker("step")[0]
            # a flag, never a sum: the fused kernels skip only on exactly 1.0 and subtract it from their steps
            found_inf = one_flag(state["found_inf_per_device"].values(), scale.device)
            # a grad_scale the user set is multiplied in; already unscaled grads need none
            optimizer.grad_scale = (  # type: ignore[attr-defined]
                getattr(optimizer, "grad_scale", None)
                if state["stage"] == OptState.UNSCALED
                else scale * getattr(optimizer, "grad_scale", 1)
            )
            optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        retval = optimizer.step(*args, **kwargs)
        state["stage"] = OptState.STEPPED
        if not passes_self:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
        return retval

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Adapts the scale for the next iteration (or sets it to ``new_scale``).

        Backs off if any optimizer saw inf/NaN this iteration, grows after
        ``growth_interval`` finite iterations; the rule is
        ``fmp._core._scaler_rule.update_scale``. Makes no host sync.

        Raises:
          AssertionError: no optimizer was stepped/unscaled, or ``new_scale`` is a
            tensor on another device type, with more than one element, or
            requiring grad (torch's messages).
        """
        if not self._enabled:
            return
        scale, tracker = self._check_scale_growth_tracker("update")
        if new_scale is not None:
            if isinstance(new_scale, float):
                scale.fill_(new_scale)
            else:
                if new_scale.device.type != self._device:
                    raise AssertionError(MSG_NEW_SCALE)
                if new_scale.numel() != 1:
                    raise AssertionError(MSG_NEW_SCALE)
                if new_scale.requires_grad is True:
                    raise AssertionError(MSG_NEW_SCALE)
                scale.copy_(new_scale)
        else:
            flags = [
                flag for state in self._per_optimizer_states.values() for flag in state["found_inf_per_device"].values()
            ]
            if not flags:
                raise AssertionError(MSG_NO_INF_CHECKS)
            new, new_tracker = _scaler_rule.update_scale(
                scale,
                tracker,
                one_flag(flags, scale.device) != 0,
                growth_factor=self._growth_factor,
                backoff_factor=self._backoff_factor,
                growth_interval=self._growth_interval,
                ops=self._update_ops(scale),
            )
            scale.copy_(new)
            tracker.copy_(new_tracker)
            self._count_overflows()
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)

    def _count_overflows(self) -> None:
        """Counts skipped iterations from the host-side decisions of ``step``; warns once per long run."""
        known = [st["host_found_inf"] for st in self._per_optimizer_states.values() if "host_found_inf" in st]
        if any(known):
            self._consecutive_overflows += 1
            if self._consecutive_overflows == self._max_consecutive_overflows:
                msg = _scaler_rule.health_message(
                    where=f"fmp.torch.{type(self).__name__}",
                    count=self._consecutive_overflows,
                    limit=self._max_consecutive_overflows,
                    scale=self.get_scale(),
                    hint=MSG_WHERE_TORCH,
                )
                warnings.warn(msg, _scaler_rule.ScaleHealthWarning, stacklevel=3)
        elif known and len(known) == len(self._per_optimizer_states):
            self._consecutive_overflows = 0
