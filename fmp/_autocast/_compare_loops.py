"""``scan`` under ``explain(compare=True)``: the body run iteration by iteration, its rows aggregated.

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
from jax.extend.core import ClosedJaxpr, JaxprEqn

from fmp._autocast._cast import cast
from fmp._autocast._compare_stats import output_stats, suggestion
from fmp._autocast._context import Context, like_avals
from fmp._autocast._hops import _loop_body
from fmp._autocast._interp import eval_jaxpr
from fmp._core._report import OpRecord


def scan(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    """The rewrite's scan, evaluated one iteration at a time (the reference beside it)."""
    cmp = ctx.compare
    p = eqn.params
    closed: ClosedJaxpr = p["jaxpr"]
    nc, nk, n = p["num_consts"], p["num_carry"], p["length"]
    consts, carry, xs = invals[:nc], invals[nc : nc + nk], invals[nc + nk :]
    if not n:
        raise NotImplementedError("fmp.explain(compare=True): a scan of length 0 has nothing to compare")
    ref = cmp.pending
    r_consts, r_carry, r_xs = ref[:nc], ref[nc : nc + nk], ref[nc + nk :]
    before, after = like_avals(closed.in_avals[:nc], consts), like_avals(closed.in_avals[nc + nk :], xs)
    quiet = dataclasses.replace(ctx, records=None, compare=None, handlers=cmp.rewrite_handlers)
    _, carry_avals = _loop_body(closed, before, list(closed.in_avals[nc : nc + nk]), after, carry, quiet, scope)
    carry = _pin(carry, carry_avals, ctx)
    records = ctx.records if ctx.records is not None else []
    inputs_error = output_stats(invals, ref)[0] or 0.0
    writers: list[int | None] = []
    blocks: list[tuple[int, int]] = []
    ys: list[list[Any]] = []
    r_ys: list[list[Any]] = []
    for t in reversed(range(n)) if p["reverse"] else range(n):
        mark = len(records)
        cmp.pending = [*r_consts, *r_carry, *(x[t] for x in r_xs)]
        outs = eval_jaxpr(closed.jaxpr, closed.consts, [*consts, *carry, *(x[t] for x in xs)], ctx, scope)
        carry = _pin(outs[:nk], carry_avals, ctx)
        r_carry = cmp.returned[:nk]
        writers = list(cmp.returned_rows[:nk])
        ys.append(outs[nk:])
        r_ys.append(cmp.returned[nk:])
        blocks.append((mark, len(records)))
    if p["reverse"]:
        ys.reverse()
        r_ys.reverse()
    cmp.flush()  # the rows of every iteration hold their statistics before they are merged
    _merge(records, blocks)
    if blocks:
        last, first = blocks[-1][0], blocks[0][0]
        at = [None if i is None or i < last else first + i - last for i in writers]
        _charge_carry(records, at, carry, r_carry, inputs_error, ctx)
    stacked = [jnp.stack(c) for c in zip(*ys, strict=True)]
    cmp.returned = [*r_carry, *(jnp.stack(c) for c in zip(*r_ys, strict=True))]
    cmp.returned_rows = [None] * (nk + len(stacked))
    return [*carry, *stacked]


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
    error (a sum carried in bfloat16 loses its addends once it is large, one rounding at a time)."""
    for i, c, r in zip(at, carry, r_carry, strict=True):
        err = output_stats([c], [r])[0]
        if i is None or err is None or records[i].added_error is None:
            continue
        row = records[i]
        if err > max(row.added_error, 2.0 * inputs_error):
            row = dataclasses.replace(row, added_error=err, detail=_join(row.detail, "compounded through the carry"))
            records[i] = dataclasses.replace(row, suggestion=suggestion(row, ctx.rules) or row.suggestion)


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b


def _pin(vals: list[Any], avals: list[Any], ctx: Context) -> list[Any]:
    return [cast(x, a.dtype, ctx) if hasattr(a, "dtype") else x for x, a in zip(vals, avals, strict=True)]


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
    """One row for an equation over every iteration: the worst iteration's, with the means added."""
    if rows[0].error is None and not any(r.flips for r in rows):
        return rows[0]
    worst = max(rows, key=lambda r: (r.nonfinite, r.added_error or 0.0, r.error or 0.0, r.flips))
    return dataclasses.replace(
        worst,
        error=max((r.error for r in rows if r.error is not None), default=None),
        sqnr_db=min((r.sqnr_db for r in rows if r.sqnr_db is not None), default=None),
        max_abs_error=max((r.max_abs_error for r in rows if r.max_abs_error is not None), default=None),
        nonfinite=any(r.nonfinite for r in rows),
        flips=sum(r.flips for r in rows),
        error_mean=_mean([r.error for r in rows]),
        added_error_mean=_mean([r.added_error for r in rows]),
        iterations=len(rows),
    )


def _mean(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return math.fsum(vals) / len(vals) if vals else None
