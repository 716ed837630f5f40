"""Handlers for the call-like higher-order primitives: linear solves, plain calls, composites.

Registered into the handler table next to the loop and custom-derivative
handlers (``_hops.HANDLERS``). Every primitive that carries a sub-jaxpr is
either rewritten here or in ``_hops``, kept as written (``_transform.OPAQUE``:
scalar combiners of reductions and scatters), or refused with an error that
names it (``REFUSED``); ``tests/autocast/test_hops_calls.py`` enumerates
the installed JAX's primitives and fails on one that is in none of these.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.extend.core import ClosedJaxpr, JaxprEqn

from fmp._autocast._engine import _jax_internals
from fmp._autocast._engine._cast import restore
from fmp._autocast._engine._context import Context, Handler, like_avals, passes_key
from fmp._autocast._engine._interp import bind, extra_inputs, transform_closed
from fmp._autocast._hops import _float8_rows
from fmp._core._rules import Category
from fmp._policy import get_policy


def _pinned(closed: ClosedJaxpr, ctx: Context, scope: str) -> ClosedJaxpr:
    """``closed`` rewritten with its own input and output dtypes kept at the boundary."""
    outs = [a.dtype if hasattr(a, "dtype") else None for a in closed.out_avals]
    return transform_closed(closed, closed.in_avals, ctx, scope, outs)


def _linear_solve(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    """``custom_linear_solve`` (``jnp.linalg.solve``, ``inv``, ``lax.custom_root``'s jvp).

    Its four jaxprs (matvec, vecmat, solve, transpose_solve) are each
    rewritten with the types of the original program at their boundary, so the
    primitive's own differentiation and transposition rules still apply. The
    rule table decides the policy of the bodies: ``custom_linear_solve`` is in
    the float32 category by default, so the bodies run under a float32 policy
    (a solve in bfloat16 loses all precision); moved to another category they
    run under the caller's policy.
    """
    name = eqn.primitive.name
    if ctx.rules.category(name) is Category.FLOAT32:
        why = f"inside {name}: its bodies run in float32 by the rule table ({name} is in the float32 category)"
        ctx = dataclasses.replace(ctx, policy=get_policy("float32"), reason=why)
    jaxprs = eqn.params["jaxprs"]
    new = type(jaxprs)(*(None if j is None else _pinned(j, ctx, scope) for j in jaxprs))
    return bind(eqn, restore(eqn, invals, ctx, scope), dict(eqn.params, jaxprs=new))


def rewrite_call(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    """A call (``_jax_internals.is_call_primitive``: ``closed_call``, ``call``, ``eval_jaxpr``, ...; or one of
    ``CALLS_WITH_PARAMS``): its body is rewritten for the current input dtypes and bound as the same call again."""
    name = _jax_internals.body_param(eqn.params)
    body = eqn.params[name]
    new, invals = _call_body(_jax_internals.as_closed(body), invals, ctx, scope)
    if isinstance(body, ClosedJaxpr):
        return bind(eqn, invals, dict(eqn.params, **{name: new}))
    if new.consts:  # an open body (jax 0.10's call) whose rewrite created constants: a closed call instead
        return bind_closed_call(new, invals)
    return bind(eqn, invals, dict(eqn.params, **{name: new.jaxpr}))


def _call_body(closed: ClosedJaxpr, invals: list[Any], ctx: Context, scope: str) -> tuple[ClosedJaxpr, list[Any]]:
    """A call's body rewritten for the current input dtypes, and its inputs (plus its float8 history rows and
    its stochastic-rounding key)."""
    avals = like_avals(list(closed.in_avals), invals)
    keyed = passes_key(ctx)
    ctx, rows, block = _float8_rows.body_rows(
        ctx, lambda c: transform_closed(closed, avals, c, scope, keyed=keyed), len(avals)
    )
    new = transform_closed(closed, avals, ctx, scope, rows=rows, keyed=keyed)
    return new, [*invals, *extra_inputs(ctx, block)]


def bind_closed_call(closed: ClosedJaxpr, invals: list[Any]) -> list[Any]:
    prim = _jax_internals.closed_call_p
    return list(prim.bind(*invals, **prim.get_bind_params({"call_jaxpr": closed})))


def _composite(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    """``lax.composite``: the decomposition is rewritten with its original boundary types.

    A backend that replaces the composite by its own kernel sees the name and
    attributes it was written for, with the inputs it declared.
    """
    name = _jax_internals.body_param(eqn.params)
    new = _pinned(_jax_internals.as_closed(eqn.params[name]), ctx, scope)
    return bind(eqn, restore(eqn, invals, ctx, scope), dict(eqn.params, **{name: new}))


# Calls that carry params of their own beside the body (where it runs, compiler metadata), kept as they are
# while the body is rewritten like a plain call's: jax.experimental.compute_on, and
# jax.experimental.xla_metadata.xla_metadata_call (jax 0.11 and later).
CALLS_WITH_PARAMS = ("compute_on", "xla_metadata_call")

# Primitives with a sub-jaxpr (or a traced function) that fmp does not rewrite, with the reason given in the
# error. They appear in user programs only through the APIs named.
REFUSED: dict[str, str] = {
    "run_state": "stateful references (jax.experimental's run_state / discharge) cannot be retyped",
    "custom_vmap_call": "jax.custom_batching.custom_vmap's batching rule is typed for the original dtypes",
    "linear_call": "jax.custom_derivatives.linear_call's transpose rule is typed for the original dtypes",
    "custom_lin": "an internal of JAX's autodiff, not expected in a user program",
    "remat_opt": "an internal of JAX's checkpoint optimisation, not expected in a user program",
    "custom_transpose_call": "jax.custom_transpose's transpose rule is typed for the original dtypes",
    "call_hi_primitive_linearized": "an internal of JAX's autodiff of a 'hijax' primitive, not expected in a "
    "user program",
}

# Kernels compiled or partitioned for the dtypes they were written in: they run exactly as written, their
# floating inputs first given back the dtypes of the original program (like the opaque primitives).
AS_WRITTEN: dict[str, str] = {
    "core_map": "a Pallas kernel",
    "cudnn_fusion": "a cuDNN fusion",
    "call_exported": "a jax.export'ed function, serialised for fixed input dtypes",
    "custom_partitioning": "jax.experimental.custom_partitioning, whose partitioner is typed for its inputs",
    # its params hold a primitive object typed for its input types (no jaxpr to rewrite): lax.custom_root from
    # jax 0.11 on, jnp.ldexp, jnp.frexp, jnp.nonzero and jnp.searchsorted from jax 0.12 on
    "call_hi_primitive": "a JAX 'hijax' primitive, typed for its inputs by its own rules",
}

_MSG_REFUSED = (
    "fmp.autocast: primitive {name!r} carries a sub-jaxpr or traced rule that fmp does not rewrite ({why}). "
    "Move this call outside the autocast function, or wrap it in fmp.autocast(..., enabled=False) "
    "to run it exactly as written."
)


def _refuse(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    name = eqn.primitive.name
    raise NotImplementedError(_MSG_REFUSED.format(name=name, why=REFUSED.get(name, "unknown to fmp")))


def _as_written(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    return bind(eqn, restore(eqn, invals, ctx, scope), eqn.params)


def handlers() -> dict[Any, Handler]:
    """The handlers of this module, keyed by primitive (refused ones raise)."""
    prims = _jax_internals.primitives_by_name()
    out: dict[Any, Handler] = {}
    for prim in prims.values():  # by what they are, not by name: JAX releases disagree on the names
        if _jax_internals.is_call_primitive(prim):
            out[prim] = rewrite_call
    for name, handler in (("custom_linear_solve", _linear_solve), ("composite", _composite)):
        if name in prims:
            out[prims[name]] = handler
    for name in CALLS_WITH_PARAMS:
        if name in prims:
            out[prims[name]] = rewrite_call
    for name in REFUSED:
        if name in prims:
            out[prims[name]] = _refuse
    for name in AS_WRITTEN:
        if name in prims:
            out[prims[name]] = _as_written
    return out
