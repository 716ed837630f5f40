"""The interpreter core: evaluate a jaxpr equation by equation, rewriting each under a policy.

The rewrite is an interpreter that re-binds every equation with (possibly
cast) inputs. Run under a fresh trace it yields a new
``ClosedJaxpr`` (``transform_closed``); run in the
caller's trace (``fmp.autocast``) it emits the same equations there, so
``jit``, ``grad`` and ``vmap`` compose. Decisions read the *current* input
dtypes (those the rewritten program produced so far), so a value that is
already in the compute dtype is not cast again.

This module is the bottom of ``fmp._autocast``: it knows no rule. What to do
with an equation comes from the ``Context``: ``ctx.handlers`` (one per
higher-order primitive, ``_hops``) and ``ctx.leaf`` (every other equation,
``_leaf``); ``_transform.make_context`` is the one place that fills them in.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, jaxprs_in_params
from jax.extend.core.primitives import jit_p

from fmp._autocast import _jax_internals, _rows
from fmp._autocast._provenance import Frame, frame_of, is_inline_call
from fmp._core import _dtypes
from fmp._core._report import OpRecord
from fmp._core._rules import RuleSet
from fmp._policy import Policy

# The named scope an autocast region runs under. An outer autocast leaves every
# equation under this scope as the inner region decided it.
REGION_SCOPE = "fmp_autocast"

# Primitives whose sub-jaxpr is a scalar combiner typed for the original dtype,
# not user code: they run in the dtypes of the original program, unchanged.
OPAQUE = frozenset(
    {
        "reduce",
        "reduce_window",
        "select_and_scatter",
        "select_and_scatter_add",
        "select_and_gather_add",
        "scatter",
        "scatter-add",
        "scatter-sub",
        "scatter-mul",
        "scatter-min",
        "scatter-max",
    }
)

# Primitives whose meaning depends on the exact input dtype: always given the
# original dtypes back.
EXACT_DTYPE = frozenset({"bitcast_convert_type", "reduce_precision", "pure_callback", "io_callback", "debug_callback"})

_MSG_UNHANDLED = (
    "fmp.autocast: primitive {name!r} carries a sub-jaxpr that fmp does not know how to rewrite. "
    "Move this call outside the autocast function, or wrap it in fmp.autocast(..., enabled=False) "
    "to run it exactly as written."
)


def like_avals(avals: Sequence[Any], vals: Sequence[Any]) -> list[Any]:
    """``avals`` (a body's own: shape, sharding, ...) with the dtypes and weak types of ``vals``."""
    out = []
    for a, x in zip(avals, vals, strict=True):
        cur = aval_of(x)
        out.append(a.update(dtype=cur.dtype, weak_type=cur.weak_type) if hasattr(a, "dtype") else a)
    return out


def dtype_name(dtype: Any) -> str:
    """The name of a dtype; works for extended dtypes (PRNG keys) that NumPy does not know."""
    name = getattr(dtype, "name", None)
    return name if isinstance(name, str) else np.dtype(dtype).name


def _is_castable(dtype: Any) -> bool:
    return dtype_name(dtype) in _dtypes.CASTABLE


def is_constant(x: Any) -> bool:
    """A value known while tracing: a literal of the program, or a constant JAX would fold into one."""
    return isinstance(x, int | float | complex | np.ndarray | np.generic) and not isinstance(x, jax.Array)


def aval_of(x: Any) -> Any:
    """The abstract value of a runtime value (tracer, array or Python scalar)."""
    return jax.typeof(x)


@dataclasses.dataclass
class Context:
    """The static configuration of one rewrite, plus an optional explain recorder."""

    policy: Policy
    rules: RuleSet
    overrides: tuple[tuple[str, Policy], ...] = ()
    records: list[OpRecord] | None = None
    # one cast cache per jaxpr being evaluated (values of one trace): (id(x), dtype) -> (x, cast x)
    memos: list[dict[tuple[int, str], tuple[Any, Any]]] = dataclasses.field(default_factory=list)
    # one frame per jaxpr being evaluated: where its variables come from in the original program (epilogue rule)
    frames: list[Frame] = dataclasses.field(default_factory=list)
    # the traceback of the inline helper call whose body is being rewritten (its equations take it, as JAX's
    # inlining gives them); empty at the top level
    tracebacks: list[Any] = dataclasses.field(default_factory=list)
    # what to do with an equation: higher-order primitive -> handler; every other equation -> leaf
    handlers: Mapping[Any, Handler] = dataclasses.field(default_factory=dict)
    leaf: Leaf | None = None
    # delayed float8 scaling: hands out one amax-history row per top-level float8 site (fmp._fp8._state)
    fp8_sites: Any = None

    def resolve(self, scope: str) -> tuple[str, Policy]:
        """``("nested" | "override" | "default", policy)`` for an equation in ``scope``."""
        if REGION_SCOPE in scope:
            return "nested", self.policy
        best, where = None, -1
        for key, pol in self.overrides:
            pos = scope.rfind(key)
            if pos > where:
                best, where = pol, pos
        if best is not None:
            return "override", best
        return "default", self.policy

    def record(self, **fields: Any) -> None:
        if self.records is not None:
            self.records.append(OpRecord(index=len(self.records), **fields))


def _join(prefix: str, own: str) -> str:
    return f"{prefix}/{own}" if prefix and own else (prefix or own)


def _names(avals: Sequence[Any]) -> tuple[str, ...]:
    return tuple(dtype_name(a.dtype) for a in avals if hasattr(a, "dtype"))


def _float_names(avals: Sequence[Any]) -> tuple[str, ...]:
    return tuple(n for n in _names(avals) if n.startswith(("float", "bfloat")))


def round_once(up: Any, src: Any) -> Any:
    """``up`` (a value cast up from ``src``) with ``src``'s rounding made explicit.

    One rounding for every consumer: inside a fusion XLA may drop a convert pair
    float32 -> bfloat16 -> float32 (excess precision), so a consumer reading the
    value through a cast up would see the producer's unrounded float32 result
    while another consumer of the same bfloat16 value sees it rounded (a
    cross-entropy then goes negative under ``jit``). ``reduce_precision`` is never
    dropped and rounds as the convert does, so ``jit`` equals eager; where XLA
    keeps the pair it changes nothing.
    """
    src, dst = dtype_name(src), dtype_name(aval_of(up).dtype)
    if src not in _dtypes.LOW_PRECISION or dst not in _dtypes.CASTABLE or _dtypes.widest([src, dst]) != dst:
        return up
    exponent, mantissa = _dtypes.FORMAT_BITS[src]
    return jax.lax.reduce_precision(up, exponent_bits=exponent, mantissa_bits=mantissa)


@functools.cache
def _cast_fn(src: Any, dst: Any) -> Callable[[Any], Any]:
    """``x -> round_once(convert(x, dst), src)`` as a jitted helper (``inline=True``, like jnp's): JAX
    caches its differentiation per input type instead of linearizing the cast at every use."""

    def convert(x: Any) -> Any:
        return round_once(jax.lax.convert_element_type(x, dst), src)

    return jax.jit(convert, inline=True)


_CAST_CALLS: collections.OrderedDict[tuple[Any, str, Any], dict[str, Any] | None] = collections.OrderedDict()


def _cast_call(x: Any, aval: Any, dtype: Any) -> Any:
    """``_cast_fn(...)(x)``, bound as the ``jit`` equation that call would stage, reused per input type
    (a call of a jitted function re-derives that equation every time)."""
    key = (aval, dtype.name, jax.sharding.get_abstract_mesh())
    if key not in _CAST_CALLS:
        _CAST_CALLS[key] = _jax_internals.staged_call_params(_cast_fn(aval.dtype, dtype), aval)
        if len(_CAST_CALLS) > _CACHE_SIZE:
            _CAST_CALLS.popitem(last=False)
    params = _CAST_CALLS[key]
    if params is None:
        return _cast_fn(aval.dtype, dtype)(x)
    return jit_p.bind(x, **params)[0]


def cast(x: Any, dtype: Any, ctx: Context, eqn: JaxprEqn | None = None, scope: str = "") -> Any:
    """Casts ``x`` to ``dtype`` when it differs, recording the cast (for ``eqn``) for explain."""
    aval = aval_of(x)
    if aval.dtype == dtype or not _is_castable(aval.dtype):
        return x
    dtype = np.dtype(dtype)
    if isinstance(x, int | float | np.ndarray | np.generic) and not isinstance(x, jax.Array):
        return np.asarray(x, dtype=dtype)
    memo = ctx.memos[-1] if ctx.memos else None
    if memo is not None:
        hit = memo.get((id(x), dtype.name))
        if hit is not None and hit[0] is x:
            return hit[1]
    ctx.record(
        op="convert_element_type",
        source=source_of(eqn, ctx) if eqn is not None else "",
        scope=scope,
        category="cast",
        in_before=(),
        in_after=(dtype_name(aval.dtype),),
        out_before=(),
        out_after=(dtype.name,),
    )
    out = _cast_call(x, aval, dtype)
    if memo is not None:
        memo[(id(x), dtype.name)] = (x, out)  # keeps x alive, so its id is not reused
    return out


def bind(eqn: JaxprEqn, invals: Sequence[Any], params: Mapping[str, Any]) -> list[Any]:
    """Binds ``eqn``'s primitive on ``invals`` with ``params``; always returns a list."""
    prim = eqn.primitive
    out = prim.bind(*invals, **prim.get_bind_params(dict(params)))
    return list(out) if prim.multiple_results else [out]


def eval_jaxpr(
    jaxpr: Jaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    ctx: Context,
    prefix: str,
    call: JaxprEqn | None = None,
    hints: Sequence[tuple[int, tuple[bool, bool]]] = (),
) -> list[Any]:
    """Evaluates ``jaxpr`` on ``args``, rewriting each equation; returns the outputs.

    ``call``: ``jaxpr`` is the body of this equation of the jaxpr being
    evaluated, inlined into the same trace: it shares that jaxpr's cast cache,
    and the epilogue rule sees through its inputs to the caller's program.
    ``hints``: ``(equation index, epilogue sides)`` for a helper body rewritten
    on its own (``_provenance.Frame.hints``).
    """
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    inlined = call is not None and bool(ctx.frames) and bool(ctx.memos)
    ctx.memos.append(ctx.memos[-1] if inlined else {})  # a value cast for two uses is cast once
    frame = frame_of(jaxpr, ctx.frames[-1], call.invars) if inlined and call else frame_of(jaxpr)
    if hints:
        frame = dataclasses.replace(frame, hints={id(jaxpr.eqns[i]): sides for i, sides in hints})
    ctx.frames.append(frame)
    try:
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            scope = _join(prefix, str(eqn.source_info.name_stack))
            name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
            tb = ctx.tracebacks[-1] if ctx.tracebacks else eqn.source_info.traceback
            with source_info_util.user_context(tb, name_stack=name_stack), eqn.ctx.manager:
                outs = rewrite_eqn(eqn, invals, ctx, scope)
            for v, x in zip(eqn.outvars, outs, strict=True):
                env[v] = x
        return [read(v) for v in jaxpr.outvars]
    finally:
        ctx.memos.pop()
        ctx.frames.pop()


def transform_closed(
    closed: ClosedJaxpr,
    in_avals: Sequence[Any],
    ctx: Context,
    prefix: str,
    out_dtypes: Sequence[Any] | None = None,
    hints: tuple[tuple[int, tuple[bool, bool]], ...] = (),
) -> ClosedJaxpr:
    """Rewrites ``closed`` for inputs of ``in_avals``; ``out_dtypes`` pins output dtypes (None: free).
    ``hints``: see ``eval_jaxpr``.

    Results are memoised on the jaxpr object and the configuration, for
    jaxprs without constants (so no cached entry keeps arrays or tracers
    alive) and not while recording for explain: JAX reuses jaxpr objects for
    repeated calls (two ``softmax`` calls share one), and handing JAX back the
    same rewritten object lets it reuse its own caches.
    """
    key = None
    if ctx.records is None and not closed.consts:
        dts = None if out_dtypes is None else tuple(out_dtypes)
        key = (closed, tuple(in_avals), ctx.policy, ctx.rules, ctx.overrides, prefix, dts, hints)
        hit = _CACHE.get(key)
        if hit is not None:
            _CACHE.move_to_end(key)
            return hit
    result = _transform_closed(closed, in_avals, ctx, prefix, out_dtypes, hints)
    if key is not None:
        _CACHE[key] = result
        if len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return result


_CACHE: collections.OrderedDict = collections.OrderedDict()
_CACHE_SIZE = 1024


def _transform_closed(
    closed: ClosedJaxpr,
    in_avals: Sequence[Any],
    ctx: Context,
    prefix: str,
    out_dtypes: Sequence[Any] | None,
    hints: tuple[tuple[int, tuple[bool, bool]], ...] = (),
) -> ClosedJaxpr:
    def fun(*args: Any) -> list[Any]:
        outs = eval_jaxpr(closed.jaxpr, closed.consts, args, ctx, prefix, hints=hints)
        if out_dtypes is None:
            return outs
        return [o if d is None else cast(o, d, ctx) for o, d in zip(outs, out_dtypes, strict=True)]

    return _jax_internals.trace_to_closed_jaxpr(fun, in_avals, "fmp.autocast")


def restore(eqn: JaxprEqn, invals: Sequence[Any], ctx: Context, scope: str = "") -> list[Any]:
    """Casts every castable float input back to the dtype the original program gave it."""
    out = []
    for v, x in zip(eqn.invars, invals, strict=True):
        want = v.aval.dtype if hasattr(v.aval, "dtype") else None
        out.append(cast(x, want, ctx, eqn, scope) if want is not None and _is_castable(want) else x)
    return out


def source_of(eqn: JaxprEqn, ctx: Context) -> str:
    """The user's source line of ``eqn`` (inside an inline helper: of the helper's call)."""
    return _rows.source(eqn, ctx.tracebacks[-1] if ctx.tracebacks else None)


def record_eqn(eqn: JaxprEqn, ctx: Context, scope: str, category: str, invals: Sequence[Any], outs: Sequence[Any]):
    """Adds an explain row for ``eqn`` (when recording)."""
    if ctx.records is None:
        return
    ctx.record(
        op=eqn.primitive.name,
        source=source_of(eqn, ctx),
        scope=scope,
        category=category,
        in_before=_float_names([v.aval for v in eqn.invars]),
        in_after=_float_names([aval_of(x) for x in invals]),
        out_before=_float_names([v.aval for v in eqn.outvars]),
        out_after=_float_names([aval_of(x) for x in outs]),
        flops=_rows.flops(eqn),
    )


def rewrite_eqn(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    """Rewrites and binds one equation; returns its outputs."""
    prim = eqn.primitive
    mode, policy = ctx.resolve(scope)
    if (mode == "nested" and not is_inline_call(eqn)) or prim.name in OPAQUE or prim.name in EXACT_DTYPE:
        invals = restore(eqn, invals, ctx, scope)
        outs = bind(eqn, invals, eqn.params)
        record_eqn(eqn, ctx, scope, "nested" if mode == "nested" else "opaque", invals, outs)
        return outs
    if mode == "override":
        invals = restore(eqn, invals, ctx, scope)
    handler = ctx.handlers.get(prim)
    if handler is not None:
        sub = dataclasses.replace(ctx, policy=policy) if mode == "override" else ctx
        return handler(eqn, invals, sub, scope)
    if next(iter(jaxprs_in_params(eqn.params)), None) is not None:
        raise NotImplementedError(_MSG_UNHANDLED.format(name=prim.name))
    if ctx.leaf is None:
        raise TypeError("fmp.autocast: a Context needs its rules; build it with _transform.make_context")
    return ctx.leaf(eqn, invals, ctx, scope, policy)


Handler = Callable[[JaxprEqn, list[Any], Context, str], list[Any]]
Leaf = Callable[[JaxprEqn, list[Any], Context, str, Policy], list[Any]]
