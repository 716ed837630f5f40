"""One rewrite rule per higher-order primitive: the bodies are rewritten too.

Each handler takes ``(eqn, invals, ctx, scope)`` and returns the equation's
outputs. Types that must agree are made to agree: a loop carry takes the
dtype found by iterating the body rewrite to a fixed point, ``cond``
branches that disagree return the original dtype, and a custom-derivative call keeps its original input and output dtypes
so that its (unchanged) derivative rules still type-check.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, JaxprEqn, jaxpr_as_fun
from jax.extend.core.primitives import (
    cond_p,
    custom_jvp_call_p,
    custom_vjp_call_p,
    jit_p,
    remat_p,
    scan_p,
    while_p,
)

from fmp._autocast._engine import _jax_internals
from fmp._autocast._engine._cast import cast
from fmp._autocast._engine._context import (
    Context,
    Handler,
    NoKey,
    aval_of,
    calling,
    dtype_name,
    is_castable,
    like_avals,
    passes_key,
)
from fmp._autocast._engine._frames import is_inline_call
from fmp._autocast._engine._interp import Rows, bind, eval_jaxpr, extra_inputs, transform_closed
from fmp._autocast._engine._weights import rule_weights
from fmp._autocast._hops import _calls, _exact, _float8_rows
from fmp._autocast._hops._custom_bwd import BWD_AS_WRITTEN, run_bwd
from fmp._autocast._hops._helpers import helper_call
from fmp._core import _dtypes as _dtypes_mod


def pin(vals: list[Any], avals: list[Any], ctx: Context) -> list[Any]:
    """Casts ``vals`` to the dtypes of ``avals`` (a loop carry, a custom call's inputs)."""
    return [cast(x, a.dtype, ctx) if hasattr(a, "dtype") else x for x, a in zip(vals, avals, strict=True)]


def _dtypes(avals: list[Any]) -> list[Any]:
    return [a.dtype if hasattr(a, "dtype") else None for a in avals]


def _jit(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    """A user's ``jit`` call: its body is rewritten once per input dtypes and bound as a call again."""
    if is_inline_call(eqn):
        return helper_call(eqn, invals, ctx, scope)
    closed: ClosedJaxpr = eqn.params["jaxpr"]
    avals = like_avals(closed.in_avals, invals)
    with calling(ctx, eqn):
        keyed = passes_key(ctx)
        ctx, rows, block = _float8_rows.body_rows(
            ctx, lambda c: transform_closed(closed, avals, c, scope, keyed=keyed), len(avals)
        )
        new = transform_closed(closed, avals, ctx, scope, rows=rows, keyed=keyed)
    params = dict(eqn.params, jaxpr=new)
    extra = extra_inputs(ctx, block)
    for _ in extra:
        params = _jax_internals.jit_params_with_input(params)
    return bind(eqn, [*invals, *extra], params)


# A loop's carry dtypes are found by iteration; each carry can only widen (bfloat16/float16 -> float32), so
# this converges in at most three rounds; the bound only guards against a bug (then carries are pinned).
_MAX_ROUNDS = 8


def _join(a: Any, b: Any) -> Any:
    if a == b:
        return a
    return np.dtype(_dtypes_mod.widest([dtype_name(a), dtype_name(b)]))


def loop_body(
    closed: ClosedJaxpr,
    before: list[Any],
    carry_avals: list[Any],
    after: list[Any],
    init: list[Any],
    ctx: Context,
    scope: str,
    rows: Rows | None = None,
    keyed: bool = False,
) -> tuple[ClosedJaxpr, list[Any]]:
    """Rewrites a loop body and finds its carry dtypes: ``(body, carry_avals)``.

    The carry starts in the dtypes the rewritten program gives the initial
    values; the body is rewritten for them, and a carry the body returns in
    another dtype is widened to hold both, until the dtypes stop changing (a
    fixed point). So a value that enters the loop in bfloat16 and that the body
    keeps in bfloat16 stays bfloat16, while a float32 accumulator stays float32.
    ``before`` / ``after`` are the avals of the body's other inputs (consts, xs);
    ``rows``: the body's float8 history rows, its last input (``_float8_rows``); ``keyed``: the body takes
    a stochastic-rounding key after them (``_interp.extra_inputs``).
    """
    mark = None if ctx.records is None else len(ctx.records)
    nk = len(carry_avals)
    body: ClosedJaxpr | None = None
    dts = [
        aval_of(x).dtype if hasattr(a, "dtype") and is_castable(a.dtype) and is_castable(aval_of(x).dtype) else None
        for x, a in zip(init, carry_avals, strict=True)
    ]
    for _ in range(_MAX_ROUNDS):
        if mark is not None and ctx.records is not None:
            del ctx.records[mark:]
        avals = [a if d is None else a.update(dtype=d) for a, d in zip(carry_avals, dts, strict=True)]
        body = transform_closed(closed, before + avals + after, ctx, scope, rows=rows, keyed=keyed)
        outs = body.out_avals[:nk]
        nxt = [d if d is None else _join(d, o.dtype) for d, o in zip(dts, outs, strict=True)]
        if nxt == dts:
            break
        dts = nxt
    else:  # not reached: the join is monotone; fall back to the original program's carry dtypes
        avals = list(carry_avals)
        body = transform_closed(closed, before + avals + after, ctx, scope, rows=rows, keyed=keyed)
    want = [a.dtype if hasattr(a, "dtype") else None for a in avals]
    pinned = want + [None] * (len(closed.out_avals) - nk)
    return pin_outputs(body, pinned, ctx), avals


def pin_outputs(closed: ClosedJaxpr, dtypes: list[Any], ctx: Context) -> ClosedJaxpr:
    """``closed`` with its outputs cast to ``dtypes`` (None: kept), without rewriting the body again.

    The rewritten body is re-traced as it is (no rule is consulted), with casts
    appended where an output's dtype differs: a loop carry the body narrows, a
    ``cond`` branch that disagrees with another.
    """
    if all(d is None or getattr(o, "dtype", None) == d for o, d in zip(closed.out_avals, dtypes, strict=True)):
        return closed

    def fun(*args: Any) -> list[Any]:
        outs = jaxpr_as_fun(closed)(*args)
        ctx.memos.append({})  # the casts' memo belongs to this trace
        try:
            return [o if d is None else cast(o, d, ctx) for o, d in zip(outs, dtypes, strict=True)]
        finally:
            ctx.memos.pop()

    return _jax_internals.trace_to_closed_jaxpr(fun, closed.in_avals, "fmp.autocast")


def _scan(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    p = eqn.params
    closed: ClosedJaxpr = p["jaxpr"]
    nc, nk = _jax_internals.scan_counts(p)
    consts, carry, xs = invals[:nc], invals[nc : nc + nk], invals[nc + nk :]
    before, after = like_avals(closed.in_avals[:nc], consts), like_avals(closed.in_avals[nc + nk :], xs)
    carry_avals = list(closed.in_avals[nc : nc + nk])

    def loop(c: Context, rows: Rows | None = None) -> tuple[ClosedJaxpr, list[Any]]:
        return loop_body(closed, before, carry_avals, after, carry, c, scope, rows, keyed)

    keyed = passes_key(ctx)  # the body takes one key per iteration, scanned over like its xs
    ctx, rows, block = _float8_rows.body_rows(ctx, loop, len(closed.in_avals), length=p["length"])
    new, carry_avals = loop(ctx, rows)
    carry = pin(carry, carry_avals, ctx)
    params = dict(p, jaxpr=new)
    extra = extra_inputs(ctx, block, p["length"])
    for _ in extra:
        params = _jax_internals.scan_params_with_xs(params)
    return bind(eqn, consts + carry + xs + extra, params)


def _while(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    p = eqn.params
    cond: ClosedJaxpr = p["cond_jaxpr"]
    body: ClosedJaxpr = p["body_jaxpr"]
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, carry = invals[:nc], invals[nc : nc + nb], invals[nc + nb :]
    before = like_avals(body.in_avals[:nb], bconsts)
    ctx = _float8_rows.stateless(
        ctx,
        lambda c: loop_body(body, before, list(body.in_avals[nb:]), [], carry, c, scope),
        "while_loop",
        "its trip count is unknown, so it has no history per iteration",
    )
    new_body, carry_avals = loop_body(body, before, list(body.in_avals[nb:]), [], carry, ctx, scope)
    carry = pin(carry, carry_avals, ctx)
    new_cond = transform_closed(cond, like_avals(cond.in_avals[:nc], cconsts) + carry_avals, ctx, scope)
    return bind(eqn, cconsts + bconsts + carry, dict(p, cond_jaxpr=new_cond, body_jaxpr=new_body))


def _cond(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    branches: tuple[ClosedJaxpr, ...] = eqn.params["branches"]
    index, ops = invals[0], invals[1:]
    keyed = passes_key(ctx)  # every branch takes the same key: one of them runs
    rewrites = [functools.partial(_branch, b, like_avals(b.in_avals, ops), scope, keyed) for b in branches]
    ctx, rows, block = _float8_rows.cond_rows(ctx, rewrites, len(ops))
    new = [
        transform_closed(b, like_avals(b.in_avals, ops), ctx, scope, rows=r, keyed=keyed)
        for b, r in zip(branches, rows, strict=True)
    ]
    ops = [*ops, *extra_inputs(ctx, block)]
    outs = [tuple(getattr(a, "dtype", None) for a in b.out_avals) for b in new]
    if len(set(outs)) > 1:  # branches disagree: pin the outputs that differ to the original dtype
        pinned = [None if len({o[i] for o in outs}) == 1 else v.aval.dtype for i, v in enumerate(eqn.outvars)]
        new = [pin_outputs(b, pinned, ctx) for b in new]
    return bind(eqn, [index, *ops], dict(eqn.params, branches=tuple(new)))


def _branch(closed: ClosedJaxpr, avals: list[Any], scope: str, keyed: bool, ctx: Context) -> ClosedJaxpr:
    return transform_closed(closed, avals, ctx, scope, keyed=keyed)


def _remat(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    p = eqn.params
    closed = _jax_internals.as_closed(p["jaxpr"])
    avals = like_avals(closed.in_avals, invals)
    keyed = passes_key(ctx)
    ctx, rows, block = _float8_rows.body_rows(
        ctx, lambda c: transform_closed(closed, avals, c, scope, keyed=keyed), len(avals)
    )
    new = transform_closed(closed, avals, ctx, scope, rows=rows, keyed=keyed)
    invals = [*invals, *extra_inputs(ctx, block)]
    if not new.consts:
        return bind(eqn, invals, dict(p, jaxpr=new.jaxpr))
    fun = jax.checkpoint(jaxpr_as_fun(new), prevent_cse=p["prevent_cse"], policy=p["policy"])
    return list(fun(*invals))


def _custom(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    """custom_jvp_call / custom_vjp_call: the primal body, the jvp / fwd rule and the bwd rule are rewritten.

    The rules themselves are kept (a custom derivative still applies), and the
    call's inputs and outputs, the jvp rule's tangents, the fwd rule's
    residuals and the bwd rule's cotangents keep the dtypes of the original
    program, which the user's rules were written for. The bwd rule of a
    custom_vjp runs under the forward's policy (as ``torch.amp.custom_bwd``
    does), unless it was marked with `fmp.bwd_as_written`.
    """
    closed: ClosedJaxpr = eqn.params["call_jaxpr"]
    low = _exact.input_dtype(eqn, invals, ctx)
    if low is not None:
        return _custom_in(eqn, invals, ctx, scope, low)
    invals = pin(invals, closed.in_avals, ctx)
    outs = _dtypes(closed.out_avals)
    ctx = _float8_rows.stateless(
        ctx,
        lambda c: transform_closed(closed, closed.in_avals, c, scope, outs),
        "custom_jvp/custom_vjp",
        "a custom derivative rule has no place for the history's update",
    )
    new = transform_closed(closed, closed.in_avals, ctx, scope, _dtypes(closed.out_avals))
    params = dict(eqn.params, call_jaxpr=new)
    labels = ctx.weights_in.get(id(closed.jaxpr))

    def rewrite(rule: ClosedJaxpr) -> ClosedJaxpr:  # the rule's own types are kept at its boundary
        # its float8 decisions are the primal body's, whether JAX asks for it now or after the rewrite returned
        sub = dataclasses.replace(ctx, weights_in=rule_weights(labels, len(closed.in_avals), rule.jaxpr))
        return transform_closed(rule, rule.in_avals, sub, scope, _dtypes(rule.out_avals))

    thunk = "jvp_jaxpr_fun" if eqn.primitive is custom_jvp_call_p else "fwd_jaxpr_thunk"
    params[thunk] = _jax_internals.rewrap_rule_thunk(params[thunk], rewrite)
    if eqn.primitive is custom_vjp_call_p and not getattr(
        _jax_internals.user_function(params["bwd"]), BWD_AS_WRITTEN, False
    ):
        params["bwd"] = _jax_internals.rewrap_bwd(params["bwd"], functools.partial(run_bwd, ctx=ctx, scope=scope))
    return bind(eqn, invals, params)


def _custom_in(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str, low: Any) -> list[Any]:
    """A ``custom_jvp_call`` that only picks values, run in its inputs' dtype ``low`` (``_exact``): its body
    and its jvp rule are rewritten with every floating value of their boundary in ``low``."""
    closed: ClosedJaxpr = eqn.params["call_jaxpr"]
    outs = [low if hasattr(a, "dtype") and is_castable(a.dtype) else None for a in closed.out_avals]
    with _exact.running(closed.jaxpr):  # the rule table's rewrite (with its explain rows), in ``low``
        new = transform_closed(closed, _exact.retyped(closed.in_avals, low), ctx, scope, outs)
    params = dict(eqn.params, call_jaxpr=new)
    params["jvp_jaxpr_fun"] = _jax_internals.rewrap_rule_thunk(params["jvp_jaxpr_fun"], _exact.retyper(low))
    return bind(eqn, invals, params)


def _shard_map(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    jaxpr = eqn.params["jaxpr"]

    if ctx.key is not None:  # the body is traced apart and has no input for a key
        ctx = dataclasses.replace(ctx, key=NoKey())

    def body(*xs: Any) -> list[Any]:
        return eval_jaxpr(jaxpr, (), xs, ctx, scope)

    return _jax_internals.bind_shard_map(invals, dict(eqn.params), body)


HANDLERS: dict[Any, Handler] = {
    jit_p: _jit,
    scan_p: _scan,
    while_p: _while,
    cond_p: _cond,
    remat_p: _remat,
    custom_jvp_call_p: _custom,
    custom_vjp_call_p: _custom,
    _jax_internals.shard_map_p: _shard_map,
}
HANDLERS.update(_calls.handlers())  # linear solves, calls, composites; refused primitives raise
