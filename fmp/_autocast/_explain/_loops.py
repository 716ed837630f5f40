"""``scan``, ``while`` and ``cond`` under ``explain(compare=True)``: loop bodies run iteration by iteration,
their rows aggregated; a ``cond`` compared in the branch the policy run takes.

The carry dtypes are those the rewrite gives the loop (``_hops.loop_body``'s fixed point, found
without recording); then every iteration evaluates the body on values, beside the reference, and
the rows of each equation are merged into one: the worst error over the iterations, with the
mean over them in ``error_mean`` / ``added_error_mean``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, JaxprEqn, jaxpr_as_fun

from fmp._autocast._engine import _jax_internals
from fmp._autocast._engine._cast import cast
from fmp._autocast._engine._context import Context, is_constant, like_avals
from fmp._autocast._engine._interp import eval_jaxpr, transform_closed
from fmp._autocast._explain._stats import output_stats
from fmp._autocast._hops._control import loop_body, pin_outputs
from fmp._autocast._hops._control import pin as _hops_pin
from fmp._core._dtypes import LOW_PRECISION
from fmp._report._blame import suggestion
from fmp._report._records import OpRecord


def scan(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    """The rewrite's scan, evaluated one iteration at a time (the reference beside it)."""
    cmp = ctx.compare
    p = eqn.params
    closed: ClosedJaxpr = p["jaxpr"]
    (nc, nk), n = _jax_internals.scan_counts(p), p["length"]
    consts, carry, xs = as_body_inputs(invals[:nc]), invals[nc : nc + nk], as_body_inputs(invals[nc + nk :])
    if not n:
        raise NotImplementedError("fmp.explain(compare=True): a scan of length 0 has nothing to compare")
    ref = cmp.pending
    r_consts, r_carry, r_xs = ref[:nc], ref[nc : nc + nk], ref[nc + nk :]
    before, after = like_avals(closed.in_avals[:nc], consts), like_avals(closed.in_avals[nc + nk :], xs)
    quiet = dataclasses.replace(ctx, records=None, compare=None, handlers=cmp.rewrite_handlers)
    _, carry_avals = loop_body(closed, before, list(closed.in_avals[nc : nc + nk]), after, carry, quiet, scope)
    carry = pin(carry, carry_avals, ctx)
    records = ctx.records if ctx.records is not None else []
    inputs_error = output_stats(invals, ref).error or 0.0
    made = list(cmp.pending_rows)  # the rows that made the scan's inputs
    writers: list[int | None] = made[nc : nc + nk]
    blocks: list[tuple[int, int]] = []
    ys: list[list[Any]] = []
    r_ys: list[list[Any]] = []
    for t in reversed(range(n)) if p["reverse"] else range(n):
        mark = len(records)
        cmp.pending = [*r_consts, *r_carry, *(x[t] for x in r_xs)]
        cmp.pending_rows = [*made[:nc], *writers, *made[nc + nk :]]  # the carry: made by the last iteration
        outs = eval_jaxpr(closed.jaxpr, closed.consts, [*consts, *carry, *(x[t] for x in xs)], ctx, scope)
        carry = pin(outs[:nk], carry_avals, ctx)
        r_carry = cmp.returned[:nk]
        writers = list(cmp.returned_rows[:nk])
        ys.append(outs[nk:])
        r_ys.append(cmp.returned[nk:])
        blocks.append((mark, len(records)))
    if p["reverse"]:
        ys.reverse()
        r_ys.reverse()
    _finish(ctx, blocks, writers, carry, r_carry, inputs_error)
    stacked = [jnp.stack(c) for c in zip(*ys, strict=True)]
    cmp.returned = [*r_carry, *(jnp.stack(c) for c in zip(*r_ys, strict=True))]
    cmp.returned_rows = [None] * (nk + len(stacked))
    return [*carry, *stacked]


def while_loop(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    """The rewrite's while loop, evaluated one iteration at a time beside the loop as written.

    Each run tests its own condition on its own carry, compared like any body (a predicate that flips
    counts in its comparison's row); the iterations both runs make are compared. Where one run stops
    first, the other finishes on its own and the rows say how many iterations each made.
    """
    cmp = ctx.compare
    p = eqn.params
    cond, body = p["cond_jaxpr"], p["body_jaxpr"]
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, carry = as_body_inputs(invals[:nc]), as_body_inputs(invals[nc : nc + nb]), invals[nc + nb :]
    ref = cmp.pending
    r_cconsts, r_bconsts, r_carry = ref[:nc], ref[nc : nc + nb], ref[nc + nb :]
    quiet = dataclasses.replace(ctx, records=None, compare=None, handlers=cmp.rewrite_handlers)
    before = like_avals(body.in_avals[:nb], bconsts)
    new_body, carry_avals = loop_body(body, before, list(body.in_avals[nb:]), [], carry, quiet, scope)
    carry = pin(carry, carry_avals, ctx)
    new_cond = transform_closed(cond, like_avals(cond.in_avals[:nc], cconsts) + carry_avals, quiet, scope)
    records = ctx.records if ctx.records is not None else []
    inputs_error = output_stats(invals, ref).error or 0.0
    made = list(cmp.pending_rows)  # the rows that made the loop's inputs
    tests: list[OpRecord] = []  # the condition's rows, every evaluation (they follow the body's rows)
    test_blocks: list[tuple[int, int]] = []

    def test() -> tuple[bool, bool]:
        cmp.flush()  # the statistics started so far belong to the rows in ``records``
        saved, ctx.records = ctx.records, []
        makers, cmp.makers = cmp.makers, {}  # indices of the rows kept apart
        try:
            cmp.pending, cmp.pending_rows = [*r_cconsts, *r_carry], []  # its rows are kept apart: no makers
            pred = eval_jaxpr(cond.jaxpr, cond.consts, [*cconsts, *carry], ctx, scope)[0]
            r_pred = cmp.returned[0]
            cmp.flush()
            got = ctx.records
        finally:
            ctx.records, cmp.makers = saved, makers
        test_blocks.append((len(tests), len(tests) + len(got)))
        tests.extend(got)
        return bool(pred), bool(r_pred)

    writers: list[int | None] = made[nc + nb :]
    blocks: list[tuple[int, int]] = []
    more, r_more = test()
    n = r_n = 0
    while more and r_more:
        mark = len(records)
        cmp.pending, cmp.pending_rows = [*r_bconsts, *r_carry], [*made[nc : nc + nb], *writers]
        carry = pin(eval_jaxpr(body.jaxpr, body.consts, [*bconsts, *carry], ctx, scope), carry_avals, ctx)
        r_carry, writers = cmp.returned, list(cmp.returned_rows)
        blocks.append((mark, len(records)))
        n = r_n = n + 1
        more, r_more = test()
    while more:  # the policy's loop goes on alone
        carry, n = pin(jaxpr_as_fun(new_body)(*bconsts, *carry), carry_avals, ctx), n + 1
        more = bool(jaxpr_as_fun(new_cond)(*cconsts, *carry)[0])
    while r_more:  # the loop as written goes on alone
        r_carry, r_n = jaxpr_as_fun(body)(*r_bconsts, *r_carry), r_n + 1
        r_more = bool(jaxpr_as_fun(cond)(*r_cconsts, *r_carry)[0])
    _finish(ctx, blocks, writers, carry, r_carry, inputs_error)
    start = blocks[0][0] if blocks else len(records)
    if not blocks:  # the body never ran in both: its rows are listed, not run (``iterations`` 0)
        listed = dataclasses.replace(ctx, compare=None, handlers=cmp.rewrite_handlers)
        transform_closed(body, before + carry_avals, listed, scope)
        records[start:] = [dataclasses.replace(r, iterations=0) for r in records[start:]]
    _merge(tests, test_blocks)
    records.extend(dataclasses.replace(r, index=len(records) + k) for k, r in enumerate(tests))
    if n != r_n:
        detail = f"the loop ran {n} iterations under the policy, {r_n} as written"
        for i in range(start, len(records)):
            records[i] = dataclasses.replace(records[i], detail=_join(records[i].detail, detail))
    cmp.returned, cmp.returned_rows = list(r_carry), [None] * len(carry)
    return carry


def cond(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    """The branch the policy run takes, compared on the reference inputs through the same branch; the rows
    of the other branches are listed, not run (``iterations`` 0).

    Where the program as written takes another branch (a predicate that flipped: its comparison's row
    counts the flips), the cond's reference outputs are that branch's, and the rows say so.
    """
    cmp = ctx.compare
    branches = eqn.params["branches"]
    invals = [invals[0], *as_body_inputs(invals[1:])]
    ref, made = cmp.pending, cmp.pending_rows[1:]
    last = len(branches) - 1
    i, r_i = (min(max(int(x), 0), last) for x in (invals[0], ref[0]))
    listed = dataclasses.replace(ctx, compare=None, handlers=cmp.rewrite_handlers)
    records = ctx.records if ctx.records is not None else []
    outs: list[Any] = []
    new: list[Any] = []  # each branch rewritten (None: the branch run here)
    for k, branch in enumerate(branches):
        mark = len(records)
        if k != i:
            new.append(transform_closed(branch, like_avals(branch.in_avals, invals[1:]), listed, scope))
            records[mark:] = [dataclasses.replace(r, iterations=0) for r in records[mark:]]
            continue
        cmp.pending, cmp.pending_rows = list(ref[1:]), made
        outs = eval_jaxpr(branch.jaxpr, branch.consts, list(invals[1:]), ctx, scope)
        new.append(None)
        returned, returned_rows = cmp.returned, cmp.returned_rows
        if r_i != i:
            detail = f"branch {i} under the policy, {r_i} as written"
            records[mark:] = [dataclasses.replace(r, detail=_join(r.detail, detail)) for r in records[mark:]]
            returned, returned_rows = list(jaxpr_as_fun(branches[r_i])(*ref[1:])), [None] * len(outs)
    cmp.returned, cmp.returned_rows = returned, returned_rows
    # where the branches disagree on an output's dtype, the rewrite pins it to the program's in every branch
    # (one cast row per branch that differs, after all branches): the same rows here, the others' not run
    got = [tuple(getattr(a, "dtype", None) for a in (b.out_avals if b else outs)) for b in new]
    pinned = [None if len({o[j] for o in got}) == 1 else v.aval.dtype for j, v in enumerate(eqn.outvars)]
    if not any(d is not None for d in pinned):
        return outs
    for b in new:
        mark = len(records)
        if b is None:
            outs = [x if d is None else cast(x, d, ctx) for x, d in zip(outs, pinned, strict=True)]
        else:
            pin_outputs(b, pinned, listed)
            records[mark:] = [dataclasses.replace(r, iterations=0) for r in records[mark:]]
    return outs


def _finish(
    ctx: Context,
    blocks: list[tuple[int, int]],
    writers: list[int | None],
    carry: list[Any],
    r_carry: list[Any],
    inputs_error: float,
) -> None:
    """A loop's rows: every iteration's statistics resolved, merged per equation, the carry writers charged."""
    ctx.compare.flush()  # the rows of every iteration hold their statistics before they are merged
    records = ctx.records if ctx.records is not None else []
    _merge(records, blocks)
    if blocks:
        last, first = blocks[-1][0], blocks[0][0]
        at = [None if i is None or i < last else first + i - last for i in writers]
        _charge_carry(records, at, carry, r_carry, inputs_error, ctx)


def _charge_carry(
    records: list[OpRecord],
    at: list[int | None],
    carry: list[Any],
    r_carry: list[Any],
    inputs_error: float,
    ctx: Context,
) -> None:
    """Charges each op that writes a carried value with the error that value ends the loop with, where the
    loop compounded it: more than twice the loop's inputs' error and more than the op's own per-iteration
    error (a sum carried in bfloat16 loses its addends once it is large, one rounding at a time). Only an
    op that rounds the carry to a low-precision dtype is charged: running it in float32 is the fix."""
    for i, c, r in zip(at, carry, r_carry, strict=True):
        err = output_stats([c], [r]).error
        if i is None or err is None or records[i].added_error is None:
            continue
        row = records[i]
        if not any(n in LOW_PRECISION for n in row.out_after):
            continue  # the op does not round the carry: its error is made upstream, where those rows show it
        if err > max(row.added_error, 2.0 * inputs_error):
            row = dataclasses.replace(row, added_error=err, detail=_join(row.detail, "compounded through the carry"))
            fix = suggestion(row, ctx.rules)
            if fix:  # the op itself rounds the carry: it is the culprit
                row = dataclasses.replace(row, suggestion=fix, culprits=(row.index,))
            records[i] = row


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b


def pin(vals: list[Any], avals: list[Any], ctx: Context) -> list[Any]:
    return _hops_pin(as_body_inputs(vals), avals, ctx)


def as_body_inputs(vals: list[Any]) -> list[Any]:
    """``vals`` as a body's inputs: a literal of the program passed in (a loop's initial ``0.0``) becomes an
    array, as the rewrite sees it (a traced input, not a source literal that follows the other operand's
    dtype)."""
    return [jnp.asarray(x) if is_constant(x) else x for x in vals]


def _merge(records: list[OpRecord], blocks: list[tuple[int, int]]) -> None:
    """Replaces the rows of every iteration with one row per equation: worst error, and means."""
    if not blocks:
        return
    first, end = blocks[0]
    size = end - first
    if any(b - a != size for a, b in blocks):
        raise RuntimeError("fmp.explain(compare=True): scan iterations recorded different rows")
    merged = []
    for k in range(size):
        rows = [records[a + k] for a, _ in blocks]
        merged.append(_worst(rows))
    del records[first:]
    for row in merged:
        records.append(dataclasses.replace(row, index=len(records)))


def _worst(rows: list[OpRecord]) -> OpRecord:
    """One row for an equation over every iteration: the worst iteration's, with the means added; the
    iterations are those that ran it (a ``cond`` branch not taken did not)."""
    ran = [r for r in rows if r.iterations]
    if not ran:
        return dataclasses.replace(rows[0], iterations=0)
    if ran[0].error is None and not any(r.flips for r in ran) and all(r.error is None for r in ran):
        return dataclasses.replace(ran[0], iterations=sum(r.iterations for r in ran))
    worst = max(ran, key=lambda r: (r.nonfinite, r.added_error or 0.0, r.error or 0.0, r.flips))
    return dataclasses.replace(
        worst,
        error=max((r.error for r in ran if r.error is not None), default=None),
        sqnr_db=min((r.sqnr_db for r in ran if r.sqnr_db is not None), default=None),
        max_abs_error=max((r.max_abs_error for r in ran if r.max_abs_error is not None), default=None),
        nonfinite=any(r.nonfinite for r in ran),
        flips=sum(r.flips for r in ran),
        error_mean=_mean([r.error for r in ran]),
        added_error_mean=_mean([r.added_error for r in ran]),
        iterations=sum(r.iterations for r in ran),
    )


def _mean(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return math.fsum(vals) / len(vals) if vals else None
