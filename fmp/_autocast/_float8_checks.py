"""What ``fmp.autocast`` refuses or warns about in its delayed-scaling float8 state.

A state that does not fit the function would give some matmul another's history, or none; a delayed policy
without a state would run current scaling while its user believes otherwise; one state differentiated
through two calls would get the sum of their amaxes. Each is an error naming the fix (the missing state a
warning: the program still runs, with current scaling).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import jax

from fmp._float8._recipe import Float8Recipe
from fmp._float8._state import Float8State
from fmp._policy import Policy

_MSG_NO_STATE = (
    "fmp.autocast(policy={policy!r}) asks for delayed float8 scaling but no float8_state was given, so every "
    "float8 matmul runs with current (tensorwise) scaling. Build the state with fmp.float8_state(fn, policy)"
    "(*args), pass it as float8_state= and differentiate the loss with respect to it (see fmp.Float8State), or "
    "use float8=tensorwise to ask for current scaling."
)
_MSG_NOT_DELAYED = (
    "fmp.autocast(float8_state=...) needs a policy with float8=delayed, got {policy!r}: its matmuls would never read "
    "the state. Use a delayed policy (e.g. 'p=f32,c=bf16,o=f32,float8=delayed'), or drop float8_state."
)
_MSG_HISTORY = (
    "float8_state keeps {have} steps of amax history but the policy's recipe asks for history_len={want}. Build "
    "the state with fmp.float8_state under the same policy (or give the recipe history_len={have})."
)
_MSG_SHARED = (
    "fmp.autocast: this float8_state was already used by another autocast call in the same differentiated "
    "function; its gradient (the next amax history) would be the sum of both calls' histories. Give each call "
    "its own state (fmp.float8_state of each function), or run both calls in one autocast function."
)


def delayed_recipes(policy: Policy, overrides: tuple[tuple[str, Policy], ...]) -> list[Float8Recipe]:
    """The delayed-scaling recipes of a policy and its overrides."""
    pols = [policy, *(p for _, p in overrides)]
    return [p.float8 for p in pols if p.float8 is not None and p.float8.scaling == "delayed"]


def check_state(
    state: Float8State | None, policy: Policy, overrides: tuple[tuple[str, Policy], ...], label: str
) -> None:
    """Raises (or warns, for a missing state) where ``state`` does not fit the policy."""
    recipes = delayed_recipes(policy, overrides)
    if state is None:
        if recipes:
            warnings.warn(_MSG_NO_STATE.format(policy=label), stacklevel=3)
        return
    if not isinstance(state, Float8State):
        raise TypeError(f"autocast(float8_state=...) expects an fmp.Float8State, got {type(state).__name__}")
    if not recipes:
        raise ValueError(_MSG_NOT_DELAYED.format(policy=label))
    have = state.amax_history.shape[-1]
    for r in recipes:
        if r.history_len != have or state.recipe.history_len != have:
            raise ValueError(_MSG_HISTORY.format(have=have, want=r.history_len))


# the histories handed to an autocast call while they are traced (id -> tracer, gone with the tracer)
_CLAIMED: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def claim(state: Float8State) -> None:
    """Raises if ``state``'s history (a traced value) already fed another autocast call."""
    hist = state.amax_history
    if not isinstance(hist, jax.core.Tracer):
        return
    if _CLAIMED.get(id(hist)) is hist:
        raise ValueError(_MSG_SHARED)
    _CLAIMED[id(hist)] = hist


_MSG_KEY_UNUSED = (
    "fmp.autocast(key=...): no matmul under policy {policy!r} (or its overrides) rounds stochastically, so the "
    "key changes nothing. Only an NVFP4 recipe ('mixed_nvfp4', float8=nvfp4) uses it, for its gradients."
)


def check_key(key: Any, policy: Policy, overrides: tuple[tuple[str, Policy], ...]) -> None:
    """Warns when a stochastic-rounding ``key`` meets no NVFP4 recipe; refuses a key that is not an array."""
    if key is None:
        return
    if not isinstance(key, jax.Array):
        raise TypeError(f"autocast(key=...) must be a jax.random key (jax.random.key(0)), got {type(key).__name__}")
    recipes = [policy.float8, *(p.float8 for _, p in overrides)]
    if not any(r is not None and r.scaling == "nvfp4" for r in recipes):
        warnings.warn(_MSG_KEY_UNUSED.format(policy=str(policy)), UserWarning, stacklevel=3)
