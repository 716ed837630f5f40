"""jnp's small jitted helpers: kept as calls where that decides exactly as inlining them would.

``jnp.add``, ``matmul``, ``einsum``, ``mean``, ``where``... are
``jit(..., inline=True)`` functions; JAX inlines them when it stages a
program, and autocast traces the user's function with them kept as ``jit``
equations instead (``_jax_internals.keep_inline_calls``). Each is then either

- **kept**: its body is rewritten once per input types (memoised, so repeated
  layers and repeated traces get the same rewritten object) and bound as a
  call, which lets JAX reuse its cached differentiation of that body, the
  larger part of the cost of tracing ``grad`` of an autocast function; or
- **inlined** here, exactly as JAX would have inlined it.

A helper is kept only where its body, rewritten on its own, makes the same decisions as inlined
(``keep_call``): the rules that look into the caller's program are handed their answers from there (the
epilogue rule's, and the float8 scope rule's: which of the body's inputs are weights where it is called).
Where float8 sites are numbered in the flat program (delayed scaling, a caller's key for stochastic
rounding) every helper is inlined. A test compares the two over whole models. Scalar constants passed to
a helper (``x * 0.5``) are folded into its body first (``_specialise``), as JAX's inlining folds them, so
the rule that a scalar literal follows the other operand still sees a literal.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from jax.extend.core import ClosedJaxpr, JaxprEqn, Literal, jaxpr_as_fun
from jax.extend.core.primitives import convert_element_type_p

from fmp._autocast._engine import _constants, _jax_internals
from fmp._autocast._engine._cast import cast
from fmp._autocast._engine._context import Context, aval_of, is_castable, is_scalar_constant, like_avals
from fmp._autocast._engine._frames import frame_of, release, returned_inputs, used_once
from fmp._autocast._engine._interp import bind, eval_jaxpr, scoped_float8, transform_closed
from fmp._autocast._engine._lru import LRU
from fmp._autocast._engine._provenance import TANGENT, epilogue_eqns_at_inputs, epilogue_sides, weight_of
from fmp._core import _scopes
from fmp._core._rules import Category

# False: every helper is inlined (the reference the kept calls are tested against)
KEEP_HELPERS = True

_LOW = (Category.LOWER_PRECISION, Category.FLOAT8)


def helper_call(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    """Rewrites one inline helper call: kept as a call with a rewritten body, or inlined."""
    ctx.tracebacks.append(ctx.tracebacks[-1] if ctx.tracebacks else eqn.source_info.traceback)
    try:
        closed, operands, params, args = eqn.params["jaxpr"], list(eqn.invars), dict(eqn.params), list(invals)
        if _can_keep(ctx) and any(is_scalar_constant(x) for x in invals):
            closed, operands, params, args = _specialise(eqn, invals)
        hints = keep_call(closed, operands, args, ctx)
        if hints is None:
            orig = eqn.params["jaxpr"]
            return eval_jaxpr(orig.jaxpr, orig.consts, invals, ctx, scope, call=eqn)
        caller = ctx
        if scoped_float8(ctx):  # the float8 scope rule in the body sees which operands are weights here
            labels = (weight_of(v, ctx.frames[-1]) for v in operands)
            weights = tuple(label if label in (None, TANGENT) else _WEIGHT for label in labels)
            ctx = dataclasses.replace(ctx, weights_in={id(closed.jaxpr): weights})
        new = transform_closed(closed, like_avals(closed.in_avals, args), ctx, scope, hints=hints)
        # a value used once keeps its cast in the body; one used again has it here, shared with those uses
        entry = {i: d for i, d in _entry_casts_of(new).items() if not used_once(operands[i], ctx.frames[-1])}
        if entry and not _can_hoist(ctx, scope, closed.jaxpr):
            # inlined, that cast would be shared with the value's other uses (one rounding of their summed
            # gradients); kept, it could be neither shared nor moved here: inline
            orig = eqn.params["jaxpr"]
            return eval_jaxpr(orig.jaxpr, orig.consts, invals, caller, scope, call=eqn)
        if entry:
            args = [cast(x, entry[i], ctx, eqn, scope) if i in entry else x for i, x in enumerate(args)]
            new = transform_closed(closed, like_avals(closed.in_avals, args), ctx, scope, hints=hints)
    finally:
        ctx.tracebacks.pop()
    return bind(eqn, args, dict(params, jaxpr=new))


_ENTRY = LRU(1024)  # id(rewritten body) -> its entry casts, while the body lives


def _entry_casts_of(body: ClosedJaxpr) -> dict[int, Any]:
    return _ENTRY.of(body, id(body), lambda: _entry_casts(body))


# A kept body's inputs that are weights where it is called; one label for every weight, so that identical
# layers share one rewritten body (the name of the weight only reads in explain's rows, which inline).
_WEIGHT = "a weight of the caller"


def _can_keep(ctx: Context) -> bool:
    # explain: its rows describe the inlined program (the kept calls decide the same, but a row per cast
    # and per folded literal is what a reader compares with the source)
    return KEEP_HELPERS and ctx.records is None and bool(ctx.frames) and _float8_keeps(ctx)


def _float8_keeps(ctx: Context) -> bool:
    """Whether the float8 recipes in play let a body be rewritten once for every call: not delayed scaling
    (each site takes its own history row) nor a caller's key (each block-scaled site folds in its own
    count), whose sites are numbered in the flat program; not a recipe under an override."""
    recipe = ctx.policy.float8
    if any(p.float8 is not None for _, p in ctx.overrides) or ctx.fp8_sites is not None:
        return False
    return recipe is None or (recipe.scaling != "delayed" and ctx.key is None)


def _can_hoist(ctx: Context, scope: str, body: Any) -> bool:
    # under an override or inside a nested region the body restores its inputs' original dtypes first, so a
    # cast moved to the call would be undone there (a round trip that changes gradients under jit); a body
    # that opens scopes of its own may hold such equations
    if ctx.resolve(scope)[0] != "default":
        return False
    if any(_scopes.is_location(k) for k, _ in ctx.overrides):  # a source-location key may select any equation
        return False
    return not ctx.overrides or not any(str(e.source_info.name_stack) for e in body.eqns)


def keep_call(
    closed: ClosedJaxpr, operands: list[Any], invals: list[Any], ctx: Context
) -> tuple[tuple[int, tuple[str, str]], ...] | None:
    """How ``closed`` (a helper body called with ``operands``) is rewritten alone to decide as inlined.

    None: inline it (explain, or float8 sites numbered in the flat program, see ``_can_keep``; a scalar
    constant is still an operand; or the body holds an inline call of its own). Otherwise the epilogue hints
    for the body: the epilogue test of each of its equations that sees through its inputs, run in the
    caller's program where that differs from the test on the body alone (``x @ w + b`` with ``+`` in its own
    helper). The float8 scope rule's question (is an operand a weight?) is answered for the body's inputs in
    ``helper_call``.
    """
    if not _can_keep(ctx) or any(is_scalar_constant(x) for x in invals):
        return None
    body = closed.jaxpr
    if returned_inputs(body):
        return None  # inlined, an output is the input itself (jnp.real, squeeze of no axes): casts of it are shared
    if any(_huge_constant(v, ctx) for v in operands):
        return None  # inlined: the body alone would not see that the operand is a constant (_leaf)
    at_inputs = epilogue_eqns_at_inputs(body, ctx.rules.jax_epilogue)
    if at_inputs is None:
        return None
    if not at_inputs:
        return ()
    inlined, alone = frame_of(body, ctx.frames[-1], operands), frame_of(body)

    def is_low(name: str) -> bool:
        return ctx.rules.category(name) in _LOW

    hints = []
    try:
        for n, e in at_inputs:
            sides = epilogue_sides(e, inlined, is_low)
            if sides != epilogue_sides(e, alone, is_low):
                hints.append((n, sides))
    finally:
        release(inlined)
        release(alone)
    return tuple(hints)


def _huge_constant(var: Any, ctx: Context) -> bool:
    """``var`` is a constant the compute dtype cannot hold (``_constants``)."""
    if not hasattr(var.aval, "dtype") or not is_castable(var.aval.dtype) or not ctx.frames:
        return False
    magnitude = _constants.bound(var, ctx.frames[-1])
    return magnitude is not None and _constants.overflows(magnitude, ctx.policy.compute_dtype.name)


def _entry_casts(body: ClosedJaxpr) -> dict[int, Any]:
    """``{input index: dtype}`` for the inputs a rewritten body only ever casts, all to one dtype.

    Inlined, such a cast would share the caller's cast cache (one cast of a
    value for all its uses, one sum of their gradients in the wider dtype);
    cast at the call instead, it still does.
    """
    index = {v: i for i, v in enumerate(body.jaxpr.invars)}
    to: dict[int, Any] = {}
    bad: set[int] = {index[v] for v in body.jaxpr.outvars if not isinstance(v, Literal) and v in index}
    for e in body.jaxpr.eqns:
        for v in e.invars:
            i = None if isinstance(v, Literal) else index.get(v)
            if i is None:
                continue
            if e.primitive is convert_element_type_p and is_castable(e.params["new_dtype"]):
                if to.setdefault(i, e.params["new_dtype"]) != e.params["new_dtype"]:
                    bad.add(i)
            else:
                bad.add(i)
    return {i: d for i, d in to.items() if i not in bad}


# The per-invar parameters of a ``jit`` equation (one entry per operand).
_PER_OPERAND = ("in_shardings", "in_layouts", "donated_invars")

# (id(body), constants) -> the specialised body, while the body lives
_SPECIAL = LRU(1024)


def _exact(x: Any) -> tuple[str, bytes]:
    """A scalar constant's exact value (its ``repr`` follows NumPy's print precision: 0.00012345 and
    0.000123454 print alike)."""
    a = np.asarray(x)
    return a.dtype.str, a.tobytes()


def _specialise(eqn: JaxprEqn, invals: list[Any]) -> tuple[ClosedJaxpr, list[Any], dict[str, Any], list[Any]]:
    """The helper with its scalar-constant operands folded into its body: ``(body, operands, params, args)``.

    The body is re-traced with the constants in place (JAX folds their casts
    into literals, as its inlining does) and memoised per body and constants.
    """
    closed: ClosedJaxpr = eqn.params["jaxpr"]
    fixed = {i: x for i, x in enumerate(invals) if is_scalar_constant(x)}
    keep = [i for i in range(len(invals)) if i not in fixed]

    def specialised(*xs: Any) -> list[Any]:
        it = iter(xs)
        return list(jaxpr_as_fun(closed)(*[fixed[i] if i in fixed else next(it) for i in range(len(invals))]))

    key = (id(closed), tuple((i, type(x), _exact(x), aval_of(x)) for i, x in fixed.items()))
    body = _SPECIAL.of(
        closed,
        key,
        lambda: _jax_internals.trace_to_closed_jaxpr(specialised, [closed.in_avals[i] for i in keep], "fmp.autocast"),
    )
    params = dict(eqn.params)
    for name in _PER_OPERAND:
        if name in params:
            params[name] = tuple(params[name][i] for i in keep)
    return body, [eqn.invars[i] for i in keep], params, [invals[i] for i in keep]
