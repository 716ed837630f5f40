"""One rewrite rule per higher-order primitive: the bodies are rewritten too.

Each handler takes ``(eqn, invals, ctx, scope)`` and returns the equation's
outputs. Types that must agree are pinned: a loop carry keeps the dtype the
original program gave it, ``cond`` branches that disagree return the original
dtype, and a custom-derivative call keeps its original input and output dtypes
so that its (unchanged) derivative rules still type-check.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, JaxprEqn, jaxpr_as_fun
from jax.extend.core.primitives import cond_p, custom_jvp_call_p, custom_vjp_call_p, jit_p, remat_p, scan_p, while_p

from fmp._autocast import _jax_internals
from fmp._autocast._transform import Context, Handler, aval_of, bind, cast, eval_jaxpr, transform_closed


def _like(avals: list[Any], vals: list[Any]) -> list[Any]:
    """The body's own avals (shape, sharding, ...) with the dtypes of ``vals``."""
    out = []
    for a, x in zip(avals, vals, strict=True):
        cur = aval_of(x)
        out.append(a.update(dtype=cur.dtype, weak_type=cur.weak_type) if hasattr(a, "dtype") else a)
    return out


def _pin(vals: list[Any], avals: list[Any], ctx: Context) -> list[Any]:
    """Casts ``vals`` to the dtypes of ``avals`` (a loop carry, a custom call's inputs)."""
    return [cast(x, a.dtype, ctx) if hasattr(a, "dtype") else x for x, a in zip(vals, avals, strict=True)]


def _dtypes(avals: list[Any]) -> list[Any]:
    return [a.dtype if hasattr(a, "dtype") else None for a in avals]


def _jit(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    closed: ClosedJaxpr = eqn.params["jaxpr"]
    new = transform_closed(closed, _like(closed.in_avals, invals), ctx, scope)
    return bind(eqn, invals, dict(eqn.params, jaxpr=new))


def _scan(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    p = eqn.params
    closed: ClosedJaxpr = p["jaxpr"]
    nc, nk = p["num_consts"], p["num_carry"]
    carry_avals = closed.in_avals[nc : nc + nk]
    consts, carry, xs = invals[:nc], invals[nc : nc + nk], invals[nc + nk :]
    carry = _pin(carry, carry_avals, ctx)
    in_avals = _like(closed.in_avals[:nc], consts) + list(carry_avals) + _like(closed.in_avals[nc + nk :], xs)
    n_ys = len(closed.out_avals) - nk
    new = transform_closed(closed, in_avals, ctx, scope, _dtypes(carry_avals) + [None] * n_ys)
    return bind(eqn, consts + carry + xs, dict(p, jaxpr=new))


def _while(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    p = eqn.params
    cond: ClosedJaxpr = p["cond_jaxpr"]
    body: ClosedJaxpr = p["body_jaxpr"]
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, carry = invals[:nc], invals[nc : nc + nb], invals[nc + nb :]
    carry_avals = body.in_avals[nb:]
    carry = _pin(carry, carry_avals, ctx)
    new_cond = transform_closed(cond, _like(cond.in_avals[:nc], cconsts) + list(carry_avals), ctx, scope)
    new_body = transform_closed(
        body, _like(body.in_avals[:nb], bconsts) + list(carry_avals), ctx, scope, _dtypes(carry_avals)
    )
    return bind(eqn, cconsts + bconsts + carry, dict(p, cond_jaxpr=new_cond, body_jaxpr=new_body))


def _cond(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    branches: tuple[ClosedJaxpr, ...] = eqn.params["branches"]
    index, ops = invals[0], invals[1:]
    mark = None if ctx.records is None else len(ctx.records)
    new = [transform_closed(b, _like(b.in_avals, ops), ctx, scope) for b in branches]
    outs = [tuple(getattr(a, "dtype", None) for a in b.out_avals) for b in new]
    if len(set(outs)) > 1:  # branches disagree: pin the outputs that differ to the original dtype
        if ctx.records is not None and mark is not None:
            del ctx.records[mark:]
        pinned = [None if len({o[i] for o in outs}) == 1 else v.aval.dtype for i, v in enumerate(eqn.outvars)]
        new = [transform_closed(b, _like(b.in_avals, ops), ctx, scope, pinned) for b in branches]
    return bind(eqn, [index, *ops], dict(eqn.params, branches=tuple(new)))


def _remat(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    p = eqn.params
    closed = ClosedJaxpr(p["jaxpr"], ())
    new = transform_closed(closed, _like(closed.in_avals, invals), ctx, scope)
    if not new.consts:
        return bind(eqn, invals, dict(p, jaxpr=new.jaxpr))
    fun = jax.checkpoint(jaxpr_as_fun(new), prevent_cse=p["prevent_cse"], policy=p["policy"])
    return list(fun(*invals))


def _custom(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    """custom_jvp_call / custom_vjp_call: the primal body and the jvp / fwd rule are rewritten.

    The rules themselves are kept (a custom derivative still applies), and the
    call's inputs and outputs, the jvp rule's tangents and the fwd rule's
    residuals keep the dtypes of the original program, which the user's rules
    were written for. The bwd rule of a custom_vjp runs as written.
    """
    closed: ClosedJaxpr = eqn.params["call_jaxpr"]
    invals = _pin(invals, closed.in_avals, ctx)
    new = transform_closed(closed, closed.in_avals, ctx, scope, _dtypes(closed.out_avals))
    params = dict(eqn.params, call_jaxpr=new)

    def rewrite(rule: ClosedJaxpr) -> ClosedJaxpr:  # the rule's own types are kept at its boundary
        return transform_closed(rule, rule.in_avals, ctx, scope, _dtypes(rule.out_avals))

    thunk = "jvp_jaxpr_fun" if eqn.primitive is custom_jvp_call_p else "fwd_jaxpr_thunk"
    params[thunk] = _jax_internals.rewrap_rule_thunk(params[thunk], rewrite)
    return bind(eqn, invals, params)


def _shard_map(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    jaxpr = eqn.params["jaxpr"]

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
