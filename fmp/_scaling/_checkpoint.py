"""GradScaler's checkpoints: torch's five-key state dict (either framework loads the other's) and the
``flax.serialization`` state of its three arrays.

``ScalerCheckpoint`` holds the methods; ``fmp.GradScaler`` inherits them, so its own module keeps the
scaling math. Both read the host only here, off the hot path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Self

import jax
import jax.numpy as jnp
import numpy as np

from fmp import _flax_serialization
from fmp._core import _scaler_rule

_MSG_FLAX_FIX = "Save GradScaler.state_dict() instead, or report this flax version."


def flax_state(s: Any) -> dict[str, Any]:
    """The scaler's arrays, as ``flax.serialization.to_state_dict`` saves them."""
    return {
        "loss_scale": s.loss_scale,
        "growth_tracker": s.growth_tracker,
        "consecutive_overflows": s.consecutive_overflows,
    }


def from_flax_state(target: Any, state: dict[str, Any]) -> Any:
    """``target`` with the arrays of a ``flax_state`` dict (static fields kept from ``target``)."""
    return dataclasses.replace(
        target,
        loss_scale=jnp.asarray(state["loss_scale"], jnp.float32),
        growth_tracker=jnp.asarray(state["growth_tracker"], jnp.int32),
        # absent from checkpoints written before the field existed
        consecutive_overflows=jnp.asarray(state.get("consecutive_overflows", 0), jnp.int32),
    )


def register_flax(cls: type) -> None:
    """Hands ``cls`` (the scaler class) to ``flax.serialization``, now or when flax is imported."""
    _flax_serialization.register_type(cls, flax_state, from_flax_state, _MSG_FLAX_FIX)


class ScalerCheckpoint:
    """Checkpoint methods of ``fmp.GradScaler`` (torch's names); the fields are the scaler's."""

    enabled: bool
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    min_scale: float | None
    max_scale: float | None
    dynamic: bool
    max_consecutive_overflows: int
    loss_scale: jax.Array
    growth_tracker: jax.Array

    def state_dict(self) -> dict[str, Any]:
        """torch's five-key checkpoint: ``scale``, ``growth_factor``, ``backoff_factor`` (float),
        ``growth_interval``, ``_growth_tracker`` (int). Empty for a disabled scaler, like torch.

        Reads the arrays to the host: call it outside ``jit``.

        Examples:
          >>> fmp.GradScaler(init_scale=1024.0).state_dict()["scale"]
          1024.0
        """
        if not self.enabled:
            return {}
        return _scaler_rule.make_state_dict(
            scale=float(jax.device_get(self.loss_scale)),
            growth_tracker=int(jax.device_get(self.growth_tracker)),
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval,
        )

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, Any], **overrides: Any) -> Self:
        """Builds a scaler from a five-key dict written by fmp or by ``torch.amp.GradScaler.state_dict()``.

        Args:
          state_dict: The checkpoint.
          **overrides: Constructor arguments to set or replace (``min_scale``, ``dynamic``, ...).

        Raises:
          ValueError: the dict is empty (saved from a disabled scaler) or lacks a key.

        Examples:
          >>> d = {"scale": 512.0, "growth_factor": 2.0, "backoff_factor": 0.5,
          ...      "growth_interval": 100, "_growth_tracker": 7}
          >>> s = fmp.GradScaler.from_state_dict(d)
          >>> s.loss_scale, s.growth_tracker, s.growth_interval
          (Array(512., dtype=float32), Array(7, dtype=int32), 100)
        """
        values = _scaler_rule.parse_state_dict(state_dict)
        kwargs: dict[str, Any] = {
            "init_scale": values["scale"],
            "growth_factor": values["growth_factor"],
            "backoff_factor": values["backoff_factor"],
            "growth_interval": values["growth_interval"],
        }
        kwargs.update(overrides)
        scaler = cls(**kwargs)
        tracker = np.int32(min(max(values["_growth_tracker"], 0), _scaler_rule.INT32_MAX))
        return dataclasses.replace(scaler, growth_tracker=jnp.asarray(tracker, jnp.int32))

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> Self:
        """Returns a new scaler holding ``state_dict``'s state (torch's name; nothing is mutated).

        Unlike torch's (and ``fmp.torch.GradScaler``'s) ``load_state_dict``, which loads in place and returns
        None, this one returns the loaded scaler, as an immutable pytree must: write
        ``scaler = scaler.load_state_dict(sd)``. The hyper-parameters come from the dict, like torch; ``enabled``, ``min_scale``,
        ``max_scale``, ``dynamic`` and ``max_consecutive_overflows`` are kept from ``self``. A disabled scaler returns itself.
        """
        if not self.enabled:
            return self
        return type(self).from_state_dict(
            state_dict,
            min_scale=self.min_scale,
            max_scale=self.max_scale,
            dynamic=self.dynamic,
            max_consecutive_overflows=self.max_consecutive_overflows,
        )

    @classmethod
    def register_flax_serialization(cls) -> None:
        """Registers GradScaler with ``flax.serialization`` now (imports flax).

        Not needed: ``import fmp`` arranges for the registration to happen whenever flax is imported,
        before or after fmp, so ``flax.serialization.to_state_dict(scaler)`` and ``to_bytes`` work as they
        are. Kept for code that calls it; calling it again is harmless.
        """
        _flax_serialization.register_now(cls)
