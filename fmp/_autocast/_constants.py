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

from fmp._autocast._lru import LRU
from fmp._autocast._provenance import Frame, into, is_inline_call, up

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

_STEPS = 256  # a walk that visits more values than this gives up (the value counts as a runtime value)

# id(array) -> (array, its largest finite magnitude): a closed-over array is measured once
_MEASURED = LRU(256)


def bound(var: Any, frame: Frame) -> float | None:
    """The largest finite magnitude ``var`` can take if all its values are known while tracing, else None."""
    stack, seen, best = [(var, frame)], set(), 0.0
    while stack:
        v, f = stack.pop()
        v = up(v, f)
        if isinstance(v, Literal):
            best = max(best, _magnitude(v.val))
            continue
        if (v, id(f)) in seen:
            continue
        seen.add((v, id(f)))
        if len(seen) > _STEPS:
            return None
        eqn = f.producers.get(v)
        if eqn is None:
            if v not in f.consts or isinstance(f.consts[v], jax.core.Tracer):
                return None  # an argument, or a value of an enclosing trace
            best = max(best, _magnitude(f.consts[v]))
        elif is_inline_call(eqn):
            stack.append(into(eqn, v, f)[::-1])
        elif eqn.primitive.name in _VALUES:
            stack.extend((u, f) for u in eqn.invars[_VALUES[eqn.primitive.name]])
        else:
            return None
    return best


def overflows(magnitude: float, dtype: str) -> bool:
    """Whether a finite value of ``magnitude`` rounds to infinity in ``dtype``."""
    return bool(np.isinf(np.asarray(magnitude, np.float64).astype(jnp.dtype(dtype))))


def _magnitude(x: Any) -> float:
    if isinstance(x, jax.Array):
        return _MEASURED.of(x, id(x), lambda: _device_max(x))
    a = np.abs(np.asarray(x)).astype(np.float64)
    return float(np.max(a, where=np.isfinite(a), initial=0.0))


def _device_max(x: jax.Array) -> float:
    """Measured where the array lives (no copy of a large closed-over array to the host)."""
    with jax.ensure_compile_time_eval():
        a = jnp.abs(x).astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.abs(x)
        return float(jnp.max(jnp.where(jnp.isfinite(a), a, 0), initial=0))
