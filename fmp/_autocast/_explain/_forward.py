"""``fmp.explain(..., compare=True)``: the policy run and the program as written, side by side, op by op.

The interpreter (``_interp.eval_jaxpr``) hands every equation to ``Comparison.step`` when a context
carries one: the step runs the equation under the policy as usual, runs the original equation on the
reference values (the program as written, on the same inputs), and writes the error statistics of
the equation's outputs into its explain row. The reference values live beside the interpreter's own,
one environment per jaxpr being evaluated, so nested bodies (``jit``, ``checkpoint``, custom
derivative calls, inline helpers, ``scan`` iterations: ``_loops``) are compared equation by
equation; ``while`` and ``cond`` too. Bodies not evaluated here yet (``shard_map``, linear solves) are refused
with a clear error.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal
from jax.extend.core import primitives as core_prims

from fmp._autocast._engine import _jax_internals
from fmp._autocast._engine._cast import cast
from fmp._autocast._engine._context import Context, Handler, calling
from fmp._autocast._engine._interp import bind, eval_jaxpr, rewrite_eqn
from fmp._autocast._engine._lru import LRU
from fmp._autocast._engine._provenance import is_inline_call
from fmp._autocast._explain import _loops
from fmp._autocast._explain._stats import HOLD, JAX_OPS, Deferred, resolve
from fmp._autocast._hops import _calls
from fmp._autocast._hops._helpers import helper_call
from fmp._autocast._transform import run_top
from fmp._report._blame import charged, fill
from fmp._report._compare import EXACT_OPS, as_arrived
from fmp._report._records import LOW

_MSG_BODY = (
    "fmp.explain(compare=True) does not yet compare inside {name!r} bodies (shard_map and linear solves are "
    "rewritten as traced bodies, which hold no values to compare). Call fmp.explain without compare=True "
    "for the dtypes, or compare the function the body runs."
)


class Comparison:
    """The reference run beside one explain rewrite: one environment of reference values per jaxpr."""

    def __init__(self, ctx: Context, args: Sequence[Any], rewrite_handlers: Any = None) -> None:
        self.ctx = ctx
        self.rewrite_handlers = rewrite_handlers  # the rewrite's own handlers (a loop body's dtypes are found by them)
        self.envs: list[dict[Any, Any]] = []
        self.last: list[dict[int, list[Any]]] = []  # per jaxpr: id(equation) -> variables it reads last
        self.rows: dict[Any, int] = {}  # variable -> index of the explain row of the equation that made it
        # index of a compared row -> the rows that made its inputs (the graph the blame walks upstream)
        self.makers: dict[int, list[int]] = {}
        self.pending: list[Any] | None = list(args)  # reference inputs of the next jaxpr entered
        self.pending_rows: list[int | None] = []  # and the rows that made them
        self.returned: list[Any] | None = None  # reference outputs of the last jaxpr left
        self.returned_rows: list[int | None] = []  # and the rows that made them
        # rows whose statistics are still on their way: (row, output stats, added-error stats, whether the
        # op's rule rounded its inputs down itself)
        self.jobs: list[tuple[int, Deferred, Deferred, bool]] = []
        self.held = 0  # bytes their statistics hold until they are resolved

    def enter(self, jaxpr: Jaxpr, consts: Sequence[Any]) -> None:
        if self.pending is None:
            raise RuntimeError("fmp.explain(compare=True): a body was entered without reference inputs")
        env = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, self.pending, strict=True))
        made = dict(zip(jaxpr.invars, self.pending_rows, strict=False))
        for v in jaxpr.invars:
            if made.get(v) is None:
                self.rows.pop(v, None)  # a body runs again (a loop): a row of its last run is no maker now
            else:
                self.rows[v] = made[v]
        self.pending, self.pending_rows = None, []
        self.envs.append(env)
        self.last.append(_LAST_USES.of(jaxpr, id(jaxpr), lambda: _last_uses(jaxpr)))

    def leave(self, jaxpr: Jaxpr) -> None:
        env = self.envs.pop()
        self.last.pop()
        self.returned = [v.val if isinstance(v, Literal) else env[v] for v in jaxpr.outvars]
        self.returned_rows = [self.rows.get(v) for v in jaxpr.outvars]

    def step(self, eqn: JaxprEqn, invals: list[Any], scope: str) -> list[Any]:
        """Runs ``eqn`` under the policy and as written; returns the policy outputs."""
        env = self.envs[-1]
        ref_in = [v.val if isinstance(v, Literal) else env[v] for v in eqn.invars]
        ctx = self.ctx
        records = ctx.records if ctx.records is not None else []
        mark = len(records)
        self.pending, self.returned = ref_in, None
        self.pending_rows = [None if isinstance(v, Literal) else self.rows.get(v) for v in eqn.invars]
        outs = rewrite_eqn(eqn, invals, ctx, scope)
        nested = eqn.primitive in ctx.handlers and self.returned is not None
        ref_out = self.returned if nested else bind(eqn, ref_in, eqn.params)
        self.pending = self.returned = None
        env.update(zip(eqn.outvars, ref_out, strict=True))
        for v in self.last[-1].get(id(eqn), ()):
            env.pop(v, None)  # a reference value no later equation reads (streaming: its memory is freed)
        for v in eqn.outvars:
            self.rows.pop(v, None)  # set again below where a row made it
        if nested:
            self.rows.update((v, i) for v, i in zip(eqn.outvars, self.returned_rows, strict=True) if i is not None)
        rows = [i for i in range(mark, len(records)) if records[i].category != "cast"]
        if len(rows) == 1 and records[rows[0]].op == eqn.primitive.name and not nested:
            self.makers[rows[0]] = [self.rows[v] for v in eqn.invars if not isinstance(v, Literal) and v in self.rows]
            casts = [r for r in records[mark:] if r.category == "cast"]
            down = any(set(r.out_after) & set(LOW) for r in casts)
            if not casts and (_moves_values(eqn, records[rows[0]]) or _as_written(records[rows[0]])):
                added = Deferred.exact(outs)  # on the reference inputs the op computes the reference output
            else:
                alone, baseline = self._alone(eqn, invals, ref_in, scope)
                added = Deferred(alone, baseline or ref_out)
            self.jobs.append((rows[0], Deferred(outs, ref_out), added, down))
            self.held += self.jobs[-1][1].held + added.held
            if self.held > HOLD:
                self.flush()
            self.rows.update((v, rows[0]) for v in eqn.outvars)
        return outs

    def _alone(self, eqn: JaxprEqn, invals: list[Any], ref_in: list[Any], scope: str) -> tuple[list[Any], Any]:
        """What ``eqn`` adds by itself: its policy run on the reference inputs, and the baseline to compare with.

        Both take the reference inputs rounded as they reached the op in the policy run; the policy run then
        applies the op's rule (its casts included), the baseline is the op as written (``None``: no input
        was rounded, the reference output itself). So a rounding done where a value was made (a bfloat16
        output) counts at the op that made it, and a cast the op's rule inserts counts at the op.
        """
        ctx = self.ctx
        arrived, back = as_arrived(JAX_OPS, ref_in, invals)
        saved, ctx.records = ctx.records, None  # no rows for this second run
        try:
            alone = rewrite_eqn(eqn, arrived, ctx, scope)
        finally:
            ctx.records = saved
        return alone, None if back is None else bind(eqn, back, eqn.params)

    def flush(self) -> None:
        """Writes the statistics started so far into their rows (one transfer from the device for all)."""
        jobs, self.jobs, self.held = self.jobs, [], 0
        resolve([d for _, out, alone, _ in jobs for d in (out, alone)])
        records = self.ctx.records if self.ctx.records is not None else []
        for i, out, alone, down in jobs:  # in program order: the rows upstream of one are filled before it

            def upstream(i: int = i, through: bool = False) -> list[Any] | None:
                return charged(self.makers.get(i, ()), lambda n: self.makers.get(n, ()), records.__getitem__, through)

            made = [records[k] for k in self.makers.get(i, ())]
            up = None if down else upstream
            records[i] = fill(records[i], out.result(), alone.result()[0], self.ctx.rules, up, inputs=made)


_LAST_USES = LRU(1024)  # jaxpr -> its ``_last_uses`` (a body evaluated again, in a loop or a repeated call)


def _last_uses(jaxpr: Jaxpr) -> dict[int, list[Any]]:
    """``id(equation) -> the variables it is the last to read`` (the jaxpr's outputs are read at its end)."""
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
    return out


def _moves_values(eqn: JaxprEqn, row: Any) -> bool:
    """``eqn`` only moves, selects or compares its inputs' values (``EXACT_OPS``) and rounds none of them: on
    the reference inputs it computes the reference output (it adds no error)."""
    return eqn.primitive.name in EXACT_OPS and set(row.out_after) <= set(row.in_after)


def _as_written(row: Any) -> bool:
    """The op ran in the dtypes the program wrote (inputs and outputs), so on the reference inputs it is
    the program as written."""
    return row.category != "float8" and row.in_after == row.in_before and row.out_after == row.out_before


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


def run(closed: ClosedJaxpr, args: Sequence[Any], ctx: Context) -> None:
    """Runs ``closed`` under ``ctx`` and as written, side by side; the errors land in ``ctx.records``."""
    if any(isinstance(x, jax.core.Tracer) for x in args):
        raise TypeError(
            "fmp.explain(compare=True) runs the program to compare values; it got traced arguments. "
            "Call it outside jit/grad/vmap, on concrete arrays."
        )
    rewrite_handlers = ctx.handlers
    ctx.handlers = compare_handlers(dict(ctx.handlers))
    ctx.compare = Comparison(ctx, args, rewrite_handlers)
    run_top(closed, args, ctx)
    ctx.compare.flush()
