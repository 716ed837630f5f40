"""``GradScaler``: torch.amp's stateful loss scaler over fmp's shared update rule.

The class keeps torch's names, signatures, per-optimizer stages, exception types
and messages (``torch.amp.GradScaler`` 2.13), and its private attribute names
(``_scale``, ``_growth_tracker``, ``_per_optimizer_states``, ...) so code that
peeks at them keeps working. Two things are fmp's own:

* the scale / growth-tracker update goes through
  :func:`fmp._core._scaler_rule.update_scale` (the rule the JAX ``GradScaler``
  uses) with a torch array adapter, and the checkpoint goes through
  ``make_state_dict`` / ``parse_state_dict``, so a ``state_dict()`` loads into
  ``fmp.GradScaler.from_state_dict`` and back;
* ``process_group=``: the inf flags are all-reduced (SUM) over the group in
  :meth:`GradScaler.unscale_`, so every rank skips the same steps (the behaviour
  of ``torch.distributed.fsdp.ShardedGradScaler``, with ``GradScaler``'s update
  math).

Unscaling calls torch's own ``_amp_foreach_non_finite_check_and_unscale_``
kernel once per (device, dtype) bucket, so unscaled gradients are bit-identical
to torch's. ``unscale_`` makes no host sync; ``step`` makes the one torch makes
(reading the inf flag to decide whether to call ``optimizer.step``).
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import warnings
from collections import abc, defaultdict
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from fmp._core import _scaler_rule

__all__ = ["GradScaler"]

# torch's messages, verbatim (tests compare them against torch itself)
_MSG_NO_CUDA = "torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling."
_MSG_GROWTH = "The growth factor must be > 1.0."
_MSG_BACKOFF = "The backoff factor must be < 1.0."
_MSG_SCALE_NONE = (
    "Attempted {} but _scale is None.  "
    "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."
)
_MSG_OUTPUTS = "outputs must be a Tensor or an iterable of Tensors"
# torch would iterate such an array and hand back a lazy map that fails (or scales nothing) later
_MSG_FOREIGN_OUTPUTS = (
    "outputs must be a Tensor or an iterable of Tensors, got a {kind}: fmp.torch.GradScaler scales torch "
    "tensors (torch.amp's API). For JAX use fmp.GradScaler (scaler.scale(loss), fmp.value_and_grad); otherwise "
    "convert with torch.as_tensor(x)."
)
_MSG_UNSCALE_TWICE = "unscale_() has already been called on this optimizer since the last update()."
_MSG_UNSCALE_AFTER_STEP = "unscale_() is being called after step()."
_MSG_FP16 = "Attempting to unscale FP16 gradients."
_MSG_CLOSURE = "Closure use is not currently supported if GradScaler is enabled."
_MSG_STEP_TWICE = "step() has already been called since the last update()."
_MSG_NO_INF_CHECKS_OPT = "No inf checks were recorded for this optimizer."
_MSG_NO_INF_CHECKS = "No inf checks were recorded prior to update."
_MSG_NEW_SCALE = (
    "new_scale should be a float or a 1-element torch.cuda.FloatTensor or torch.FloatTensor with requires_grad=False."
)
_MSG_EMPTY_STATE = (
    "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler."
)
_MSG_WHERE_TORCH = (
    "To see where it starts: [n for n, p in model.named_parameters() if p.grad is not None and "
    "not p.grad.isfinite().all()] before scaler.step(optimizer)."
)
_MSG_PICKLE = (
    "A GradScaler instance may only be pickled at the beginning of an iteration, or at the end after scaler.update()."
)
_MSG_GRAD_SCALER_KWARG = (
    "GradScaler is going to stop passing itself as a keyword argument to the passed optimizer. In the near "
    "future GradScaler registers `grad_scale: Tensor` and `found_inf: Tensor` to the passed optimizer and let "
    "the optimizer use them directly."
)


class _TorchOps:
    """The array adapter :func:`~fmp._core._scaler_rule.update_scale` needs, for torch tensors."""

    @staticmethod
    def where(cond: Any, a: Any, b: Any) -> torch.Tensor:
        return torch.where(cond, a, b)

    @staticmethod
    def isfinite(x: torch.Tensor) -> torch.Tensor:
        # |x| < inf is False for inf and NaN: torch.isfinite's answer in two ops instead of four
        return torch.abs(x) < math.inf

    @staticmethod
    def minimum(x: torch.Tensor, y: Any) -> torch.Tensor:
        return torch.clamp(x, max=y) if not isinstance(y, torch.Tensor) else torch.minimum(x, y)

    @staticmethod
    def maximum(x: torch.Tensor, y: Any) -> torch.Tensor:
        return torch.clamp(x, min=y) if not isinstance(y, torch.Tensor) else torch.maximum(x, y)

    @staticmethod
    def mul_f64(scale: torch.Tensor, factor: float) -> torch.Tensor:
        return (scale.double() * factor).float()


TORCH_OPS = _TorchOps()


def _fresh_optimizer_state() -> dict[str, Any]:
    # module level (not a lambda) so the defaultdict pickles
    return {"stage": OptState.READY, "found_inf_per_device": {}}


def _cuda_definitely_unavailable() -> bool:
    return not (torch.cuda.is_available() or importlib.util.find_spec("torch_xla"))


class _PerDevice:
    """Lazily made per-device copies of a 0-d tensor (one copy per device, then reused)."""

    def __init__(self, master: torch.Tensor) -> None:
        self.master = master
        self.copies: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        out = self.copies.get(device)
        if out is None:
            out = self.copies[device] = self.master.to(device=device, non_blocking=True, copy=True)
        return out


class GradScaler:
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
        inf flags found by ``unscale_`` are summed over it so every rank skips
        together. ``None`` (default) keeps the ranks independent, as torch's
        ``GradScaler`` does. The group is not pickled: set ``_process_group``
        again (or build a new scaler and ``load_state_dict``) after loading.
      max_consecutive_overflows: fmp's own: after this many iterations in a row
        whose ``step`` skipped the optimizer, ``update()`` warns once
        (:class:`fmp.ScaleHealthWarning`). It counts the decisions ``step``
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
            warnings.warn(_MSG_NO_CUDA, stacklevel=2)
            self._enabled = False
        if self._enabled:
            if growth_factor <= 1.0:
                raise AssertionError(_MSG_GROWTH)
            if backoff_factor >= 1.0:
                raise AssertionError(_MSG_BACKOFF)
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
            raise AssertionError(_MSG_SCALE_NONE.format(funcname))
        return self._scale, self._growth_tracker

    def _lazy_init_scale_growth_tracker(self, device: torch.device) -> None:
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=device)

    def _get_scale_async(self) -> torch.Tensor | None:
        return self._scale

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        return self._init_growth_tracker if self._growth_tracker is None else int(self._growth_tracker.item())

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        inv = _PerDevice(inv_scale)
        found = _PerDevice(found_inf)
        buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None:
                        continue
                    if not allow_fp16 and grad.dtype == torch.float16:
                        raise ValueError(_MSG_FP16)
                    if grad.is_sparse:
                        # duplicates of an fp16 sparse grad may overflow only once summed: check the coalesced values
                        if grad.dtype is torch.float16:
                            param.grad = grad = grad.coalesce()
                        grad = grad._values()
                    buckets.setdefault((grad.device, grad.dtype), []).append(grad)
            for (device, _), grads in buckets.items():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found.get(device), inv.get(device))
        return found.copies

    def _sync_found_inf(self, state: dict[str, Any]) -> None:
        """Sums this optimizer's inf flags over the process group (one collective, any number of devices)."""
        if self._process_group is None:
            return
        import torch.distributed as dist

        scale = self._scale
        if scale is None:  # pragma: no cover - guarded by the callers
            raise AssertionError(_MSG_SCALE_NONE.format("unscale_"))
        flags = [f.to(scale.device, non_blocking=True) for f in state["found_inf_per_device"].values()]
        total = torch.zeros((), dtype=torch.float32, device=scale.device)
        for flag in flags:
            total = total + flag
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self._process_group)
        state["found_inf_per_device"] = {scale.device: total}

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        one = torch.full((), 1.0, dtype=torch.float32, device=scale.device)
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=scale.device)
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, one, found_inf, True)
        self._sync_found_inf(state)
        return state["found_inf_per_device"]

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
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(outputs.device)
            scale = self._check_scale_growth_tracker("scale")[0]
            return outputs * scale.to(device=outputs.device, non_blocking=True)
        copies: list[_PerDevice] = []

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if not copies:
                    if self._scale is None:
                        self._lazy_init_scale_growth_tracker(value.device)
                    copies.append(_PerDevice(self._check_scale_growth_tracker("scale")[0]))
                return value * copies[0].get(value.device)
            if hasattr(value, "dtype") or hasattr(value, "__array__") or hasattr(value, "__dlpack__"):
                kind = f"{type(value).__module__}.{type(value).__qualname__}"
                raise ValueError(_MSG_FOREIGN_OUTPUTS.format(kind=kind))
            if isinstance(value, abc.Iterable):
                mapped = map(apply, value)
                return type(value)(mapped) if isinstance(value, list | tuple) else mapped
            raise ValueError(_MSG_OUTPUTS)

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
            raise RuntimeError(_MSG_UNSCALE_TWICE)
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError(_MSG_UNSCALE_AFTER_STEP)
        # the reciprocal in float64, as torch (float32 division can be inexact under some compile options)
        inv_scale = scale.double().reciprocal().float() if scale.device.type != "mps" else scale.reciprocal()
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=scale.device)
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, inv_scale, found_inf, False)
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
            raise RuntimeError(_MSG_CLOSURE)
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError(_MSG_STEP_TWICE)
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._fused_step(optimizer, state, args, kwargs)
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if len(state["found_inf_per_device"]) == 0:
            raise AssertionError(_MSG_NO_INF_CHECKS_OPT)
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
            warnings.warn(_MSG_GRAD_SCALER_KWARG, FutureWarning, stacklevel=3)
            kwargs.update({"grad_scaler": self})
        else:
            if state["stage"] is OptState.READY:
                self._check_inf_per_device(optimizer)
            scale = self._check_scale_growth_tracker("step")[0]
            found_inf = sum([t.to(scale.device, non_blocking=True) for t in state["found_inf_per_device"].values()])
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
        :func:`fmp._core._scaler_rule.update_scale`. Makes no host sync.

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
                    raise AssertionError(_MSG_NEW_SCALE)
                if new_scale.numel() != 1:
                    raise AssertionError(_MSG_NEW_SCALE)
                if new_scale.requires_grad is True:
                    raise AssertionError(_MSG_NEW_SCALE)
                scale.copy_(new_scale)
        else:
            flags = [
                flag.to(device=scale.device, non_blocking=True)
                for state in self._per_optimizer_states.values()
                for flag in state["found_inf_per_device"].values()
            ]
            if not flags:
                raise AssertionError(_MSG_NO_INF_CHECKS)
            found = flags[0]
            for flag in flags[1:]:
                found = found + flag
            new, new_tracker = _scaler_rule.update_scale(
                scale,
                tracker,
                found != 0,
                growth_factor=self._growth_factor,
                backoff_factor=self._backoff_factor,
                growth_interval=self._growth_interval,
                ops=TORCH_OPS,
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
                    where="fmp.torch.GradScaler",
                    count=self._consecutive_overflows,
                    limit=self._max_consecutive_overflows,
                    scale=self.get_scale(),
                    hint=_MSG_WHERE_TORCH,
                )
                warnings.warn(msg, _scaler_rule.ScaleHealthWarning, stacklevel=3)
        elif known and len(known) == len(self._per_optimizer_states):
            self._consecutive_overflows = 0

    def get_scale(self) -> float:
        """The current scale as a Python number (1.0 when disabled); a host sync."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def get_growth_factor(self) -> float:
        """The growth factor."""
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Sets the growth factor."""
        self._growth_factor = new_factor

    def get_backoff_factor(self) -> float:
        """The backoff factor."""
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Sets the backoff factor."""
        self._backoff_factor = new_factor

    def get_growth_interval(self) -> int:
        """The growth interval."""
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Sets the growth interval."""
        self._growth_interval = new_interval

    def is_enabled(self) -> bool:
        """Whether this scaler is enabled."""
        return self._enabled

    def state_dict(self) -> dict[str, Any]:
        """torch's five-key scaler state (``{}`` when disabled); loads into ``fmp.GradScaler`` too."""
        if not self._enabled:
            return {}
        return _scaler_rule.make_state_dict(
            scale=self.get_scale(),
            growth_tracker=self._get_growth_tracker(),
            growth_factor=self._growth_factor,
            backoff_factor=self._backoff_factor,
            growth_interval=self._growth_interval,
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a scaler state written by this class, ``torch.amp.GradScaler`` or ``fmp.GradScaler``.

        A no-op when disabled. Unlike torch, every key is checked before anything
        is changed, so a bad dict leaves the scaler as it was.

        Raises:
          RuntimeError: ``state_dict`` is empty (torch's message).
          KeyError: a key is missing (torch's type; the first missing key).
        """
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(_MSG_EMPTY_STATE)
        for key in _scaler_rule.STATE_DICT_KEYS:
            if key not in state_dict:
                raise KeyError(key)
        values = _scaler_rule.parse_state_dict(state_dict)
        self._init_scale = values["scale"]
        self._growth_factor = values["growth_factor"]
        self._backoff_factor = values["backoff_factor"]
        self._growth_interval = values["growth_interval"]
        self._init_growth_tracker = values["_growth_tracker"]
        if self._scale is not None:
            self._scale.fill_(values["scale"])
        if self._growth_tracker is not None:
            self._growth_tracker.fill_(values["_growth_tracker"])

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if len(self._per_optimizer_states) != 0:
                raise AssertionError(_MSG_PICKLE)
            # the tensors are re-created lazily from the _init_* values after unpickling
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            state["_scale"] = None
            state["_growth_tracker"] = None
        state["_process_group"] = None  # process groups do not pickle; pass it again after loading
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
