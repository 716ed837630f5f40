"""How ``fmp.explain(..., compare=True)`` evaluates the bodies of higher-order equations: on values, equation
by equation, each beside its reference (``jit`` and inline helpers, ``checkpoint``, custom derivative calls,
calls the rewrite rewrites; ``scan``, ``while`` and ``cond`` in ``_loops``); bodies not evaluated here yet
(``shard_map``, linear solves) are refused with a clear error.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from jax.extend.core import ClosedJaxpr, JaxprEqn
from jax.extend.core import primitives as core_prims

from fmp._autocast._engine import _jax_internals
from fmp._autocast._engine._cast import cast
from fmp._autocast._engine._context import Context, Handler, calling
from fmp._autocast._engine._frames import is_inline_call
from fmp._autocast._engine._interp import eval_jaxpr
from fmp._autocast._explain import _loops
from fmp._autocast._hops import _calls
from fmp._autocast._hops._helpers import helper_call

_MSG_BODY = (
    "fmp.explain(compare=True) does not yet compare inside {name!r} bodies (shard_map and linear solves are "
    "rewritten as traced bodies, which hold no values to compare). Call fmp.explain without compare=True "
    "for the dtypes, or compare the function the body runs."
)


def _evaluated(closed: ClosedJaxpr, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    return eval_jaxpr(closed.jaxpr, closed.consts, _loops.as_body_inputs(invals), ctx, scope)


def _jit(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    # what the rewrite does with a user's jit (its body rewritten for the current input dtypes), evaluated
    if is_inline_call(eqn):
        return helper_call(eqn, invals, ctx, scope)  # explain inlines helpers: evaluated in this trace
    with calling(ctx, eqn):
        return _evaluated(eqn.params["jaxpr"], invals, ctx, scope)


def _remat(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    return _evaluated(_jax_internals.as_closed(eqn.params["jaxpr"]), invals, ctx, scope)


def _call(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    # a call whose body the rewrite rewrites (_calls.rewrite_call: closed_call, eval_jaxpr, compute_on, ...)
    body = eqn.params[_jax_internals.body_param(eqn.params)]
    return _evaluated(_jax_internals.as_closed(body), invals, ctx, scope)


def _custom(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    # the primal body keeps the call's input and output dtypes, as the rewrite's custom-call handler does
    closed: ClosedJaxpr = eqn.params["call_jaxpr"]
    pinned = [cast(x, a.dtype, ctx) if hasattr(a, "dtype") else x for x, a in zip(invals, closed.in_avals, strict=True)]
    outs = _evaluated(closed, pinned, ctx, scope)
    return [cast(o, a.dtype, ctx) if hasattr(a, "dtype") else o for o, a in zip(outs, closed.out_avals, strict=True)]


def _refused(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    raise NotImplementedError(_MSG_BODY.format(name=eqn.primitive.name))


def compare_handlers(handlers: dict[Any, Handler]) -> dict[Any, Handler]:
    """The rewrite's handlers with every body evaluated on values (or refused, where not yet compared)."""
    prims = _primitives()
    evaluated: dict[Any, Callable[..., list[Any]]] = {
        core_prims.jit_p: _jit,
        core_prims.remat_p: _remat,
        core_prims.custom_jvp_call_p: _custom,
        core_prims.custom_vjp_call_p: _custom,
        core_prims.scan_p: _loops.scan,
        core_prims.while_p: _loops.while_loop,
        core_prims.cond_p: _loops.cond,
    }
    evaluated.update({p: _call for p, h in handlers.items() if h is _calls.rewrite_call})
    kept = {prims[n] for n in (*_calls.REFUSED, *_calls.AS_WRITTEN) if n in prims}
    out: dict[Any, Handler] = {}
    for prim, handler in handlers.items():
        if prim in evaluated:
            out[prim] = evaluated[prim]
        else:
            out[prim] = handler if prim in kept else _refused
    return out


_PRIMITIVES: list[Any] = [None, {}]  # (modules loaded when it was made, primitives_by_name())


def _primitives() -> dict[str, Any]:
    """``_jax_internals.primitives_by_name()``, looked up again only once more modules are loaded."""
    if _PRIMITIVES[0] != len(sys.modules):
        _PRIMITIVES[1] = _jax_internals.primitives_by_name()
        _PRIMITIVES[0] = len(sys.modules)
    return _PRIMITIVES[1]
