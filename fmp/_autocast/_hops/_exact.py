"""``custom_jvp`` helpers that only pick values (``jax.nn.relu``, ``relu6``) run in their input's dtype.

A custom-derivative call keeps the types of the original program at its boundary (``_control._custom``), so a
bfloat16 value handed to ``jax.nn.relu`` in a float32 program is cast up, maxed in float32 and cast down again
by the matmul after it, where code cast by hand runs ``relu`` in bfloat16. When the call, its derivative rule
and everything they call only compare, select, negate and move values (``EXACT``), with literals the input's
dtype holds exactly, running them in that dtype gives the same bits: a maximum of bfloat16 values is a
bfloat16 value, and so is a selection of a cotangent. The call then takes the dtype of its inputs, when each of
its outputs goes to one consumer that casts it to a dtype it decides alone (a matmul or convolution, a float32
op, an explicit cast; through jnp's helpers): that consumer sees the same values, and so does the backward
pass, where rounding a cotangent commutes with the selection.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal
from jax.extend.core.primitives import convert_element_type_p, custom_jvp_call_p, jit_p

from fmp._autocast._engine import _jax_internals
from fmp._autocast._engine._context import Context, aval_of, dtype_name, is_castable
from fmp._autocast._engine._dims import contracted_size
from fmp._autocast._engine._frames import Frame, frame_of, is_inline_call, used_once
from fmp._autocast._engine._interp import bind
from fmp._autocast._engine._lru import LRU
from fmp._core import _dtypes
from fmp._core._rules import Category

# Primitives whose result, for inputs held in a floating dtype, is one of those inputs or a boolean/moved copy.
EXACT = frozenset(
    {
        "abs",
        "and",
        "broadcast_in_dim",
        "copy",
        "copy_p",
        "eq",
        "expand_dims",
        "ge",
        "gt",
        "le",
        "lt",
        "max",
        "min",
        "ne",
        "neg",
        "not",
        "or",
        "reshape",
        "select_n",
        "sign",
        "squeeze",
        "transpose",
    }
)

# Consumers that cast a floating input to a dtype they decide from the rule table alone (a float8-category
# matmul is a lower-precision one without a float8 recipe, the only case looked at here).
_DECIDING = (Category.LOWER_PRECISION, Category.FLOAT8, Category.FLOAT32)


def input_dtype(eqn: JaxprEqn, invals: list[Any], ctx: Context) -> Any | None:
    """The low-precision dtype ``eqn`` (a ``custom_jvp_call``) runs in unchanged, or None (kept as written)."""
    if eqn.primitive is not custom_jvp_call_p or not ctx.frames or _has_float8(ctx):
        return None
    if eqn.params.get("symbolic_zeros"):  # its rule may differ with the zeros JAX hands it: only one is checked
        return None
    floats = [v for v in [*eqn.invars, *eqn.outvars] if hasattr(v.aval, "dtype") and is_castable(v.aval.dtype)]
    written = {dtype_name(v.aval.dtype) for v in floats}
    now = {
        dtype_name(aval_of(x).dtype)
        for v, x in zip(eqn.invars, invals, strict=True)
        if hasattr(v.aval, "dtype") and is_castable(v.aval.dtype)
    }
    if len(written) != 1 or len(now) != 1:
        return None
    (was,), (low,) = written, now
    if low == was or low not in _dtypes.LOW_PRECISION or _dtypes.widest([was, low]) != was:
        return None
    frame = ctx.frames[-1]
    outs = [v for v in eqn.outvars if hasattr(v.aval, "dtype") and is_castable(v.aval.dtype)]
    # inside a body or rule run in ``low`` every value is one ``low`` holds: no consumer to look at
    inside = any(id(f.jaxpr) in RUNNING for f in ctx.frames)
    if not inside and not all(_decided_downstream(v, frame, ctx) for v in outs):
        return None
    return jnp.dtype(low) if _exact_call(eqn, low, set()) else None


# id(jaxpr) of the bodies and rules of the calls being rewritten in their inputs' dtype (``running``)
RUNNING: set[int] = set()


@contextlib.contextmanager
def running(jaxpr: Jaxpr) -> Iterator[None]:
    """Rewrites ``jaxpr`` (the body or the jvp rule of a call ``input_dtype`` accepted) in its inputs' dtype:
    the calls inside it run in that dtype too (relu's rule calls relu)."""
    RUNNING.add(id(jaxpr))
    try:
        yield
    finally:
        RUNNING.discard(id(jaxpr))


def retyped(avals: Any, dtype: Any) -> list[Any]:
    """``avals`` with every castable floating aval in ``dtype``."""
    return [a.update(dtype=dtype) if hasattr(a, "dtype") and is_castable(a.dtype) else a for a in avals]


def _has_float8(ctx: Context) -> bool:
    # a float8 matmul scales its input in the input's dtype: a bfloat16 input would round differently
    return ctx.policy.float8 is not None or any(p.float8 is not None for _, p in ctx.overrides)


_CONSUMERS = LRU(512)  # id(jaxpr) -> {variable: the last equation that reads it}, while the jaxpr lives


def _consumer(var: Any, jaxpr: Jaxpr) -> JaxprEqn | None:
    made = _CONSUMERS.of(
        jaxpr, id(jaxpr), lambda: {v: e for e in jaxpr.eqns for v in e.invars if not isinstance(v, Literal)}
    )
    return made.get(var)


def _decided_downstream(var: Any, frame: Frame, ctx: Context) -> bool:
    """``var`` has one use, by an op that casts it to a dtype of its own deciding (through inline helpers)."""
    if frame.jaxpr is None or not used_once(var, frame):
        return False
    use = _consumer(var, frame.jaxpr)
    if use is None or sum(1 for u in use.invars if u is var) != 1:
        return False  # a jaxpr output
    if use.primitive is convert_element_type_p:
        return True
    if is_inline_call(use):
        body = use.params["jaxpr"].jaxpr
        return _decided_downstream(body.invars[use.invars.index(var)], frame_of(body), ctx)
    if use.primitive.name in ctx.rules.jax_uncontracted and contracted_size(use) == 1:
        return False  # decided as mul (promote)
    return ctx.rules.category(use.primitive.name) in _DECIDING


_EXACT_CALLS = LRU(512)  # (id(body), dtype) -> whether the call runs exactly in that dtype, while the body lives


def _exact_call(eqn: JaxprEqn, low: str, checking: set[str]) -> bool:
    """Whether the ``custom_jvp_call`` ``eqn``, its body and its jvp rule only pick values (``EXACT``)."""
    body: ClosedJaxpr = eqn.params["call_jaxpr"]
    key = str(body.jaxpr)
    if key in checking:  # a rule that calls its own function (relu's does): exact if the rest is
        return True
    checking.add(key)
    try:
        return _EXACT_CALLS.of(body, (id(body), low), lambda: _exact_closed(body, low, checking)) and _exact_rule(
            eqn, low, checking
        )
    finally:
        checking.discard(key)


def _exact_rule(eqn: JaxprEqn, low: str, checking: set[str]) -> bool:
    try:
        jaxpr, consts, *_ = eqn.params["jvp_jaxpr_fun"].call_wrapped(*[False] * len(eqn.invars))
    except Exception:  # noqa: BLE001 - a rule that cannot be traced here is not looked into
        return False
    return not consts and _exact_jaxpr(jaxpr, low, checking)


def _exact_closed(closed: ClosedJaxpr, low: str, checking: set[str]) -> bool:
    return not closed.consts and _exact_jaxpr(closed.jaxpr, low, checking)


def _exact_jaxpr(jaxpr: Jaxpr, low: str, checking: set[str]) -> bool:
    if jaxpr.constvars:
        return False
    for e in jaxpr.eqns:
        if not all(_held(v.val, low) for v in e.invars if isinstance(v, Literal)):
            return False
        if e.primitive is jit_p:
            ok = _exact_closed(e.params["jaxpr"], low, checking)
        elif e.primitive is custom_jvp_call_p:
            ok = _exact_call(e, low, checking)
        elif e.primitive is convert_element_type_p:
            ok = e.params["new_dtype"] == e.invars[0].aval.dtype
        else:
            ok = e.primitive.name in EXACT
        if not ok:
            return False
    return True


def _held(value: Any, low: str) -> bool:
    """A literal ``low`` holds exactly (``0.0`` does, ``0.1`` does not)."""
    a = np.asarray(value)
    if not np.issubdtype(a.dtype, np.floating):
        return True
    with np.errstate(over="ignore"):
        return bool(np.all(a.astype(jnp.dtype(low)).astype(a.dtype) == a))


def retype(closed: ClosedJaxpr, low: Any) -> ClosedJaxpr:
    """``closed`` (a body or rule ``_exact_jaxpr`` accepts) traced again with every floating value in ``low``:
    its inputs, its float literals (which ``low`` holds exactly) and the calls inside it."""

    def fun(*args: Any) -> list[Any]:
        env: dict[Any, Any] = dict(zip(closed.jaxpr.invars, args, strict=True))
        for e in closed.jaxpr.eqns:
            ins = [_literal(v.val, low) if isinstance(v, Literal) else env[v] for v in e.invars]
            if e.primitive is jit_p:
                outs = bind(e, ins, dict(e.params, jaxpr=retype(e.params["jaxpr"], low)))
            elif e.primitive is custom_jvp_call_p:
                params = dict(e.params, call_jaxpr=retype(e.params["call_jaxpr"], low))
                params["jvp_jaxpr_fun"] = _jax_internals.rewrap_rule_thunk(e.params["jvp_jaxpr_fun"], retyper(low))
                outs = bind(e, ins, params)
            elif e.primitive is convert_element_type_p:  # to its own dtype (``_exact_jaxpr``)
                outs = ins
            else:
                outs = bind(e, ins, e.params)
            env.update(zip(e.outvars, outs, strict=True))
        return [_literal(v.val, low) if isinstance(v, Literal) else env[v] for v in closed.jaxpr.outvars]

    return _jax_internals.trace_to_closed_jaxpr(fun, retyped(closed.in_avals, low), "fmp.autocast")


def retyper(low: Any) -> Callable[[ClosedJaxpr], ClosedJaxpr]:
    """``retype`` into ``low``, for a rule thunk (``_jax_internals.rewrap_rule_thunk``)."""
    return functools.partial(retype, low=low)


def _literal(value: Any, low: Any) -> Any:
    a = np.asarray(value)
    return np.asarray(a, low) if np.issubdtype(a.dtype, np.floating) else value
