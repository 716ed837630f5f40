"""Where a value of the original program comes from: the walks behind the epilogue rule.

The rewrite sees the program as JAX traced it, where jnp's small helpers
(``jnp.add``, ``matmul``, ``where``, ...) may stay ``jit`` equations
(``inline=True``) instead of being inlined. A decision that looks at where a
value comes from must not depend on that: ``x @ w + b`` is the same bias add
whether the matmul and the add are primitives at the top level or each sits in
its own helper. So the walks here follow the *original* program across call
boundaries: down into an inline helper's body from one of its outputs, and up
from a body's input to the operand at its call (``Frame.alias``).

``root`` follows a value back through ops that move or re-view it
(``PASS_THROUGH``) to the equation that computed it; ``depends`` tells whether
one value is computed from another; ``epilogue_sides`` is the epilogue rule's
structural test. ``epilogue_eqns_at_inputs`` lists what of a helper body could
decide differently rewritten on its own than inlined (``_hops.keep_call``).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import Any

from jax.extend.core import Jaxpr, JaxprEqn, Literal

from fmp._autocast._engine import _dims
from fmp._autocast._engine._frames import TANGENT, Frame, body_frame, frame_of, is_inline_call
from fmp._autocast._engine._lru import LRU

# Ops a value is traced back through: they move or re-view it without computing on it.
PASS_THROUGH = frozenset({"reshape", "broadcast_in_dim", "convert_element_type", "squeeze", "transpose"})
# Ops a weight is recognised through (the float8 scope rule): re-views, casts, fmp's rounding marks, slices of
# a stack of layer weights (`ws[i]`).
WEIGHT_VIEWS = PASS_THROUGH | {"reduce_precision", "copy", "copy_p", "slice", "dynamic_slice"}

_MISSING = object()


# How many steps the walks took (``up`` from a body input to its operand, one value visited by ``_walk``,
# ``depends`` or ``_constants.bound``): a test reads it to check that a rewrite walks each value a bounded
# number of times, so that its cost stays linear in the size of the program.
STEPS = collections.Counter()


def up(var: Any, frame: Frame) -> tuple[Any, Frame]:
    """The operand that ``var`` (a variable of ``frame``'s jaxpr; a body input) stands for, in the outermost
    frame on the path that holds it, and that frame."""
    while not isinstance(var, Literal) and frame.parent is not None:
        above = frame.alias.get(var, _MISSING)
        if above is _MISSING:
            break
        STEPS["up"] += 1
        var, frame = above, frame.parent
    return var, frame


def root(var: Any, frame: Frame, through: frozenset[str] = PASS_THROUGH) -> tuple[Any, JaxprEqn | None, frozenset[Any]]:
    """``(root, eqn, path)``: the value ``var`` re-views, the equation that computed it, and the walk's path.

    ``eqn`` is None for a program input or a literal. ``path`` holds every
    variable the walk passed through, at every level it went down into (the
    outputs of the inline calls, what they re-view, the root): a value
    computed from any of them is computed from the root.
    """
    return _walk(var, frame, through)[:3]


def _walk(
    var: Any, frame: Frame, through: frozenset[str] = PASS_THROUGH
) -> tuple[Any, JaxprEqn | None, frozenset[Any], list[JaxprEqn]]:
    """``root``'s answer and the pass-through equations walked, from the root's consumer to ``var``."""
    path: set[Any] = set()
    steps: list[JaxprEqn] = []
    while True:
        var, frame = up(var, frame)
        STEPS["walk"] += 1
        if isinstance(var, Literal):
            return var, None, frozenset(path), steps[::-1]
        path.add(var)
        eqn = frame.producers.get(var)
        if eqn is not None and is_inline_call(eqn):
            frame, var = into(eqn, var, frame)
            continue
        if eqn is None or eqn.primitive.name not in through:
            return var, eqn, frozenset(path), steps[::-1]
        steps.append(eqn)
        var = eqn.invars[0]


def into(call: JaxprEqn, out: Any, frame: Frame) -> tuple[Frame, Any]:
    """The body of inline ``call`` (an equation of ``frame``) as a frame under ``frame``, and the body's output
    that is the call's output ``out``. The body's frame is made once per call and kept in ``frame``."""
    k = next(i for i, o in enumerate(call.outvars) if o is out)
    return body_frame(call, frame), call.params["jaxpr"].jaxpr.outvars[k]


def weight_of(var: Any, frame: Frame) -> str | None:
    """How ``var`` names the weight it re-views (``"input 1"``, ``"constant"``: a literal broadcast, as
    ``jnp.ones``), or None for an activation: a value computed from something other than a weight, through
    casts, reshapes, transposes and broadcasts; ``TANGENT`` for a value computed from a tangent."""
    tangents = frame.tangents  # the tangent inputs of the custom_jvp rule the frame belongs to
    if tangents and not isinstance(var, Literal) and depends(var, tangents, frame):
        return TANGENT
    r, made, _ = root(var, frame, WEIGHT_VIEWS) if not isinstance(var, Literal) else (var, None, None)
    if made is not None:
        return None
    return "constant" if isinstance(r, Literal) else frame.weights.get(r)


def depends(var: Any, on: frozenset[Any], frame: Frame) -> bool:
    """Whether ``var`` is computed from any variable in ``on`` (walking ``frame``'s path; a call's outputs
    count as computed from all of its operands)."""
    stack, seen = [(var, frame)], set()
    while stack:
        v, f = up(*stack.pop())
        if isinstance(v, Literal) or v in seen:
            continue
        STEPS["depends"] += 1
        if v in on:
            return True
        seen.add(v)
        made = f.producers.get(v)
        if made is not None:
            stack.extend((u, f) for u in made.invars)
    return False


NOT_LOW = "-"  # an ``epilogue_sides`` verdict: this operand is no matmul or convolution result
BIAS = "bias"  # an ``epilogue_sides`` verdict: the other operand is a bias of this one


def epilogue_sides(eqn: JaxprEqn, frame: Frame, is_low: Callable[[str], bool]) -> tuple[str, str]:
    """For each operand of a binary ``eqn``: whether it is the matmul side of an epilogue, and if not, why.

    Operand ``i`` qualifies (verdict ``BIAS``) when it comes (through
    pass-through ops and helper calls) from an equation whose primitive
    ``is_low``, a ``dot_general`` without batch dimensions or a convolution,
    and the other operand is a bias of it as torch's ``linear`` and ``conv``
    take one: a value with fewer elements than the result that varies only
    along the output features (``_dims.along_features``; a scalar counts) and is
    not computed from the result (a statistic of the result is no bias). Else
    ``NOT_LOW`` (no such result) or the reason. The caller checks the dtypes.
    """
    size = math.prod(eqn.outvars[0].aval.shape)
    sides = []
    for i in (0, 1):
        top, made, path, steps = _walk(eqn.invars[i], frame)
        start = _dims.of_result(made) if made is not None and is_low(made.primitive.name) else None
        if start is None:
            sides.append(NOT_LOW)
            continue
        labels, features = start
        for e in steps:
            labels = _dims.forward(labels, e)
        other, _, _, other_steps = _walk(eqn.invars[1 - i], frame)
        bias = _dims.of_bias(getattr(other.aval, "shape", ()))
        for e in other_steps:
            bias = _dims.forward(bias, e)
        if math.prod(getattr(other.aval, "shape", ())) >= size:
            sides.append("the other operand is as large as the result")
        elif depends(eqn.invars[1 - i], path, frame):
            sides.append("the other operand is computed from the result (a statistic)")
        elif len(bias) != len(labels):
            sides.append(BIAS if not any(bias) else "the other operand's dimensions are not the result's")
        else:
            sides.append(_dims.along_features(labels, features, bias) or BIAS)
    return sides[0], sides[1]


_AT_INPUTS = LRU(512)  # (id(body), epilogue ops) -> the answer, while the body lives


def epilogue_eqns_at_inputs(body: Jaxpr, epilogue: frozenset[str]) -> tuple[tuple[int, JaxprEqn], ...] | None:
    """The epilogue-rule equations of ``body`` with an operand that is (a re-view of) a body input.

    Only these can decide differently with ``body`` rewritten alone than
    inlined: the rule would look through that input into the caller's program.
    None when ``body`` holds an inline call of its own (not looked into).
    """
    return _AT_INPUTS.of(body, (id(body), epilogue), lambda: _epilogue_eqns_at_inputs(body, epilogue))


def _epilogue_eqns_at_inputs(body: Jaxpr, epilogue: frozenset[str]) -> tuple[tuple[int, JaxprEqn], ...] | None:
    frame = frame_of(body)
    invars = set(body.invars)
    found: list[tuple[int, JaxprEqn]] | None = []
    for n, e in enumerate(body.eqns):
        if is_inline_call(e):
            found = None
            break
        if e.primitive.name in epilogue and len(e.invars) == 2:
            roots = [root(v, frame)[0] for v in e.invars]
            if any(not isinstance(r, Literal) and r in invars for r in roots):
                found.append((n, e))
    return None if found is None else tuple(found)
