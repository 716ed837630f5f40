"""``check_scaler_health``: a host-side report on a loss scaler, for logging steps outside ``jit``."""

from __future__ import annotations

import warnings
from typing import Any

import jax

from fmp._core import _scaler_rule
from fmp._core._scaler_rule import ScaleHealthWarning
from fmp._scaling._finite import nonfinite_leaves
from fmp._scaling._scaler import GradScaler

_MSG_NO_SCALER = (
    "check_scaler_health(state): expected an fmp.GradScaler, a state holding exactly one "
    "(fmp.optax.loss_scaled), or an fmp.optax.skip_nonfinite state; found {found}"
)


def _is_scaler(x: Any) -> bool:
    return isinstance(x, GradScaler)


def _is_skip_state(x: Any) -> bool:
    # fmp.optax.SkipNonfiniteState, duck-typed so that `import fmp` does not import optax
    return type(x).__name__ == "SkipNonfiniteState" and hasattr(x, "consecutive_skipped")


def check_scaler_health(state: Any, grads: Any = None, *, stacklevel: int = 2) -> bool:
    """Warns if a loss scaler has seen too many non-finite steps in a row, or its scale is unusable.

    The host-side partner of `fmp.GradScaler.overflow_alarm`: call it outside ``jit``
    every few hundred steps, or when you log. It reads two scalars in one transfer (the scale and the
    count of non-finite steps in a row), so it costs one small host sync and nothing on the hot path.
    It warns (`fmp.ScaleHealthWarning`) when

    * the count has reached the scaler's ``max_consecutive_overflows`` (default 32), or
    * the scale is not a finite number > 0 (it underflowed to 0, or was set to NaN).

    With ``grads``, the warning names the non-finite leaves (`fmp.nonfinite_leaves`), which is
    where the inf/NaN comes from.

    Args:
      state: An `fmp.GradScaler`, an optimizer state holding exactly one (from
        ``fmp.optax.loss_scaled``, nested anywhere), or an ``fmp.optax.skip_nonfinite`` state
        (checked against the default limit of 32).
      grads: Optional gradients of the last step, to name the leaves that hold inf/NaN.
      stacklevel: Passed to ``warnings.warn``.

    Returns:
      True if healthy (no warning), False if it warned. A disabled scaler is always healthy.

    Raises:
      TypeError: ``state`` holds no scaler (or more than one).

    Examples:
      >>> s = fmp.GradScaler(init_scale=4.0, max_consecutive_overflows=2)
      >>> fmp.check_scaler_health(s)
      True
      >>> s = s.update(jnp.array(False)).update(jnp.array(False))
      >>> import warnings
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     fmp.check_scaler_health(s, {"w": jnp.ones(2), "b": jnp.array([jnp.nan])})
      False
      >>> print(caught[0].message)  # doctest: +ELLIPSIS
      GradScaler: 2 non-finite steps in a row (limit 2); ... Non-finite gradient leaves: ["['b']"].
    """
    if isinstance(state, GradScaler):
        scalers, skips = [state], []
    else:
        found = jax.tree.leaves(state, is_leaf=lambda x: _is_scaler(x) or _is_skip_state(x))
        scalers = [x for x in found if _is_scaler(x)]
        skips = [x for x in found if _is_skip_state(x)]
    if len(scalers) + len(skips) != 1:
        raise TypeError(_MSG_NO_SCALER.format(found=f"{len(scalers)} scalers and {len(skips)} skip states"))
    if scalers:
        sc = scalers[0]
        if not sc.enabled:
            return True
        scale, count = jax.device_get((sc.loss_scale, sc.consecutive_overflows))
        limit, where = sc.max_consecutive_overflows, "GradScaler"
    else:
        scale, count = 1.0, jax.device_get(skips[0].consecutive_skipped)
        limit, where = _scaler_rule.DEFAULT_MAX_CONSECUTIVE_OVERFLOWS, "skip_nonfinite"
    facts = dict(where=where, count=int(count), limit=limit, scale=float(scale))
    if _scaler_rule.health_message(**facts, hint="") is None:
        return True  # healthy: the gradients are not scanned
    if grads is None:
        hint = _scaler_rule.HINT_NO_LEAVES
    else:
        hint = _scaler_rule.HINT_LEAVES.format(leaves=nonfinite_leaves(grads))
    msg = _scaler_rule.health_message(**facts, hint=hint)
    warnings.warn(msg, ScaleHealthWarning, stacklevel=stacklevel)
    return False
