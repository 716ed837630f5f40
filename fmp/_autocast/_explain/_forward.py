"""``fmp.explain(..., compare=True)``: the policy run and the program as written, side by side, op by op.

The interpreter (``_interp.eval_jaxpr``) hands every equation to ``Comparison.step`` when a context
carries one: the step runs the equation under the policy as usual, runs the original equation on the
reference values (the program as written, on the same inputs), and writes the error statistics of
the equation's outputs into its explain row. The reference values live beside the interpreter's own,
one environment per jaxpr being evaluated, so nested bodies (``jit``, ``checkpoint``, custom
derivative calls, inline helpers: ``_bodies``; ``scan``, ``while`` and ``cond``: ``_loops``) are compared
equation by equation. Traced instead of run (``_compiled``), the whole comparison becomes one program.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal

from fmp._autocast._engine._context import Context, is_scalar_constant
from fmp._autocast._engine._frames import last_reads
from fmp._autocast._engine._interp import bind, rewrite_eqn
from fmp._autocast._explain import _bodies, _outputs
from fmp._autocast._explain._stats import HOLD, JAX_OPS, Deferred, resolve
from fmp._autocast._transform import run_top
from fmp._core._dtypes import LOW_PRECISION
from fmp._report._blame import Job, fill_rows
from fmp._report._compare import EXACT_OPS, as_arrived


class Comparison:
    """The reference run beside one explain rewrite: one environment of reference values per jaxpr."""

    def __init__(self, ctx: Context, args: Sequence[Any], rewrite_handlers: Any = None, traced: bool = False) -> None:
        self.ctx = ctx
        self.traced = traced  # the run is being traced into one program (``_compiled``): statistics stay pending
        self.rewrite_handlers = rewrite_handlers  # the rewrite's own handlers (a loop body's dtypes are found by them)
        self.envs: list[dict[Any, Any]] = []
        self.last: list[Mapping[int, tuple[Any, ...]]] = []  # per jaxpr: id(equation) -> variables it reads last
        self.rows: dict[Any, int] = {}  # variable -> index of the explain row of the equation that made it
        self.out_stats: dict[Any, Deferred] = {}  # variable -> the statistics of the compared row that made it
        # index of a compared row -> the rows that made its inputs (the graph the blame walks upstream)
        self.makers: dict[int, list[int]] = {}
        self.pending: list[Any] | None = list(args)  # reference inputs of the next jaxpr entered
        self.pending_rows: list[int | None] = []  # and the rows that made them
        self.returned: list[Any] | None = None  # reference outputs of the last jaxpr left
        self.returned_rows: list[int | None] = []  # and the rows that made them
        self.jobs: list[Job[Deferred]] = []  # rows whose statistics are still on their way
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
        self.last.append(last_reads(jaxpr))

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
        rows = [i for i in range(mark, len(records)) if records[i].category != "cast"]
        compared = len(rows) == 1 and records[rows[0]].op == eqn.primitive.name and not nested
        if compared:
            row = records[rows[0]]
            casts = [r for r in records[mark:] if r.category == "cast"]
            down = any(set(r.out_after) & LOW_PRECISION for r in casts)
            exact = not casts and (_moves_values(eqn, row) or _as_written(row))
            # the policy run's inputs are the reference's own values (the program's arguments, values made
            # as written from them): on them the op alone is the policy run itself
            same = all(x is r for x, r, v in zip(invals, ref_in, eqn.invars, strict=True) if not isinstance(v, Literal))
            moved = self._moved(eqn) if exact else None
            if moved is not None:  # the same values, rearranged: the same statistics
                ref_out, out, added = bind(eqn, ref_in, eqn.params), moved, Deferred.exact(outs)
            else:
                ref_out, out, added = self._compared(eqn, invals, outs, ref_in, row, scope, exact, same)
            if len(eqn.outvars) == 1:
                self.out_stats[eqn.outvars[0]] = out
        else:
            ref_out = self.returned if nested else bind(eqn, ref_in, eqn.params)
        self.pending = self.returned = None
        env.update(zip(eqn.outvars, ref_out, strict=True))
        for v in self.last[-1].get(id(eqn), ()):
            env.pop(v, None)  # a reference value no later equation reads (streaming: its memory is freed)
        for v in eqn.outvars:
            self.rows.pop(v, None)  # set again below where a row made it
        if nested:
            self.rows.update((v, i) for v, i in zip(eqn.outvars, self.returned_rows, strict=True) if i is not None)
        if compared:
            self.makers[rows[0]] = [self.rows[v] for v in eqn.invars if not isinstance(v, Literal) and v in self.rows]
            self.jobs.append(Job(rows[0], out, added, down))
            self.held += out.held + (added.held if added is not out else 0)
            if self.held > HOLD and not self.traced:
                self.flush()
            self.rows.update((v, rows[0]) for v in eqn.outvars)
        return outs

    def _moved(self, eqn: JaxprEqn) -> Deferred | None:
        """For an op that only rearranges or repeats (uniformly) the elements of one compared value, that
        value's statistics: its relative error, largest error and largest value are those of its input."""
        if eqn.primitive.name not in _REARRANGES or len(eqn.outvars) != 1:
            return None
        src = [v for v in eqn.invars if not isinstance(v, Literal)]
        return self.out_stats.get(src[0]) if len(src) == 1 else None

    def _compared(
        self,
        eqn: JaxprEqn,
        invals: list[Any],
        outs: list[Any],
        ref_in: list[Any],
        row: Any,
        scope: str,
        exact: bool,
        same: bool,
    ) -> tuple[list[Any], Deferred, Deferred]:
        """The reference outputs of a compared equation, the statistics of its outputs against them and those
        of the error it adds by itself (``exact``: none; ``same`` inputs: its output's)."""
        if exact and same:  # the op as written on the reference's own values: the reference output itself
            return outs, Deferred(outs, outs), Deferred.exact(outs)
        ref_out = bind(eqn, ref_in, eqn.params)
        out = Deferred(outs, ref_out)
        if exact or same:
            return ref_out, out, Deferred.exact(outs) if exact else out
        alone, baseline = self._alone(eqn, invals, ref_in, scope)
        return ref_out, out, Deferred(alone, baseline or ref_out, error_only=True)

    def _alone(self, eqn: JaxprEqn, invals: list[Any], ref_in: list[Any], scope: str) -> tuple[list[Any], Any]:
        """What ``eqn`` adds by itself: its policy run on the reference inputs, and the baseline to compare with.

        Both take the reference inputs rounded as they reached the op in the policy run; the policy run then
        applies the op's rule (its casts included), the baseline is the op as written (``None``: no input
        was rounded, the reference output itself). So a rounding done where a value was made (a bfloat16
        output) counts at the op that made it, and a cast the op's rule inserts counts at the op.
        """
        ctx = self.ctx
        arrived, back = as_arrived(JAX_OPS, ref_in, invals)
        arrived = _constants_kept(arrived, invals)
        saved, ctx.records = ctx.records, None  # no rows for this second run
        try:
            alone = rewrite_eqn(eqn, arrived, ctx, scope)
        finally:
            ctx.records = saved
        return alone, None if back is None else bind(eqn, back, eqn.params)

    def flush(self) -> None:
        """Writes the statistics started so far into their rows (one transfer from the device for all)."""
        jobs, self.jobs, self.held = self.jobs, [], 0
        resolve([d for job in jobs for d in (job.out, job.alone)])
        records = self.ctx.records if self.ctx.records is not None else []
        done = [job._replace(out=job.out.result(), alone=job.alone.result()) for job in jobs]
        fill_rows(records, done, self.ctx.rules, self.makers)


# ops whose one output holds their one input's elements, each the same number of times
_REARRANGES = frozenset({"reshape", "transpose", "squeeze", "expand_dims", "broadcast_in_dim", "copy", "copy_p", "rev"})


def _constants_kept(arrived: Sequence[Any], invals: Sequence[Any]) -> list[Any]:
    """``arrived`` with each scalar constant the policy run saw in its place: the rule treats such a value as a
    literal of the source (it follows the other inputs' dtype), so the op run alone must see it as one too."""
    return [x if is_scalar_constant(x) else a for a, x in zip(arrived, invals, strict=True)]


def _moves_values(eqn: JaxprEqn, row: Any) -> bool:
    """``eqn`` only moves, selects or compares its inputs' values (``EXACT_OPS``) and rounds none of them: on
    the reference inputs it computes the reference output (it adds no error)."""
    return eqn.primitive.name in EXACT_OPS and set(row.out_after) <= set(row.in_after)


def _as_written(row: Any) -> bool:
    """The op ran in the dtypes the program wrote (inputs and outputs), so on the reference inputs it is
    the program as written."""
    return row.category != "float8" and row.in_after == row.in_before and row.out_after == row.out_before


def run(closed: ClosedJaxpr, args: Sequence[Any], ctx: Context) -> list[Any]:
    """Runs ``closed`` under ``ctx`` and as written, side by side; the errors land in ``ctx.records``. Returns
    the statistics of the outputs and of the baseline (``_outputs.started``)."""
    if any(isinstance(x, jax.core.Tracer) for x in args):
        raise TypeError(
            "fmp.explain(compare=True) runs the program to compare values; it got traced arguments. "
            "Call it outside jit/grad/vmap, on concrete arrays."
        )
    start(ctx, args)
    got = run_top(closed, args, ctx)
    refs = ctx.compare.returned or []
    ctx.compare.flush()
    ends = _outputs.started(got, refs, _outputs.baseline(closed, args, ctx.policy.compute_dtype))
    resolve(ends)
    return [d.result() for d in ends]


def start(ctx: Context, args: Sequence[Any], traced: bool = False) -> None:
    """Makes ``ctx`` compare: every body evaluated on values, a ``Comparison`` beside the run."""
    rewrite_handlers = ctx.handlers
    ctx.handlers = _bodies.compare_handlers(dict(ctx.handlers))
    ctx.compare = Comparison(ctx, args, rewrite_handlers, traced)
