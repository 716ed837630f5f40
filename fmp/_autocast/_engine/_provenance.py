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
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jax.extend.core import Jaxpr, JaxprEqn, Literal
from jax.extend.core.primitives import jit_p

from fmp._autocast._engine import _dims
from fmp._autocast._engine._jax_internals import inlined_when_staged
from fmp._autocast._engine._lru import (
    LRU,
)

# Ops a value is traced back through: they move or re-view it without computing on it.
PASS_THROUGH = frozenset({"reshape", "broadcast_in_dim", "convert_element_type", "squeeze", "transpose"})
# Ops a weight is recognised through (the float8 scope rule): re-views, casts, fmp's rounding marks, slices of
# a stack of layer weights (`ws[i]`).
WEIGHT_VIEWS = PASS_THROUGH | {"reduce_precision", "copy", "copy_p", "slice", "dynamic_slice"}


@dataclasses.dataclass(frozen=True, eq=False)
class Frame:
    """One jaxpr on a path of the program: its producers, and the link from its inputs up to its call.

    ``producers`` maps a variable of the frame's own jaxpr to the equation that
    made it; ``alias`` maps the jaxpr's input variables to the operands its call
    passed, variables of ``parent`` (an inlined body, or a body a walk went down
    into; a frame with no parent is a program rewritten on its own). A walk that
    reaches an input goes ``up`` to the parent frame, so every lookup is one
    dict access whatever the depth. ``hints`` carries, into a helper body
    rewritten on its own, the epilogue test of those of its equations that see
    through its inputs, as run in the caller's program. ``uses`` counts the uses
    of each variable of the frame's own jaxpr (its equations and outputs).
    ``consts`` maps the constant variables of the jaxprs on the path to their
    values. ``bounds`` memoises ``_constants.bound`` for the frame's variables
    and ``children`` the frames of the bodies of its inline calls (``into``), so
    each value's bound is found once per rewrite.
    """

    producers: Mapping[Any, JaxprEqn]
    alias: Mapping[Any, Any]
    uses: Mapping[Any, int] = dataclasses.field(default_factory=dict)
    # id(equation) -> its epilogue sides as seen from the caller's program (a helper body rewritten alone)
    hints: Mapping[int, tuple[str, str]] = dataclasses.field(default_factory=dict)
    consts: Mapping[Any, Any] = dataclasses.field(default_factory=dict)
    # variable -> ``_constants.bound`` of it, filled as the rewrite asks
    bounds: dict[Any, float | None] = dataclasses.field(default_factory=dict)
    # variable -> how it names a weight ("input 2"): inputs of the autocast function and constants, and the
    # inputs of a body that receive one (the float8 scope rule)
    weights: Mapping[Any, str] = dataclasses.field(default_factory=dict)
    parent: Frame | None = None
    jaxpr: Jaxpr | None = None  # the frame's own jaxpr
    # id(inline call equation) -> (the equation, its body's frame under this one), made by ``into``
    children: dict[int, tuple[JaxprEqn, Frame]] = dataclasses.field(default_factory=dict)


_MISSING = object()


class Chain(Mapping):
    """``own`` looked up before ``parent``, read-only: ``collections.ChainMap``'s lookups without its generator
    per lookup (the walks here look variables up at every step)."""

    __slots__ = ("own", "parent")

    def __init__(self, own: Mapping[Any, Any], parent: Mapping[Any, Any]):
        self.own, self.parent = own, parent

    def get(self, key: Any, default: Any = None) -> Any:
        found = self.own.get(key, _MISSING)
        return self.parent.get(key, default) if found is _MISSING else found

    def __getitem__(self, key: Any) -> Any:
        found = self.get(key, _MISSING)
        if found is _MISSING:
            raise KeyError(key)
        return found

    def __contains__(self, key: object) -> bool:
        return key in self.own or key in self.parent

    def __iter__(self) -> Any:
        return iter({**dict.fromkeys(self.parent), **dict.fromkeys(self.own)})

    def __len__(self) -> int:
        return sum(1 for _ in self)


# id(jaxpr) -> (jaxpr, its producers, its use counts); holds the jaxpr, so its id is not reused while cached
_PRODUCERS = LRU(512)


def _producers(jaxpr: Jaxpr) -> tuple[dict[Any, JaxprEqn], dict[Any, int]]:
    return _PRODUCERS.of(jaxpr, id(jaxpr), lambda: _producers_and_uses(jaxpr))


def _producers_and_uses(jaxpr: Jaxpr) -> tuple[dict[Any, JaxprEqn], dict[Any, int]]:
    made = {v: e for e in jaxpr.eqns for v in e.outvars}
    uses = collections.Counter(v for e in jaxpr.eqns for v in e.invars if not isinstance(v, Literal))
    uses.update(v for v in jaxpr.outvars if not isinstance(v, Literal))
    for a, b in _passed_through(jaxpr):  # one value under two names: neither is used once
        uses[a] += 1
        uses[b] += 1
    return made, uses


def _passed_through(jaxpr: Jaxpr) -> list[tuple[Any, Any]]:
    """``(input, output)`` variable pairs that may hold one runtime value in the rewritten program: a dtype
    conversion the rewrite makes the identity (the value already has that dtype there), and an inline
    call whose body returns its input (``jnp.real``, inlined as JAX would)."""
    pairs = []
    for e in jaxpr.eqns:
        if e.primitive.name == "convert_element_type" and not isinstance(e.invars[0], Literal):
            pairs.append((e.invars[0], e.outvars[0]))
        elif is_inline_call(e):
            for k, i in returned_inputs(e.params["jaxpr"].jaxpr):
                if not isinstance(e.invars[i], Literal):
                    pairs.append((e.invars[i], e.outvars[k]))
    return pairs


def returned_inputs(body: Jaxpr) -> list[tuple[int, int]]:
    """``(output index, input index)`` for each output of ``body`` that is one of its inputs unchanged."""
    return [
        (k, body.invars.index(v)) for k, v in enumerate(body.outvars) if not isinstance(v, Literal) and v in body.invars
    ]


def frame_of(
    jaxpr: Jaxpr,
    parent: Frame | None = None,
    operands: Sequence[Any] | None = None,
    weights: Mapping[Any, str] | None = None,
) -> Frame:
    """The frame of ``jaxpr``: alone (naming ``weights``), or (with ``parent`` and ``operands``) as a body
    called in ``parent`` with ``operands`` (variables of ``parent``) as its inputs."""
    own, uses = _producers(jaxpr)
    if parent is None or operands is None:
        return Frame(own, {}, uses, weights={} if weights is None else weights, jaxpr=jaxpr)
    alias = dict(zip(jaxpr.invars, operands, strict=True))
    return Frame(own, alias, uses, consts=parent.consts, weights=parent.weights, parent=parent, jaxpr=jaxpr)


def release(frame: Frame) -> None:
    """Forgets the body frames kept under ``frame`` (``body_frame``) once its rewrite is done: a kept body
    frame refers to its parent, so without this every frame of a rewrite would be cyclic garbage, left for
    the garbage collector's full passes instead of being freed when the rewrite returns."""
    stack = [frame]
    while stack:
        f = stack.pop()
        stack.extend(child for _, child in f.children.values())
        f.children.clear()


def used_once(var: Any, frame: Frame) -> bool:
    """``var`` has one use in its jaxpr, is no input of an inlined body (whose operand the caller may use
    again) and neither side of a dtype conversion (which the rewrite may make the identity, so that two
    variables hold one value): a cast of it made for that use is the only one."""
    return not isinstance(var, Literal) and var not in frame.alias and frame.uses.get(var, 0) == 1


def is_inline_call(eqn: JaxprEqn) -> bool:
    """A ``jit`` equation JAX would inline when staging (jnp's helpers; ``_jax_internals.INLINE_WHEN_STAGED``)."""
    return eqn.primitive is jit_p and inlined_when_staged(eqn.params)


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


def body_frame(call: JaxprEqn, frame: Frame) -> Frame:
    """The frame of the body of ``call`` (an equation of ``frame`` with a ``jaxpr`` parameter) called there:
    made once per call and kept in ``frame.children``, so what walks learn in it is kept too."""
    kept = frame.children.get(id(call))
    if kept is None or kept[0] is not call:
        kept = frame.children[id(call)] = (call, frame_of(call.params["jaxpr"].jaxpr, frame, call.invars))
    return kept[1]


def weight_of(var: Any, frame: Frame) -> str | None:
    """How ``var`` names the weight it re-views (``"input 1"``, ``"constant"``: a literal broadcast, as
    ``jnp.ones``), or None for an activation: a value computed from something other than a weight, through
    casts, reshapes, transposes and broadcasts."""
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


_AT_INPUTS = LRU(512)  # (id(body), epilogue ops) -> (body, answer)


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
