"""The torch facade scalers' settings and checkpoint: getters/setters, ``state_dict``, pickling.

torch.amp's names and behaviour; the checkpoint goes through fmp's shared format
(``fmp._core._scaler_rule.make_state_dict`` / ``parse_state_dict``), so it loads into
``torch.amp.GradScaler``, torch's ``ShardedGradScaler`` and ``fmp.GradScaler`` alike.
"""

from __future__ import annotations

from typing import Any

import torch

from fmp._core import _scaler_rule
from fmp.torch._scaler._messages import MSG_EMPTY_STATE, MSG_PICKLE


class ScalerSettings:
    """The part of `fmp.torch.GradScaler` that reads, writes, saves and loads its settings."""

    # set by GradScaler.__init__ (the hyper-parameters only when enabled, as in torch)
    _enabled: bool
    _init_scale: float
    _init_growth_tracker: int
    _growth_factor: float
    _backoff_factor: float
    _growth_interval: int
    _scale: torch.Tensor | None
    _growth_tracker: torch.Tensor | None
    _per_optimizer_states: dict[int, dict[str, Any]]

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        return self._init_growth_tracker if self._growth_tracker is None else int(self._growth_tracker.item())

    def _get_scale_async(self) -> torch.Tensor | None:
        return self._scale

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

        Loads in place and returns None, as torch's does; the JAX ``fmp.GradScaler.load_state_dict``
        returns a new scaler instead (an immutable pytree). A no-op when disabled. Unlike torch, every key is checked before anything
        is changed, so a bad dict leaves the scaler as it was.

        Raises:
          RuntimeError: ``state_dict`` is empty (torch's message).
          KeyError: a key is missing (torch's type; the first missing key).
        """
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(MSG_EMPTY_STATE)
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
                raise AssertionError(MSG_PICKLE)
            # the tensors are re-created lazily from the _init_* values after unpickling
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            state["_scale"] = None
            state["_growth_tracker"] = None
        state["_process_group"] = None  # process groups do not pickle; pass it again after loading
        if "process_group" in state:
            state["process_group"] = None  # ShardedGradScaler's; None is the default group
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
