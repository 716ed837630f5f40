"""``fmp.explain(..., compare=True, grads=True)``: the backward pass under the policy against the reference.

Each gradient leaf is ``jax.grad(fmp.autocast(loss, ...))`` (the way users train: under ``jit``, at the loss
scale) against ``jax.grad(loss)`` of the program as written (under ``jit`` too). The backward operations are compared one by one on the
jaxpr of the policy's gradient: it is evaluated twice, once as is (the values users get) and once *lifted*
(every float16/bfloat16 value, cast, literal and accumulation dtype widened to the reference dtype; the
roundings fmp inserts are no-ops). Both runs execute the same equations, so each backward equation has a
reference value to compare with, and for a program that writes no low-precision dtypes itself the lifted
run is the reference program's own backward pass. Each backward row then gets the forward rows' fields:
its error so far, and the error it adds by itself (the equation in the policy's dtypes on the lifted
run's inputs, rounded as they arrived). A backward equation runs in the dtypes its forward operation's
rule gave it (``jax.grad`` transposes the casts), so its fix is that forward operation's: the forward
rows of the same source line and scope that ran in low precision are the ones the suggestion names.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal
from jax.extend.core.primitives import closed_call_p, custom_jvp_call_p, custom_vjp_call_p, jit_p, remat_p

from fmp._autocast._engine import _jax_internals
from fmp._autocast._engine._cast import is_rounding
from fmp._autocast._engine._context import REGION_SCOPE, aval_of, float_names
from fmp._autocast._engine._interp import bind
from fmp._autocast._engine._lru import LRU
from fmp._autocast._engine._rows import source
from fmp._autocast._explain._cache import Traces, jitted, signature
from fmp._autocast._explain._stats import HOLD, JAX_OPS, Deferred, resolve
from fmp._core._rules import RuleSet
from fmp._report import _grads as gr
from fmp._report._blame import backward_suggestion
from fmp._report._compare import as_arrived, with_stats
from fmp._report._records import OpRecord, short_source

_LIFTED = frozenset({"float16", "bfloat16"})
# bodies evaluated equation by equation (a custom derivative's primal body: only its values are needed here)
_CALLS = {
    jit_p: "jaxpr",
    closed_call_p: "call_jaxpr",
    remat_p: "jaxpr",
    custom_jvp_call_p: "call_jaxpr",
    custom_vjp_call_p: "call_jaxpr",
}


def _is_low(dtype: Any) -> bool:
    try:
        return np.dtype(dtype).name in _LIFTED
    except TypeError:
        return False


class _GradJob(NamedTuple):
    """A backward row whose statistics are on their way."""

    row: OpRecord
    out: Deferred  # the statistics of its outputs against the lifted run's
    alone: Deferred  # the statistics of the op alone (its added error)
    low: list[Any] | None  # the lifted values of its float16 outputs, to measure (a float16 policy only)


class _Runs:
    """The policy's gradient jaxpr evaluated as is and lifted to ``wide``, with one row per backward op."""

    def __init__(self, wide: Any, forward: Sequence[OpRecord], rules: RuleSet, scale: float, fp16: bool) -> None:
        self.wide, self.forward, self.rules, self.scale, self.fp16 = np.dtype(wide), forward, rules, scale, fp16
        self.rows: list[OpRecord] = []
        self.range = (math.inf, 0.0)  # smallest nonzero and largest |value| of the float16 backward values
        # rows whose statistics are on their way, resolved together (``flush``): no transfer per operation
        self.jobs: list[_GradJob] = []
        self.held = 0  # bytes the jobs hold

    def lift(self, x: Any) -> Any:
        return jnp.asarray(x, self.wide) if _is_low(getattr(x, "dtype", None)) else x

    def eval(
        self,
        jaxpr: Jaxpr,
        consts: Sequence[Any],
        args: Sequence[Any],
        s_args: Sequence[Any],
        outer: tuple = (),
        where: str = "",
    ) -> tuple:
        """Evaluates ``jaxpr`` as is on ``args`` and lifted on ``s_args``; returns both outputs.

        ``outer``, ``where``: the name stack and source line of the equation whose body this is (a body's
        own stacks start empty; a library helper's equations have no user line: they get their call's).
        """
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
        s_env: dict[Any, Any] = {v: self.lift(c) for v, c in env.items()}
        env.update(zip(jaxpr.invars, args, strict=True))
        s_env.update(zip(jaxpr.invars, s_args, strict=True))
        last = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.invars if not isinstance(v, Literal)}
        keep = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
        for i, eqn in enumerate(jaxpr.eqns):
            ins = [v.val if isinstance(v, Literal) else env[v] for v in eqn.invars]
            s_ins = [self.lift(v.val) if isinstance(v, Literal) else s_env[v] for v in eqn.invars]
            stack = (*outer, *eqn.source_info.name_stack.stack)
            if is_rounding(eqn):  # fmp's float16 rounding mark: the identity when widened, as reduce_precision
                outs, s_outs = bind(eqn, ins, eqn.params), list(s_ins)
            elif eqn.primitive in _CALLS:
                body = eqn.params[_CALLS[eqn.primitive]]
                closed = _jax_internals.as_closed(body)
                outs, s_outs = self.eval(closed.jaxpr, closed.consts, ins, s_ins, stack, source(eqn) or where)
            else:
                outs, s_outs = bind(eqn, ins, eqn.params), self.lifted(eqn, s_ins)
                if _backward(stack):
                    self._row(eqn, scope_of(stack), source(eqn) or where, ins, s_ins, outs, s_outs)
            env.update(zip(eqn.outvars, outs, strict=True))
            s_env.update(zip(eqn.outvars, s_outs, strict=True))
            for v in eqn.invars:
                if not isinstance(v, Literal) and last.get(v) == i and v not in keep:
                    env.pop(v, None), s_env.pop(v, None)
        read = [(v.val, self.lift(v.val)) if isinstance(v, Literal) else (env[v], s_env[v]) for v in jaxpr.outvars]
        return [a for a, _ in read], [b for _, b in read]

    def lifted(self, eqn: JaxprEqn, s_ins: Sequence[Any]) -> list[Any]:
        """``eqn`` with every low-precision dtype widened (a ``reduce_precision`` is the identity)."""
        if eqn.primitive.name == "reduce_precision":
            return list(s_ins)
        params = {k: self._param(v) for k, v in eqn.params.items()}
        return bind(eqn, s_ins, params)

    def _as_lifted(self, eqn: JaxprEqn) -> bool:
        """``lifted`` binds ``eqn`` with its own parameters (nothing in them is widened)."""
        return eqn.primitive.name != "reduce_precision" and all(self._param(v) is v for v in eqn.params.values())

    def _param(self, v: Any) -> Any:
        if isinstance(v, np.dtype) and _is_low(v):
            return self.wide
        if isinstance(v, ClosedJaxpr):
            return self._lift_closed(v)
        if isinstance(v, Jaxpr):
            closed = self._lift_closed(ClosedJaxpr(v, ()))
            if closed.consts:
                raise NotImplementedError("fmp.explain(grads=True): a lifted body captured constants")
            return closed.jaxpr
        if isinstance(v, tuple) and any(isinstance(x, ClosedJaxpr) for x in v):
            new = [self._param(x) for x in v]
            return type(v)(*new) if hasattr(v, "_fields") else tuple(new)  # a named tuple keeps its type
        if callable(v) and not isinstance(v, type | np.dtype):
            raise NotImplementedError(
                "fmp.explain(grads=True) cannot widen a primitive that carries a Python function "
                f"({v!r}); call explain without grads=True for the forward comparison."
            )
        return v

    def _lift_closed(self, closed: ClosedJaxpr) -> ClosedJaxpr:
        # traced once per body and dtype: a repeated call binds the same lifted body (JAX's caches hold)
        return _LIFTED_BODIES.of(closed, (id(closed), self.wide.name), lambda: self._lift_closed_uncached(closed))

    def _lift_closed_uncached(self, closed: ClosedJaxpr) -> ClosedJaxpr:
        avals = [
            jax.ShapeDtypeStruct(a.shape, self.wide if _is_low(a.dtype) else a.dtype, weak_type=a.weak_type)
            for a in closed.in_avals
        ]
        quiet = _Runs(self.wide, (), self.rules, self.scale, False)
        consts = [quiet.lift(c) for c in closed.consts]

        def body(*xs: Any) -> list[Any]:
            return quiet.lifted_eval(closed.jaxpr, consts, xs)

        return jax.make_jaxpr(body)(*avals)

    def lifted_eval(self, jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        """The lifted run alone (a body traced for a loop or branch primitive)."""
        env: dict[Any, Any] = {v: self.lift(c) for v, c in zip(jaxpr.constvars, consts, strict=True)}
        env.update(zip(jaxpr.invars, args, strict=True))
        for eqn in jaxpr.eqns:
            ins = [self.lift(v.val) if isinstance(v, Literal) else env[v] for v in eqn.invars]
            if is_rounding(eqn):
                outs = list(ins)
            elif eqn.primitive in _CALLS:
                body = eqn.params[_CALLS[eqn.primitive]]
                closed = _jax_internals.as_closed(body)
                outs = self.lifted_eval(closed.jaxpr, closed.consts, ins)
            else:
                outs = self.lifted(eqn, ins)
            env.update(zip(eqn.outvars, outs, strict=True))
        return [self.lift(v.val) if isinstance(v, Literal) else env[v] for v in jaxpr.outvars]

    def _row(
        self, eqn: JaxprEqn, scope: str, full: str, ins: list[Any], s_ins: list[Any], outs: list, s_outs: list
    ) -> None:
        arrived, back = as_arrived(JAX_OPS, s_ins, ins)
        if back is None and self._as_lifted(eqn):
            added = Deferred.exact(s_outs)  # the op alone is the lifted op on the lifted run's inputs: s_outs
        else:
            added = Deferred(bind(eqn, arrived, eqn.params), s_outs if back is None else self.lifted(eqn, back))
        row = OpRecord(
            index=len(self.rows) + len(self.jobs),
            op=eqn.primitive.name,
            source=short_source(full),
            scope=scope,
            category="backward",
            in_before=float_names([aval_of(x) for x in s_ins]),
            in_after=float_names([aval_of(x) for x in ins]),
            out_before=float_names([aval_of(x) for x in s_outs]),
            out_after=float_names([aval_of(x) for x in outs]),
            source_full=full,
        )
        low = [s for o, s in zip(outs, s_outs, strict=True) if getattr(o, "dtype", None) == jnp.float16]
        out = Deferred(outs, s_outs)
        self.jobs.append(_GradJob(row, out, added, low if self.fp16 and low else None))
        self.held += out.held + added.held + sum(x.nbytes for x in low if self.fp16)
        if self.held > HOLD:
            self.flush()

    def flush(self) -> None:
        """Fills in the statistics of the rows made so far (one transfer from the device for all)."""
        jobs, self.jobs, self.held = self.jobs, [], 0
        resolve([d for job in jobs for d in (job.out, job.alone)])
        lifted = jax.device_get([job.low for job in jobs])
        for job, low in zip(jobs, lifted, strict=True):
            row = dataclasses.replace(job.row, underflow=self._underflow(low))
            row = with_stats(row, job.out.result(), job.alone.result().error)
            fix = backward_suggestion(row, self.forward, self.rules)
            self.rows.append(row if fix is None else dataclasses.replace(row, suggestion=fix))

    def _underflow(self, low: list[Any] | None) -> float | None:
        """Under float16: the fraction of the lifted values' nonzero elements below float16's normal range
        (``low``: the lifted values of the float16 outputs; ``None`` when there are none or no float16 policy)."""
        if low is None:
            return None
        held = [np.asarray(s, np.float64) for s in low]
        nonzero = lost = 0
        for r in held:
            got = gr.float16_range(r.ravel(), 1.0)  # the values already carry the scale
            n = int(np.count_nonzero(r[np.isfinite(r)]))
            nonzero, lost = nonzero + n, lost + (got.underflow + got.subnormal) * n
            self.range = (min(self.range[0], got.lo / self.scale), max(self.range[1], got.hi / self.scale))
        return lost / nonzero if nonzero else 0.0


_LIFTED_BODIES = LRU(256)  # (body, its lifted form) by (id, wide dtype name)


def _backward(stack: tuple) -> bool:
    """A name stack of a transposed equation of the autocast region (not of the loss scaling around it)."""
    transposed = any(type(e).__name__ == "Transform" and e.name == "transpose" for e in stack)
    return transposed and any(type(e).__name__ != "Transform" and e.name == REGION_SCOPE for e in stack)


def scope_of(stack: tuple) -> str:
    """The forward scope of a backward equation: its name stack without transforms and the autocast region."""
    names = [e.name for e in stack if type(e).__name__ != "Transform"]
    if REGION_SCOPE in names:
        names = names[names.index(REGION_SCOPE) + 1 :]
    return "/".join(names)


def compare(
    fn: Callable[..., Any],
    policy_fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    argnums: int | tuple[int, ...],
    scale: float,
    fp16: bool,
    forward: Sequence[OpRecord],
    rules: RuleSet,
    traces: Traces | None = None,
) -> gr.GradReport:
    """The gradient comparison (see the module docstring); ``traces``: what calls of the same ``explain``
    function share (the compiled gradients and the traced backward of each argument signature)."""
    traces = Traces() if traces is None else traces
    key = signature(args, kwargs)
    # under jax.jit: one compilation, not one per operation (and none again for a repeated call)
    ref = traces.get("reference", key, lambda: jitted(lambda *a: jax.grad(fn, argnums)(*a, **kwargs), args))(args)
    paths, _ = jax.tree_util.tree_flatten_with_path(ref)

    def scaled(*a: Any) -> Any:
        loss = policy_fn(*a, **kwargs)
        wide = jnp.promote_types(loss.dtype, jnp.float32)  # scaled in float32 at least, as fmp.value_and_grad does
        return loss.astype(wide) * jnp.asarray(scale, wide)

    closed = traces.get("backward", key, lambda: jax.make_jaxpr(jax.grad(scaled, argnums))(*args))
    flat = jax.tree_util.tree_leaves(args)
    floats = [np.dtype(x.dtype) for x in flat if jnp.issubdtype(getattr(x, "dtype", np.int32), jnp.floating)]
    wide = np.dtype(np.float64) if np.dtype(np.float64) in floats else np.dtype(np.float32)
    runs = _Runs(wide, forward, rules, scale, fp16)
    s_flat = [runs.lift(x) for x in flat]
    runs.eval(closed.jaxpr, closed.consts, flat, s_flat)
    runs.flush()
    grads = jax.tree_util.tree_leaves(traces.get("policy", key, lambda: jitted(jax.grad(scaled, argnums), args))(args))
    if len(grads) != len(paths):
        raise RuntimeError("fmp.explain(grads=True): the policy's gradient has another structure than the reference")
    errors, lo, hi = {}, runs.range[0], runs.range[1]
    for (path, r), g in zip(paths, grads, strict=True):
        r64 = np.asarray(r, np.float64)
        p64 = np.asarray(g, np.float64) / scale
        extra: dict[str, Any] = {}
        if fp16:
            got = gr.float16_range(r64.ravel(), scale)
            extra = {k: getattr(got, k) for k in ("underflow", "subnormal", "scale_needed", "scale_max")}
            lo, hi = min(lo, got.lo), max(hi, got.hi)
        errors[jax.tree_util.keystr(path)] = gr.grad_error(p64, r64, **extra)
    needed, most = gr.scales(lo, hi) if fp16 else (None, None)
    return gr.GradReport(errors, tuple(runs.rows), scale, fp16, needed, most)
