"""The frames the rewrite's walks go through: one jaxpr on a path of the program, with what it knows.

A ``Frame`` holds a jaxpr's producers and use counts, the link from its inputs to the operands of its call
(``alias``, to the ``parent`` frame) and what the walks of ``_provenance`` and ``_constants`` learn about its
values. Producer maps, use counts and last reads are kept per jaxpr (``_FACTS``, weakly: never keeping a
program alive); a frame keeps the frames of the bodies its walks went into (``body_frame``) until its
rewrite is done (``release``).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from jax.extend.core import Jaxpr, JaxprEqn, Literal
from jax.extend.core.primitives import jit_p

from fmp._autocast._engine._jax_internals import inlined_when_staged
from fmp._autocast._engine._lru import LRU


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
    # the variables of ``weights`` labelled ``TANGENT`` (the tangent inputs of a custom_jvp rule), found once
    tangents: frozenset[Any] = frozenset()
    # id(equation) -> the variables of ``jaxpr`` it is the last to read (``last_reads``)
    last: Mapping[int, tuple[Any, ...]] = dataclasses.field(default_factory=dict)


_MISSING = object()

# The label of a custom_jvp rule's tangent inputs (``_weights.rule_weights``): a value computed from one is no
# weight, and a product of it stays out of float8 (JAX cannot transpose a float8 product's custom_vjp, and a
# dynamically scaled product is not linear in its tangent).
TANGENT = "a tangent"


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


# id(jaxpr) -> (its producers, its use counts, its last reads), while the jaxpr lives (``LRU.of``)
_FACTS = LRU(512)


def _facts(jaxpr: Jaxpr) -> tuple[dict[Any, JaxprEqn], dict[Any, int], dict[int, tuple[Any, ...]]]:
    return _FACTS.of(jaxpr, id(jaxpr), lambda: _find_facts(jaxpr))


def _find_facts(jaxpr: Jaxpr) -> tuple[dict[Any, JaxprEqn], dict[Any, int], dict[int, tuple[Any, ...]]]:
    made = {v: e for e in jaxpr.eqns for v in e.outvars}
    uses = collections.Counter(v for e in jaxpr.eqns for v in e.invars if not isinstance(v, Literal))
    uses.update(v for v in jaxpr.outvars if not isinstance(v, Literal))
    for a, b in _passed_through(jaxpr):  # one value under two names: neither is used once
        uses[a] += 1
        uses[b] += 1
    return made, uses, _last_reads(jaxpr)


def last_reads(jaxpr: Jaxpr) -> Mapping[int, tuple[Any, ...]]:
    """``id(equation) -> the variables of jaxpr it is the last to read``; the jaxpr's outputs are read at its
    end, so none of them is listed. An interpreter drops a value after its last read, as Python drops a
    local: otherwise every intermediate value of the program (its tracers) would live until the end."""
    return _facts(jaxpr)[2]


def _last_reads(jaxpr: Jaxpr) -> dict[int, tuple[Any, ...]]:
    last: dict[Any, JaxprEqn] = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not isinstance(v, Literal):
                last[v] = eqn
    kept = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
    out: dict[int, list[Any]] = {}
    for v, eqn in last.items():
        if v not in kept:
            out.setdefault(id(eqn), []).append(v)
    return {k: tuple(vs) for k, vs in out.items()}


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
    own, uses, last = _facts(jaxpr)
    if parent is None or operands is None:
        weights = {} if weights is None else weights
        tangents = frozenset(v for v, label in weights.items() if label == TANGENT)
        return Frame(own, {}, uses, weights=weights, tangents=tangents, jaxpr=jaxpr, last=last)
    alias = dict(zip(jaxpr.invars, operands, strict=True))
    inherited = {"consts": parent.consts, "weights": parent.weights, "tangents": parent.tangents}
    return Frame(own, alias, uses, **inherited, parent=parent, jaxpr=jaxpr, last=last)


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


def body_frame(call: JaxprEqn, frame: Frame) -> Frame:
    """The frame of the body of ``call`` (an equation of ``frame`` with a ``jaxpr`` parameter) called there:
    made once per call and kept in ``frame.children``, so what walks learn in it is kept too."""
    kept = frame.children.get(id(call))
    if kept is None or kept[0] is not call:
        kept = frame.children[id(call)] = (call, frame_of(call.params["jaxpr"].jaxpr, frame, call.invars))
    return kept[1]
