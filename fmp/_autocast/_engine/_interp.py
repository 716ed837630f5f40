"""The interpreter core: evaluate a jaxpr equation by equation, rewriting each under a policy.

The rewrite is an interpreter that re-binds every equation with (possibly
cast) inputs. Run under a fresh trace it yields a new
``ClosedJaxpr`` (``transform_closed``); run in the
caller's trace (``fmp.autocast``) it emits the same equations there, so
``jit``, ``grad`` and ``vmap`` compose. Decisions read the *current* input
dtypes (those the rewritten program produced so far), so a value that is
already in the compute dtype is not cast again.

The interpreter knows no rule (it stands on ``_context`` and ``_cast`` only). What to do
with an equation comes from the ``Context``: ``ctx.handlers`` (one per
higher-order primitive, ``_hops``) and ``ctx.leaf`` (every other equation,
``_leaf``); ``_transform.make_context`` is the one place that fills them in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, jaxprs_in_params

from fmp._autocast._engine import _jax_internals
from fmp._autocast._engine._cast import cast, restore
from fmp._autocast._engine._context import (
    REGION_SCOPE,
    Context,
    NoKey,
    aval_of,
    overridden,
    passes_key,
    record_eqn,
    source_of,
)
from fmp._autocast._engine._frames import Chain, body_frame, frame_of, is_inline_call, release
from fmp._autocast._engine._lru import LRU
from fmp._autocast._engine._weights import (
    body_weights,
    frame_weights,
)

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


def _join(prefix: str, own: str) -> str:
    return f"{prefix}/{own}" if prefix and own else (prefix or own)


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
    hints: Sequence[tuple[int, tuple[str, str]]] = (),
) -> list[Any]:
    """Evaluates ``jaxpr`` on ``args``, rewriting each equation; returns the outputs.

    ``call``: ``jaxpr`` is the body of this equation of the jaxpr being
    evaluated, inlined into the same trace: it shares that jaxpr's cast cache,
    and the epilogue rule sees through its inputs to the caller's program.
    ``hints``: ``(equation index, epilogue sides)`` for a helper body rewritten
    on its own (``_frames.Frame.hints``).
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
    if inlined and call:
        # the body's frame of the walks (``_provenance.into``), so what they measured in it is reused; a body
        # with constants gets a frame of its own, which knows their values
        shared = not jaxpr.constvars and getattr(call.params.get("jaxpr"), "jaxpr", None) is jaxpr
        frame = body_frame(call, ctx.frames[-1]) if shared else frame_of(jaxpr, ctx.frames[-1], call.invars)
        owned = not shared  # a shared frame is kept by its parent, released with it
    else:
        owned = True
        frame = frame_of(jaxpr, weights=frame_weights(jaxpr, ctx.weights_in.get(id(jaxpr))))
    if hints:
        frame = dataclasses.replace(frame, hints={id(jaxpr.eqns[i]): sides for i, sides in hints})
    if jaxpr.constvars:
        frame = dataclasses.replace(frame, consts=Chain(dict(zip(jaxpr.constvars, consts, strict=True)), frame.consts))
    ctx.frames.append(frame)
    last = frame.last
    compare = ctx.compare  # explain(compare=True): each equation also runs as written, beside this run
    if compare is not None:
        compare.enter(jaxpr, consts)
    try:
        outer = source_info_util.current_name_stack()  # each equation's context below restores it
        own = scope = name_stack = None  # equations traced in one scope share its name stack: joined once
        for eqn in jaxpr.eqns:
            invals = [v.val if isinstance(v, Literal) else env[v] for v in eqn.invars]
            if eqn.source_info.name_stack is not own:
                own = eqn.source_info.name_stack
                scope, name_stack = _join(prefix, str(own)), outer + own
            tb = ctx.tracebacks[-1] if ctx.tracebacks else eqn.source_info.traceback
            with source_info_util.user_context(tb, name_stack=name_stack), eqn.ctx.manager:
                outs = rewrite_eqn(eqn, invals, ctx, scope) if compare is None else compare.step(eqn, invals, scope)
            for v, x in zip(eqn.outvars, outs, strict=True):
                env[v] = x
            for v in last.get(id(eqn), ()):  # a value is dropped after its last read, as Python drops a local
                del env[v]
        if compare is not None:
            compare.leave(jaxpr)
        return [read(v) for v in jaxpr.outvars]
    finally:
        ctx.memos.pop()
        ctx.frames.pop()
        if owned:
            release(frame)


def transform_closed(
    closed: ClosedJaxpr,
    in_avals: Sequence[Any],
    ctx: Context,
    prefix: str,
    out_dtypes: Sequence[Any] | None = None,
    hints: tuple[tuple[int, tuple[str, str]], ...] = (),
    rows: Rows | None = None,
    keyed: bool = False,
) -> ClosedJaxpr:
    """Rewrites ``closed`` for inputs of ``in_avals``; ``out_dtypes`` pins output dtypes (None: free).
    ``hints``: see ``eval_jaxpr``. ``rows``: the body gets one more input, the amax-history rows of its
    delayed-scaling float8 sites (``Rows``). ``keyed``: under a caller's stochastic-rounding key the body gets
    one more (last) input, its own key (``extra_inputs``), from which its block-scaled sites fold in their
    numbers; a body rewritten without one under a key raises at such a site (``NoKey``).

    Results are memoised on the jaxpr object and the configuration, for
    jaxprs without constants (so no cached entry keeps arrays or tracers
    alive), not while recording for explain, handing out float8 history rows or under a caller's key (a
    body's key is its input, but a stored body would outlive it): JAX reuses jaxpr objects for
    repeated calls (two ``softmax`` calls share one), and handing JAX back the
    same rewritten object lets it reuse its own caches.
    """
    key = None
    if ctx.records is None and not closed.consts and ctx.fp8_sites is None and rows is None and ctx.key is None:
        dts = None if out_dtypes is None else tuple(out_dtypes)
        marks = ctx.weights_in.get(id(closed.jaxpr))
        key = (closed, tuple(in_avals), ctx.policy, ctx.rules, ctx.overrides, prefix, dts, hints, marks)
        hit = _CACHE.get(key)
        if hit is not None:
            return hit
    if key is not None and _unchanged(closed, in_avals, ctx, prefix, out_dtypes):
        result = closed  # the rewrite would bind every equation as written: no trace (and JAX's caches hold)
    else:
        result = transform_closed_uncached(closed, in_avals, ctx, prefix, out_dtypes, hints, rows, keyed)
    if key is not None:
        _CACHE.put(key, result)
    return result


_CACHE = LRU(1024)


def _unchanged(
    closed: ClosedJaxpr, in_avals: Sequence[Any], ctx: Context, prefix: str, out_dtypes: Sequence[Any] | None
) -> bool:
    """Whether rewriting ``closed`` for ``in_avals`` gives it back as written: its own input types, every
    equation a first-order one that the leaf rules keep (``ctx.keeps``), its output types as pinned; no
    override, nested region or float8 recipe (their rules read more than the types)."""
    if ctx.keeps is None or ctx.overrides or ctx.policy.float8 is not None or REGION_SCOPE in prefix:
        return False
    if list(in_avals) != list(closed.in_avals):
        return False
    if out_dtypes is not None and any(
        d is not None and a.dtype != d for a, d in zip(closed.out_avals, out_dtypes, strict=True)
    ):
        return False
    for eqn in closed.jaxpr.eqns:
        if eqn.primitive in ctx.handlers or next(iter(jaxprs_in_params(eqn.params)), None) is not None:
            return False
        if REGION_SCOPE in str(eqn.source_info.name_stack):
            return False
        if eqn.primitive.name not in OPAQUE and eqn.primitive.name not in EXACT_DTYPE:
            if not ctx.keeps(eqn, ctx, ctx.policy):
                return False
    return True


def transform_closed_uncached(
    closed: ClosedJaxpr,
    in_avals: Sequence[Any],
    ctx: Context,
    prefix: str,
    out_dtypes: Sequence[Any] | None,
    hints: tuple[tuple[int, tuple[str, str]], ...] = (),
    rows: Rows | None = None,
    keyed: bool = False,
) -> ClosedJaxpr:
    keyed = keyed and passes_key(ctx)

    def fun(*args: Any) -> list[Any]:
        sub = ctx
        if rows is not None:
            args = list(args)
            sub = dataclasses.replace(ctx, fp8_sites=rows.feeder(args.pop(rows.position)))
        if keyed:
            *args, key = args
            sub = dataclasses.replace(sub, key=key, key_sites=[0])
        elif ctx.key is not None:
            sub = dataclasses.replace(sub, key=NoKey())
        outs = eval_jaxpr(closed.jaxpr, closed.consts, args, sub, prefix, hints=hints)
        if out_dtypes is None:
            return outs
        return [o if d is None else cast(o, d, ctx) for o, d in zip(outs, out_dtypes, strict=True)]

    if rows is not None:
        in_avals = [*in_avals[: rows.position], rows.aval, *in_avals[rows.position :]]
    if keyed:
        in_avals = [*in_avals, aval_of(ctx.key)]
    return _jax_internals.trace_to_closed_jaxpr(fun, in_avals, "fmp.autocast")


@dataclasses.dataclass(frozen=True)
class Rows:
    """A body input holding the amax-history rows of its float8 sites: where it goes, its aval, its feeder."""

    position: int
    aval: Any
    feeder: Callable[[Any], Any]


def extra_inputs(ctx: Context, block: Any, length: int | None = None) -> list[Any]:
    """The inputs a body rewritten with ``rows`` and ``keyed`` takes after its own: its history ``block``
    (if any), then (under a caller's key) a key of its own, folded from the caller's; for a scan body,
    ``length`` keys scanned over, one per iteration (per layer)."""
    extra = [] if block is None else [block]
    if passes_key(ctx):
        key = ctx.site_key()
        extra.append(key if length is None else jax.random.split(key, length))
    return extra


def rewrite_eqn(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    """Rewrites and binds one equation; returns its outputs."""
    prim = eqn.primitive
    mode, policy = ctx.resolve(scope, lambda: source_of(eqn, ctx))
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
        if scoped_float8(ctx):
            sub = dataclasses.replace(sub, weights_in=body_weights(eqn, ctx.frames[-1]))
        return handler(eqn, invals, sub, scope)
    if next(iter(jaxprs_in_params(eqn.params)), None) is not None:
        raise NotImplementedError(_MSG_UNHANDLED.format(name=prim.name))
    if ctx.leaf is None:
        raise TypeError("fmp.autocast: a Context needs its rules; build it with _transform.make_context")
    mark = len(ctx.records) if ctx.records is not None else 0
    outs = ctx.leaf(eqn, invals, ctx, scope, policy)
    if mode == "override":
        overridden(ctx, mark, policy)
    return outs


def scoped_float8(ctx: Context) -> bool:
    """Whether float8 decisions look for weight operands (a recipe here or in an override, not opted into
    activation products, or any recipe in a custom_jvp rule, whose tangents stay out of float8); the bodies
    of a higher-order equation then learn which of their inputs are weights or tangents."""
    recipes = [p.float8 for p in (ctx.policy, *(pol for _, pol in ctx.overrides)) if p.float8 is not None]
    if not ctx.frames or not recipes:
        return False
    return any(not r.activations for r in recipes) or bool(ctx.frames[-1].tangents)
