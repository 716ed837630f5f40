"""The dynamic loss-scale update rule and the scaler checkpoint format.

One source of truth for both frameworks: the JAX ``GradScaler`` and the torch
facade call ``update_scale`` with their own array namespace, and both read
and write checkpoints through ``make_state_dict`` / ``parse_state_dict``,
so a checkpoint written by one side loads in the other.

The rule is torch's ``_amp_update_scale_`` (CPU and CUDA kernels):

* a non-finite step multiplies the scale by ``backoff_factor`` and resets the
  growth tracker;
* the ``growth_interval``-th consecutive finite step (``tracker + 1 ==
  interval``, not ``>=``) multiplies the scale by ``growth_factor`` unless the
  result would be non-finite, and resets the tracker in either case;
* products are computed as ``float32(float64(scale) * factor)``, so factors that
  are not powers of two (1.1, 0.3) give torch's exact bits.

fmp adds two things, both off by default so the default trajectory equals torch's:
optional ``min_scale`` / ``max_scale`` clamps, and a growth tracker that
saturates at ``2**31 - 1`` instead of wrapping.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

INT32_MAX = 2**31 - 1
# the scale is float32: a value outside [smallest normal, largest finite] would be stored as 0 or inf
# (XLA on CPU flushes float32 denormals to zero)
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38

STATE_DICT_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")

# Scale health: a run this long of non-finite steps in a row is reported (a flag in the JAX state, a
# warning from the torch facade and from fmp.check_scaler_health). With backoff_factor=0.5 it has
# divided the scale by 2**32 by then: no overflow of a healthy float16 run needs that.
DEFAULT_MAX_CONSECUTIVE_OVERFLOWS = 32


class ScaleHealthWarning(UserWarning):
    """A loss scaler has seen a long run of non-finite steps, or its scale is no longer a finite number > 0.

    `fmp.check_scaler_health` and ``fmp.torch.GradScaler`` warn with it.

    Examples:
      >>> import warnings
      >>> scaler = fmp.GradScaler(max_consecutive_overflows=2)
      >>> for _ in range(2):
      ...     scaler = scaler.update(jnp.bool_(False))
      >>> with warnings.catch_warnings(record=True) as w:
      ...     warnings.simplefilter("always")
      ...     fmp.check_scaler_health(scaler)
      False
      >>> w[0].category is fmp.ScaleHealthWarning
      True
    """


_MSG_HEALTH = (
    "{where}: {count} non-finite steps in a row (limit {limit}); every one was skipped and the loss scale is "
    "now {scale!r}. This is not ordinary float16 overflow: something produces inf/NaN whatever the scale "
    "(a NaN in the data, a log of 0, a division by 0, a diverged run). {hint}"
)
_MSG_BAD_SCALE = (
    "{where}: the loss scale is {scale!r}; it must be a finite number > 0 for the gradients to be unscaled. "
    "Set min_scale (or load a good checkpoint). {hint}"
)
HINT_LEAVES = "Non-finite gradient leaves: {leaves}."
HINT_NO_LEAVES = "Pass the gradients to fmp.check_scaler_health(state, grads) (or call fmp.nonfinite_leaves(grads)) to see where it starts."


def health_message(*, where: str, count: int, limit: int, scale: float, hint: str) -> str | None:
    """The text of a `ScaleHealthWarning`, or None if ``count`` and ``scale`` are healthy."""
    if not (math.isfinite(scale) and scale > 0):
        return _MSG_BAD_SCALE.format(where=where, scale=scale, hint=hint)
    if count >= limit:
        return _MSG_HEALTH.format(where=where, count=count, limit=limit, scale=scale, hint=hint)
    return None


def check_limit(value: Any, name: str) -> None:
    """Validates a consecutive-overflow limit (an int >= 1)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= 1, got {value!r} of type {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def check_new_scale(value: Any) -> None:
    """Rejects a Python-number ``new_scale`` that is not finite and > 0 (ValueError naming it)."""
    if isinstance(value, bool):
        raise TypeError(f"new_scale must be a float scalar, got {value!r}")
    if isinstance(value, int | float):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"new_scale must be a finite number > 0, got {value!r}")
        _fits_float32(value, "new_scale")


class ArrayOps(Protocol):
    """What the update rule needs from an array library (JAX or torch)."""

    def where(self, cond: Any, a: Any, b: Any) -> Any: ...
    def isfinite(self, x: Any) -> Any: ...
    def minimum(self, x: Any, y: Any) -> Any: ...
    def maximum(self, x: Any, y: Any) -> Any: ...
    def mul_f64(self, scale: Any, factor: float) -> Any:
        """``float32(float64(scale) * factor)`` as a float32 array."""
        ...


def update_scale(
    scale: Any,
    growth_tracker: Any,
    found_inf: Any,
    *,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    ops: ArrayOps,
    min_scale: float | None = None,
    max_scale: float | None = None,
) -> tuple[Any, Any]:
    """One step of the loss-scale schedule; pure, branch-free, no host sync.

    Args:
      scale: float32 scalar array.
      growth_tracker: int32 scalar array, consecutive finite steps so far.
      found_inf: bool scalar array, True if this step's gradients had inf/NaN.
      growth_factor, backoff_factor, growth_interval: static hyper-parameters.
      ops: array namespace adapter (see ``ArrayOps``).
      min_scale, max_scale: optional static clamps applied to the new scale.

    Returns:
      ``(new_scale, new_growth_tracker)``.
    """
    grown = ops.mul_f64(scale, growth_factor)
    backed_off = ops.mul_f64(scale, backoff_factor)
    successful = ops.minimum(growth_tracker, INT32_MAX - 1) + 1
    at_interval = successful == growth_interval
    grow = at_interval & ops.isfinite(grown)
    new_scale = ops.where(found_inf, backed_off, ops.where(grow, grown, scale))
    new_tracker = ops.where(found_inf | at_interval, 0, successful)
    if min_scale is not None:
        new_scale = ops.maximum(new_scale, min_scale)
    if max_scale is not None:
        new_scale = ops.minimum(new_scale, max_scale)
    return new_scale, new_tracker


def check_hparams(
    *,
    init_scale: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    min_scale: float | None = None,
    max_scale: float | None = None,
) -> None:
    """Validates scaler hyper-parameters; raises ValueError/TypeError naming the argument."""
    _real(init_scale, "init_scale")
    if not (math.isfinite(init_scale) and init_scale > 0):
        raise ValueError(f"init_scale must be a finite number > 0, got {init_scale!r}")
    _fits_float32(init_scale, "init_scale")
    _real(growth_factor, "growth_factor")
    if not (math.isfinite(growth_factor) and growth_factor > 1.0):
        raise ValueError(f"growth_factor must be a finite number > 1.0, got {growth_factor!r}")
    _real(backoff_factor, "backoff_factor")
    if not 0.0 < backoff_factor < 1.0:
        raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, int):
        raise TypeError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
    if growth_interval < 1:
        raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
    for name, value in (("min_scale", min_scale), ("max_scale", max_scale)):
        if value is not None:
            _real(value, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0 or None, got {value!r}")
            _fits_float32(value, name)
    if min_scale is not None and max_scale is not None and min_scale > max_scale:
        raise ValueError(f"min_scale ({min_scale!r}) must be <= max_scale ({max_scale!r})")


def _fits_float32(value: float, name: str) -> None:
    if not FLOAT32_TINY <= value <= FLOAT32_MAX:
        raise ValueError(
            f"{name} must be between {FLOAT32_TINY!r} and {FLOAT32_MAX!r} (normal float32 numbers), got {value!r}: "
            "the scale is stored in float32, where it would become 0 or inf"
        )


def _real(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a Python number, got {value!r} of type {type(value).__name__}")


def make_state_dict(
    *, scale: float, growth_tracker: int, growth_factor: float, backoff_factor: float, growth_interval: int
) -> dict[str, Any]:
    """torch's ``GradScaler.state_dict()`` layout: five keys, Python float/int values."""
    return {
        "scale": float(scale),
        "growth_factor": float(growth_factor),
        "backoff_factor": float(backoff_factor),
        "growth_interval": int(growth_interval),
        "_growth_tracker": int(growth_tracker),
    }


def parse_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Reads a five-key scaler state dict (from fmp or torch) into plain Python values.

    Accepts 0-d arrays/tensors as values (``float()``/``int()`` of them).

    Raises:
      TypeError: ``state_dict`` is not a mapping, or a value is not a number.
      ValueError: it is empty (saved from a disabled scaler) or lacks a key.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
    if not state_dict:
        raise ValueError(
            "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler."
        )
    missing = [k for k in STATE_DICT_KEYS if k not in state_dict]
    if missing:
        raise ValueError(f"scaler state_dict lacks keys {missing}; expected the keys {list(STATE_DICT_KEYS)}")
    out: dict[str, Any] = {}
    for key in STATE_DICT_KEYS:
        convert = int if key in ("growth_interval", "_growth_tracker") else float
        value = state_dict[key]
        try:
            out[key] = convert(value)
        except (TypeError, ValueError):
            raise TypeError(
                f"state_dict[{key!r}] must be a number (or a 0-d array), got {value!r} of type {type(value).__name__}"
            ) from None
    return out
