"""apex-compatible loss scalers, on the shared fmp update rule and torch's element-wise inf check.

Three classes live here:

* `LossScaler` and `DynamicLossScaler`:
  the classes apex exported from
  ``apex.fp16_utils`` (``loss_scaler.py``), same names, attributes and defaults.
* ``AmpLossScaler``: the scaler `FP16_Optimizer` actually uses. Since 2019
  apex's ``FP16_Optimizer`` drives ``apex.amp.scaler.LossScaler`` (init 2**16, window 2000, max 2**24,
  optional min, factor hard-coded to 2), not the exported ``DynamicLossScaler``; we keep that split.

Both dynamic schedules are the torch/fmp rule in ``fmp._core._scaler_rule.update_scale`` (same cadence
as apex: grow after ``window`` consecutive clean updates, back off and restart the count on an overflow),
run on Python scalars. Overflow is detected element-wise, never by summing (see ``non_finite_check``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from fmp._core import _scaler_rule


class _PyOps:
    """``fmp._core._scaler_rule.ArrayOps`` over Python scalars (the apex scalers are host-side)."""

    @staticmethod
    def where(cond: Any, a: Any, b: Any) -> Any:
        return a if cond else b

    @staticmethod
    def isfinite(x: Any) -> bool:
        return math.isfinite(x)

    @staticmethod
    def minimum(x: Any, y: Any) -> Any:
        return min(x, y)

    @staticmethod
    def maximum(x: Any, y: Any) -> Any:
        return max(x, y)

    @staticmethod
    def mul_f64(scale: Any, factor: float) -> float:
        with np.errstate(over="ignore"):
            return float(np.float32(float(scale) * factor))


_OPS = _PyOps()


def non_finite_check(grads: Iterable[torch.Tensor | None], inv_scale: float = 1.0) -> dict[torch.device, torch.Tensor]:
    """Multiplies every grad by ``inv_scale`` in place and flags any inf/NaN element, per device.

    Runs torch's ``_amp_foreach_non_finite_check_and_unscale_`` kernel (the one ``torch.amp.GradScaler`` uses)
    once per (device, dtype) bucket, on CPU and CUDA alike. The check is **element-wise**: finite values whose
    sum overflows (``[3e38, 3e38]`` in float32) are not an overflow, unlike apex's Python fallback, which summed
    each grad and so reported a false positive. No host synchronisation happens here.

    Args:
      grads: Tensors (None entries are skipped). Sparse tensors are not supported.
      inv_scale: Multiplier applied to every element (``1.0`` checks without scaling).

    Returns:
      ``{device: found_inf}``, each a 1-element float32 tensor on its device, ``1.0`` where a
      non-finite element was seen.

    Examples:
      >>> import torch
      >>> from fmp.torch.fp16_utils._loss_scaler import non_finite_check
      >>> g = [torch.tensor([3e38, 3e38]), torch.tensor([2.0, 4.0])]
      >>> found = non_finite_check(g, 0.5)
      >>> float(found[torch.device("cpu")]), g[1].tolist()
      (0.0, [1.0, 2.0])
    """
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        if g is not None:
            buckets[(g.device, g.dtype)].append(g)
    found: dict[torch.device, torch.Tensor] = {}
    invs: dict[torch.device, torch.Tensor] = {}
    for (device, _), bucket in buckets.items():
        if device not in found:
            found[device] = torch.zeros(1, dtype=torch.float32, device=device)
            invs[device] = torch.full((1,), inv_scale, dtype=torch.float32, device=device)
        with torch.no_grad():
            torch._amp_foreach_non_finite_check_and_unscale_(bucket, found[device], invs[device])
    return found


def _any_found(found: dict[torch.device, torch.Tensor]) -> bool:
    """One host sync per device: True if any device saw a non-finite element."""
    return any(bool(f.item()) for f in found.values())


class LossScaler:
    """A static loss scale (apex ``fp16_utils.LossScaler``).

    Meant to be driven by an optimizer wrapper; ``has_overflow`` is always False and
    ``update_scale`` does nothing.

    Args:
      scale: The loss scale.

    Examples:
      >>> from fmp.torch.fp16_utils import LossScaler
      >>> s = LossScaler(128.0)
      >>> s.loss_scale, s.has_overflow([])
      (128.0, False)
    """

    def __init__(self, scale: float = 1) -> None:
        self.cur_scale = scale

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        """Always False: a static scaler never checks."""
        return False

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        return False

    def update_scale(self, overflow: bool) -> None:
        """No-op."""

    @property
    def loss_scale(self) -> float:
        """The current loss scale."""
        return self.cur_scale

    def scale_gradient(self, module: Any, grad_in: tuple[torch.Tensor, ...], grad_out: Any) -> tuple[torch.Tensor, ...]:
        """Backward-hook helper: multiplies each incoming grad by the loss scale."""
        return tuple(self.loss_scale * g for g in grad_in)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """``(loss * loss_scale).backward(retain_graph=retain_graph)``."""
        (loss * self.loss_scale).backward(retain_graph=retain_graph)


class DynamicLossScaler(LossScaler):
    """A dynamic loss scale with apex ``fp16_utils.DynamicLossScaler`` semantics.

    On an overflow the scale becomes ``max(scale / scale_factor, 1)`` (apex's **floor of 1**, kept); after
    ``scale_window`` consecutive updates without overflow it is multiplied by ``scale_factor``. The schedule
    is fmp's shared update rule (``growth_factor=scale_factor``, ``backoff_factor=1/scale_factor``,
    ``min_scale=1``), which has apex's cadence: the first growth happens on the ``scale_window``-th clean
    update (``cur_iter == scale_window - 1``). Differences from apex, all documented:

    * overflow is detected element-wise (``torch.isfinite`` semantics, reduced on device), not by summing
      each grad, so finite grads whose sum overflows are no longer a false positive;
    * the scale is kept float32-representable (``loss.float() * scale`` uses it in float32 anyway) and does
      not grow past float32's largest value; apex grew a Python float without bound;
    * the backoff multiplies by ``1/scale_factor`` (identical to apex's division for powers of two).

    Args:
      init_scale: Initial loss scale (apex default ``2**32``).
      scale_factor: Growth factor; the backoff is its reciprocal. Must be > 1.
      scale_window: Consecutive clean updates before growing. Must be an int >= 1.

    Raises:
      ValueError, TypeError: an argument is out of range or of the wrong type (named in the message).

    Examples:
      >>> from fmp.torch.fp16_utils import DynamicLossScaler
      >>> s = DynamicLossScaler(init_scale=4.0, scale_window=2)
      >>> s.update_scale(True); s.loss_scale
      2.0
      >>> s.update_scale(False); s.update_scale(False); s.loss_scale
      4.0
      >>> for _ in range(5): s.update_scale(True)
      >>> s.loss_scale  # never below 1
      1.0
    """

    def __init__(self, init_scale: float = 2**32, scale_factor: float = 2.0, scale_window: int = 1000) -> None:
        _scaler_rule.check_hparams(
            init_scale=init_scale,
            growth_factor=scale_factor,
            backoff_factor=0.5,
            growth_interval=scale_window,
        )
        super().__init__(_OPS.mul_f64(init_scale, 1.0))
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self._growth_tracker = 0

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        """True if any ``p.grad`` holds an inf or NaN element (element-wise; one host sync)."""
        return _any_found(non_finite_check(p.grad for p in params))

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        return _any_found(non_finite_check([x.detach()]))

    def update_scale(self, overflow: bool) -> None:
        """Advances the schedule by one update; ``overflow`` says whether this step's grads overflowed."""
        self.cur_scale, self._growth_tracker = _scaler_rule.update_scale(
            self.cur_scale,
            self._growth_tracker,
            bool(overflow),
            growth_factor=self.scale_factor,
            backoff_factor=1.0 / self.scale_factor,
            growth_interval=self.scale_window,
            ops=_OPS,
            min_scale=1.0,
        )
        if overflow:
            self.last_overflow_iter = self.cur_iter
        self.cur_iter += 1


class AmpLossScaler:
    """``apex.amp.scaler.LossScaler`` semantics, the scaler inside apex's ``FP16_Optimizer`` since 2019.

    ``loss_scale()`` is a method. A static scaler never checks for overflow (apex's contract: inf grads are
    stepped). A dynamic one halves on overflow (floored at ``min_loss_scale`` if given, else no floor) and
    doubles after ``scale_window`` consecutive clean updates, capped at ``max_loss_scale``. ``scale_factor``
    is accepted and **ignored**: apex hard-codes 2.
    """

    def __init__(
        self,
        loss_scale: float | str,
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 2000,
        min_loss_scale: float | None = None,
        max_loss_scale: float = 2.0**24,
    ) -> None:
        self.dynamic = loss_scale == "dynamic"
        # apex treats min_loss_scale=0 like None (`if self._min_loss_scale:`)
        min_scale = float(min_loss_scale) if min_loss_scale else None
        if self.dynamic:
            _scaler_rule.check_hparams(
                init_scale=init_scale,
                growth_factor=2.0,
                backoff_factor=0.5,
                growth_interval=scale_window,
                min_scale=min_scale,
                max_scale=max_loss_scale,
            )
            scale = min(float(max_loss_scale), float(init_scale))
        else:
            if isinstance(loss_scale, bool) or not isinstance(loss_scale, int | float):
                raise TypeError(f"static_loss_scale must be a Python number, got {loss_scale!r}")
            if not (math.isfinite(loss_scale) and loss_scale > 0):
                raise ValueError(f"static_loss_scale must be a finite number > 0, got {loss_scale!r}")
            scale = float(loss_scale)
        self._loss_scale = scale
        self._scale_seq_len = scale_window
        self._min_loss_scale = min_scale
        self._max_loss_scale = float(max_loss_scale)
        self._unskipped = 0
        self._found: dict[torch.device, torch.Tensor] = {}

    def loss_scale(self) -> float:
        return self._loss_scale

    def clear_overflow_state(self) -> None:
        self._found = {}

    def unscale(self, grads: list[torch.Tensor]) -> None:
        """Multiplies ``grads`` by ``1/loss_scale`` in place; a dynamic scaler also records inf/NaN."""
        inv = 1.0 / self._loss_scale
        if self.dynamic:
            for device, found in non_finite_check(grads, inv).items():
                prev = self._found.get(device)
                self._found[device] = found if prev is None else prev + found
        elif inv != 1.0 and grads:
            with torch.no_grad():
                torch._foreach_mul_(grads, inv)

    def update_scale(self) -> bool:
        """Advances the schedule; returns True if this step must be skipped (dynamic and overflowed)."""
        if not self.dynamic:
            return False
        overflow = _any_found(self._found)
        self._loss_scale, self._unskipped = _scaler_rule.update_scale(
            self._loss_scale,
            self._unskipped,
            overflow,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=self._scale_seq_len,
            ops=_OPS,
            min_scale=self._min_loss_scale,
            max_scale=self._max_loss_scale,
        )
        return overflow

    def state_dict(self) -> dict[str, Any]:
        """The five-key fmp/torch scaler layout plus apex's extra fields; plain Python values only."""
        out = _scaler_rule.make_state_dict(
            scale=self._loss_scale,
            growth_tracker=self._unskipped,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=self._scale_seq_len,
        )
        out.update(dynamic=self.dynamic, min_loss_scale=self._min_loss_scale, max_loss_scale=self._max_loss_scale)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        parsed = _scaler_rule.parse_state_dict(state)
        self._loss_scale = parsed["scale"]
        self._unskipped = parsed["_growth_tracker"]
        self._scale_seq_len = parsed["growth_interval"]
        self.dynamic = bool(state.get("dynamic", self.dynamic))
        self._min_loss_scale = state.get("min_loss_scale", self._min_loss_scale)
        self._max_loss_scale = float(state.get("max_loss_scale", self._max_loss_scale))
