"""``fmp.explain(..., compare=True)``: the policy run and the program as written, side by side, op by op.

The interpreter (``_interp.eval_jaxpr``) hands every equation to ``Comparison.step`` when a context
carries one: the step runs the equation under the policy as usual, runs the original equation on the
reference values (the program as written, on the same inputs), and writes the error statistics of
the equation's outputs into its explain row. The reference values live beside the interpreter's own,
one environment per jaxpr being evaluated, so nested bodies (``jit``, ``checkpoint``, custom
derivative calls, inline helpers, ``scan`` iterations: ``_compare_loops``) are compared equation by
equation. Bodies not evaluated here yet (``while``, ``cond``, ``shard_map``, linear solves) are refused
with a clear error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal
from jax.extend.core.primitives import closed_call_p, custom_jvp_call_p, custom_vjp_call_p, jit_p, remat_p, scan_p

from fmp._autocast import _compare_loops, _hops_calls, _jax_internals
from fmp._autocast._cast import cast
from fmp._autocast._compare_stats import output_stats, suggestion
from fmp._autocast._context import Context, Handler, aval_of, float_names
from fmp._autocast._helpers import helper_call
from fmp._autocast._interp import bind, eval_jaxpr, rewrite_eqn
from fmp._autocast._provenance import is_inline_call
from fmp._autocast._transform import run_top
from fmp._core._report import LOW

_MSG_BODY = (
    "fmp.explain(compare=True) does not yet compare inside {name!r} bodies (while loops, cond, shard_map and "
    "linear solves are rewritten as traced bodies, which hold no values to compare). Call fmp.explain "
    "without compare=True for the dtypes, or compare a function that runs one step of the loop."
)


class Comparison:
    """The reference run beside one explain rewrite: one environment of reference values per jaxpr."""

    def __init__(self, ctx: Context, args: Sequence[Any], rewrite_handlers: Any = None) -> None:
        self.ctx = ctx
        self.rewrite_handlers = rewrite_handlers  # the rewrite's own handlers (a loop body's dtypes are found by them)
        self.envs: list[dict[Any, Any]] = []
        self.rows: dict[Any, int] = {}  # variable -> index of the explain row of the equation that made it
        self.pending: list[Any] | None = list(args)  # reference inputs of the next jaxpr entered
        self.returned: list[Any] | None = None  # reference outputs of the last jaxpr left
        self.returned_rows: list[int | None] = []  # and the rows that made them

    def enter(self, jaxpr: Jaxpr, consts: Sequence[Any]) -> None:
        if self.pending is None:
            raise RuntimeError("fmp.explain(compare=True): a body was entered without reference inputs")
        env = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, self.pending, strict=True))
        self.pending = None
        self.envs.append(env)

    def leave(self, jaxpr: Jaxpr) -> None:
        env = self.envs.pop()
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
        outs = rewrite_eqn(eqn, invals, ctx, scope)
        nested = eqn.primitive in ctx.handlers and self.returned is not None
        ref_out = self.returned if nested else bind(eqn, ref_in, eqn.params)
        self.pending = self.returned = None
        env.update(zip(eqn.outvars, ref_out, strict=True))
        if nested:
            self.rows.update((v, i) for v, i in zip(eqn.outvars, self.returned_rows, strict=True) if i is not None)
        rows = [i for i in range(mark, len(records)) if records[i].category != "cast"]
        if len(rows) == 1 and records[rows[0]].op == eqn.primitive.name and not nested:
            alone, baseline = self._alone(eqn, invals, ref_in, scope)
            made = [records[self.rows[v]] for v in eqn.invars if not isinstance(v, Literal) and v in self.rows]
            down = any(r.category == "cast" and set(r.out_after) & set(LOW) for r in records[mark:])
            self._attach(rows[0], outs, ref_out, (alone, baseline or ref_out), made if not down else [])
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
        arrived = [_round_as(r, x, back=False) for r, x in zip(ref_in, invals, strict=True)]
        saved, ctx.records = ctx.records, None  # no rows for this second run
        try:
            alone = rewrite_eqn(eqn, arrived, ctx, scope)
        finally:
            ctx.records = saved
        if all(a is r for a, r in zip(arrived, ref_in, strict=True)):
            return alone, None
        return alone, bind(eqn, [_round_as(r, x) for r, x in zip(ref_in, invals, strict=True)], eqn.params)

    def _attach(self, i: int, outs: list[Any], ref_out: list[Any], alone: tuple[Any, Any], made: list[Any]) -> None:
        """Writes the statistics into row ``i``; ``alone``: the op's own run and its baseline."""
        records = self.ctx.records if self.ctx.records is not None else []
        err, sqnr, max_abs, nonfinite, flips = output_stats(outs, ref_out)
        added, _, _, _, _ = output_stats(*alone)
        row = dataclasses.replace(
            records[i],
            error=err,
            added_error=added,
            sqnr_db=sqnr,
            max_abs_error=max_abs,
            nonfinite=nonfinite,
            flips=flips,
        )
        fix = suggestion(row, self.ctx.rules, made)
        records[i] = dataclasses.replace(row, suggestion=fix) if fix else row


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and bool(float_names([aval_of(x)]))


def _round_as(ref: Any, val: Any, back: bool = True) -> Any:
    """``ref`` rounded to the floating dtype of ``val`` (and ``back`` to its own); ``ref`` when they agree."""
    if not (_is_float(ref) and _is_float(val)) or aval_of(ref).dtype == aval_of(val).dtype:
        return ref
    rounded = jax.lax.convert_element_type(ref, aval_of(val).dtype)
    return jax.lax.convert_element_type(rounded, aval_of(ref).dtype) if back else rounded


def _evaluated(closed: ClosedJaxpr, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    return eval_jaxpr(closed.jaxpr, closed.consts, invals, ctx, scope)


def _jit(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    # what the rewrite does with a user's jit (its body rewritten for the current input dtypes), evaluated
    if is_inline_call(eqn):
        return helper_call(eqn, invals, ctx, scope)  # explain inlines helpers: evaluated in this trace
    return _evaluated(eqn.params["jaxpr"], invals, ctx, scope)


def _remat(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    return _evaluated(ClosedJaxpr(eqn.params["jaxpr"], ()), invals, ctx, scope)


def _closed_call(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    call = eqn.params["call_jaxpr"]
    return _evaluated(call if isinstance(call, ClosedJaxpr) else ClosedJaxpr(call, ()), invals, ctx, scope)


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
    prims = _jax_internals.primitives_by_name()
    evaluated: dict[Any, Callable[..., list[Any]]] = {
        jit_p: _jit,
        remat_p: _remat,
        closed_call_p: _closed_call,
        custom_jvp_call_p: _custom,
        custom_vjp_call_p: _custom,
        scan_p: _compare_loops.scan,
    }
    if "call" in prims:
        evaluated[prims["call"]] = _closed_call
    kept = {prims[n] for n in (*_hops_calls.REFUSED, *_hops_calls.AS_WRITTEN) if n in prims}
    out: dict[Any, Handler] = {}
    for prim, handler in handlers.items():
        if prim in evaluated:
            out[prim] = evaluated[prim]
        else:
            out[prim] = handler if prim in kept else _refused
    return out


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
