"""Values known while tracing, for the rule that no constant is cast into a dtype that cannot hold it.

A literal of the program, a constant it closes over, and what is built from
them by ops that only move or pick values (a broadcast, a reshape, a select
between constants, a concatenation, a slice, a negation) hold values known at
trace time. ``bound`` is the largest finite magnitude such a value can take,
found by walking the original program (across jnp's helper calls, as
``_provenance`` does); sums, products, maxima and minima of such values are
bounded from their operands' bounds. A value computed by anything else (an
argument, a reduction, a matmul, a division, an exponential) is a runtime
value, whose bound is unknown. ``overflows`` tells whether a bound rounds to
infinity in a dtype.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Jaxpr, Literal

from fmp._autocast._engine._frames import Frame, is_inline_call
from fmp._autocast._engine._lru import LRU
from fmp._autocast._engine._provenance import STEPS, into, up

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

_STEPS = 256  # a walk that visits more new values than this gives up (the value counts as a runtime value)

# id(array) -> its largest finite magnitude, while the array lives: a closed-over array is measured once
_MEASURED = LRU(256)

_PENDING = object()  # a bound not found yet

_FLOATS = (float, np.floating)


def bound(var: Any, frame: Frame) -> float | None:
    """An upper bound of the finite magnitudes ``var`` can take if its values are known while tracing, else
    None (a runtime value).

    Answers are kept in the frame that holds each value (``Frame.bounds``, and the frames of the inline
    calls' bodies below it, ``Frame.children``), so a rewrite walks each value of its program once: a walk
    stops at values an earlier one measured. The walk keeps its own stack (no recursion, whatever the depth
    of the program) and gives up past ``_STEPS`` new values.
    """
    v, f = up(var, frame)
    if isinstance(v, Literal):
        return _magnitude(v.val)
    known = f.bounds.get(v, _PENDING)
    if known is not _PENDING:
        return known
    budget, top, top_frame = _STEPS, v, f
    stack: list[tuple[Any, Frame]] = [(v, f)]
    while stack:
        v, f = stack[-1]
        if v in f.bounds:  # reached twice on this walk
            stack.pop()
            continue
        need, result = _step(v, f)
        if need is None:
            f.bounds[v] = result
            stack.pop()
            continue
        budget -= 1
        if budget < 0:
            return None  # nothing on the stack is kept: another walk may get further
        stack.append(need)
    return top_frame.bounds[top]


def _step(v: Any, f: Frame) -> tuple[tuple[Any, Frame] | None, float | None]:
    """``(None, bound of v)`` when the bounds it is made from are known, else ``(a value to measure first,
    None)``. ``v`` is a variable of ``f``'s jaxpr that no alias maps up."""
    STEPS["bound"] += 1
    eqn = f.producers.get(v)
    if eqn is None:
        const = f.consts.get(v)
        if v in f.consts and not isinstance(const, jax.core.Tracer):  # else an argument
            return None, _magnitude(const)
        return None, None
    if is_inline_call(eqn):
        k = 0 if len(eqn.outvars) == 1 else next(i for i, o in enumerate(eqn.outvars) if o is v)
        made_from = _made_from(eqn.params["jaxpr"].jaxpr).get(k)
        if made_from is None:
            return None, None  # the body computes it (a reduction, a matmul...): no need to go in
        # the operands it is made from first, here: one runtime value among them decides it
        need, all_known = _known([eqn.invars[i] for i in made_from], f, lambda m: True)
        if need is not None or all_known is None:
            return need, None
        body_frame, out = into(eqn, v, f)
        return _known(out, body_frame, lambda m: m[0])
    name = eqn.primitive.name
    if name in _VALUES:
        return _known(eqn.invars[_VALUES[name]], f, max)
    if name in _ARITHMETIC:
        return _known(eqn.invars, f, lambda m: _ARITHMETIC[name](*m))
    return None, None


# id(body jaxpr) -> ``_made_from``'s answer, while the body lives
_MADE_FROM = LRU(1024)


def _made_from(body: Jaxpr) -> dict[int, frozenset[int]]:
    """``{output index: the indices of the inputs it is made from}`` for the outputs of an inline call's body
    whose bound may be known: made from inputs, literals and constants by ``_VALUES`` and ``_ARITHMETIC`` ops
    alone, whose bound is a runtime value's (None) as soon as one input's is. Any other output is computed
    (a reduction, a matmul, a division), a runtime value whatever the operands. Found once per body, it
    spares a walk the body's frame at most calls of a helper (``mean``; ``x - m`` of a runtime ``x``).

    The bodies of the inline calls inside ``body`` are read first, innermost first, with a stack of its own
    (no recursion, whatever the nesting)."""
    known = _MADE_FROM.cached(body, id(body))
    if known is not None:
        return known
    stack = [(body, False)]
    while stack:
        b, inner_done = stack.pop()
        if inner_done:
            _MADE_FROM.of(b, id(b), lambda b=b: _made_from_inputs(b))
        elif _MADE_FROM.cached(b, id(b)) is None:
            stack.append((b, True))
            stack.extend((e.params["jaxpr"].jaxpr, False) for e in b.eqns if is_inline_call(e))
    return _MADE_FROM.of(body, id(body), lambda: _made_from_inputs(body))


def _made_from_inputs(body: Jaxpr) -> dict[int, frozenset[int]]:
    none: frozenset[int] = frozenset()
    deps: dict[Any, frozenset[int]] = {v: frozenset([i]) for i, v in enumerate(body.invars)}
    deps.update((v, none) for v in body.constvars)  # a walk goes in and decides (kept as it was)

    def union(vs: Any) -> frozenset[int] | None:
        out = none
        for u in vs:
            if isinstance(u, Literal):
                continue
            d = deps.get(u)
            if d is None:
                return None
            out = out | d
        return out

    for e in body.eqns:
        name = e.primitive.name
        if is_inline_call(e):
            for k, o in _made_from(e.params["jaxpr"].jaxpr).items():
                d = union(e.invars[i] for i in o)
                if d is not None:
                    deps[e.outvars[k]] = d
            continue
        d = union(e.invars[_VALUES[name]]) if name in _VALUES else union(e.invars) if name in _ARITHMETIC else None
        if d is not None:
            deps.update((o, d) for o in e.outvars)
    out = {}
    for k, o in enumerate(body.outvars):
        d = none if isinstance(o, Literal) else deps.get(o)
        if d is not None:
            out[k] = d
    return out


def _known(operands: Any, f: Frame, combine: Any) -> tuple[tuple[Any, Frame] | None, float | None]:
    """The bound ``combine`` makes of the bounds of ``operands`` (None as soon as one is a runtime value), or
    the first operand whose bound is still to be found."""
    if not isinstance(operands, list):
        operands = [operands]
    parts = []
    for u in operands:
        w, g = up(u, f)
        if isinstance(w, Literal):
            parts.append(_magnitude(w.val))
            continue
        m = g.bounds.get(w, _PENDING)
        if m is _PENDING:
            return (w, g), None
        if m is None:
            return None, None
        parts.append(m)
    return None, combine(parts)


def overflows(magnitude: float, dtype: str) -> bool:
    """Whether a finite value of ``magnitude`` rounds to infinity in ``dtype``."""
    with np.errstate(over="ignore"):
        return bool(np.isinf(np.asarray(magnitude, np.float64).astype(jnp.dtype(dtype))))


def _magnitude(x: Any) -> float:
    if isinstance(x, _FLOATS):  # a float literal: NumPy's answer below, without its array
        m = abs(float(x))
        return m if math.isfinite(m) else 0.0
    if isinstance(x, jax.Array):
        return _MEASURED.of(x, id(x), lambda: _device_max(x))
    a = np.abs(np.asarray(x)).astype(np.float64)
    return float(np.max(a, where=np.isfinite(a), initial=0.0))


def _device_max(x: jax.Array) -> float:
    """Measured where the array lives (no copy of a large closed-over array to the host)."""
    with jax.ensure_compile_time_eval():
        a = jnp.abs(x).astype(jnp.float32)
        return float(jnp.max(jnp.where(jnp.isfinite(a), a, jnp.float32(0)), initial=jnp.float32(0)))
