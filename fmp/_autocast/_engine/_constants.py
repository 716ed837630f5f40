"""Values known while tracing, for the rule that no constant is cast into a dtype that cannot hold it.

A literal of the program, a constant it closes over, and what is built from
them by ops that only move or pick values (a broadcast, a reshape, a select
between constants, a concatenation, a slice, a negation) hold values known at
trace time. ``bound`` is the largest finite magnitude such a value can take,
found by walking the original program (across jnp's helper calls, as
``_provenance`` does); a value computed by anything else (from an argument, a
sum, a product) is a runtime value, whose bound is unknown. ``overflows`` tells
whether a bound rounds to infinity in a dtype.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from fmp._autocast._engine._lru import LRU
from fmp._autocast._engine._provenance import (
    Frame,
    into,
    is_inline_call,
    up,
)

# op -> the operands that carry its output's values (the others are indices, a predicate, shapes)
_VALUES: dict[str, slice] = {
    **dict.fromkeys(
        (
            "broadcast_in_dim",
            "convert_element_type",
            "copy",
            "copy_p",
            "dynamic_slice",
            "gather",
            "neg",
            "reshape",
            "rev",
            "slice",
            "squeeze",
            "transpose",
        ),
        slice(0, 1),
    ),
    "pad": slice(0, 2),
    "select_n": slice(1, None),
    "concatenate": slice(0, None),
}

# arithmetic on constants: op -> how the bounds of its operands bound its result (an upper bound: a sum
# bounded by the sum of magnitudes may overstate, which only keeps an op wider than it needed)
_ARITHMETIC = {
    "abs": lambda *m: max(m),
    "add": lambda *m: sum(m),
    "sub": lambda *m: sum(m),
    "max": lambda *m: max(m),
    "min": lambda *m: max(m),
    "mul": lambda a, b: a * b,
}

_STEPS = 256  # a walk that visits more values than this gives up (the value counts as a runtime value)

# id(array) -> (array, its largest finite magnitude): a closed-over array is measured once
_MEASURED = LRU(256)


def bound(var: Any, frame: Frame) -> float | None:
    """An upper bound of the finite magnitudes ``var`` can take if its values are known while tracing, else
    None (a runtime value). Answers are kept in ``frame.bounds``, so a program is walked once."""
    try:
        return _bound(var, frame, [_STEPS])
    except RecursionError:
        return None


def _bound(var: Any, frame: Frame, budget: list[int]) -> float | None:
    v = up(var, frame)
    if isinstance(v, Literal):
        return _magnitude(v.val)
    if v in frame.bounds:
        return frame.bounds[v]
    budget[0] -= 1
    if budget[0] < 0:
        return None  # not kept: another walk may get further
    frame.bounds[v] = None  # while this walk is under way
    eqn = frame.producers.get(v)
    result = None
    if eqn is None:
        const = frame.consts.get(v)
        if v in frame.consts and not isinstance(const, jax.core.Tracer):  # else an argument
            result = _magnitude(const)
    elif is_inline_call(eqn):
        body_frame, out = into(eqn, v, frame)
        result = _bound(out, body_frame, budget)
    elif eqn.primitive.name in _VALUES or eqn.primitive.name in _ARITHMETIC:
        name = eqn.primitive.name
        parts = []
        for u in eqn.invars[_VALUES[name]] if name in _VALUES else eqn.invars:
            parts.append(_bound(u, frame, budget))
            if parts[-1] is None:
                break
        if None not in parts:
            result = _ARITHMETIC[name](*parts) if name in _ARITHMETIC else max(parts)
    if budget[0] >= 0:
        frame.bounds[v] = result
    else:
        del frame.bounds[v]
    return result


def overflows(magnitude: float, dtype: str) -> bool:
    """Whether a finite value of ``magnitude`` rounds to infinity in ``dtype``."""
    with np.errstate(over="ignore"):
        return bool(np.isinf(np.asarray(magnitude, np.float64).astype(jnp.dtype(dtype))))


def _magnitude(x: Any) -> float:
    if isinstance(x, jax.Array):
        return _MEASURED.of(x, id(x), lambda: _device_max(x))
    a = np.abs(np.asarray(x)).astype(np.float64)
    return float(np.max(a, where=np.isfinite(a), initial=0.0))


def _device_max(x: jax.Array) -> float:
    """Measured where the array lives (no copy of a large closed-over array to the host)."""
    with jax.ensure_compile_time_eval():
        a = jnp.abs(x).astype(jnp.float32)
        return float(jnp.max(jnp.where(jnp.isfinite(a), a, jnp.float32(0)), initial=jnp.float32(0)))
