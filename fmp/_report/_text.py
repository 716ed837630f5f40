"""The text of a precision report: the worst ops first, then one row per op with a summary by rule."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable, Sequence
from typing import Any

from fmp._core._dtypes import MAX_FINITE
from fmp._report._float8_choice import size_line
from fmp._report._row import OpRecord


def inherits(r: OpRecord) -> bool:
    """The row's non-finite values are its inputs': run alone on the reference inputs, the op is finite."""
    return r.nonfinite and r.suggestion is None and r.added_error is not None and math.isfinite(r.added_error)


def _rank(r: OpRecord) -> tuple[bool, bool, float, int, float]:
    return (r.nonfinite and not inherits(r), r.suggestion is not None, r.added_error or 0.0, r.flips, r.error or 0.0)


def worst_rows(records: Iterable[OpRecord], k: int) -> tuple[OpRecord, ...]:
    """Compared rows, worst first: rows that make non-finite values themselves, then rows with a fix, each by
    decreasing added error, flips and error (rows that only inherit a non-finite value follow)."""
    rows = [r for r in records if r.error is not None or r.flips]
    return tuple(sorted(rows, key=_rank, reverse=True)[: max(k, 0)])


def inherited(records: Sequence[OpRecord]) -> dict[int, int]:
    """Row index of each op that makes non-finite values -> how many later rows only inherit them (each
    charged to the nearest such op before it, in program order)."""
    counts: dict[int, int] = {}
    culprit = None
    for r in records:
        if r.nonfinite and not inherits(r):
            culprit = r.index
            counts.setdefault(culprit, 0)
        elif inherits(r) and culprit is not None:
            counts[culprit] += 1
    return counts


def overflow_text(r: OpRecord) -> str:
    """``|x| up to 4.1e+05, float16 max 65504`` for a row whose own values overflow its output dtype."""
    if r.ref_max is None or r.added_error is None or math.isfinite(r.added_error):
        return ""
    for name in r.out_after:
        if name in MAX_FINITE and r.ref_max > MAX_FINITE[name]:
            return f"|x| up to {r.ref_max:.1e}, {name} max {MAX_FINITE[name]:.6g}"
    return ""


def _num(x: float | None, fmt: str = ".2e") -> str:
    return "-" if x is None else format(x, fmt)


def format_worst(
    rows: Iterable[OpRecord],
    title: str = "worst ops (overflows and fixes first; error = relative L2 vs the program as written)",
    downstream: dict[int, int] | None = None,
) -> str:
    """The worst ops, one block each: errors, where in the source, and the suggested fix; ``downstream``: how
    many rows inherit each culprit's non-finite values (those rows are left out)."""
    out = [title]
    downstream = downstream or {}
    rows = list(rows)
    if not rows:
        out.append("(none: every op computed exactly what the program as written computes)")
    for r in rows:
        if downstream and inherits(r):
            continue
        flag = "  NON-FINITE" if r.nonfinite else ""
        out.append(
            f"#{r.index} {r.op} [{_dtypes(r.in_after)} -> {_dtypes(r.out_after)}, {r.category}]: "
            f"added {_num(r.added_error)}, error {_num(r.error)}, sqnr {_num(r.sqnr_db, '.1f')} dB, "
            f"flips {r.flips}{flag}"
            + (
                f"; worst of {r.iterations} iterations, mean added {_num(r.added_error_mean)}"
                if r.iterations > 1
                else ""
            )
            + (f"; {r.underflow:.1%} below float16's normal range" if r.underflow else "")
        )
        where = "  ".join(x for x in (r.scope and f"scope {r.scope}", r.source) if x)
        if where:
            out.append(f"    at {where}")
        over, n = overflow_text(r), downstream.get(r.index, 0)
        if over or n:
            tail = f"{n} op{'s' if n != 1 else ''} downstream inherit{'' if n != 1 else 's'} it" if n else ""
            out.append("    overflow: " + "; ".join(x for x in (over, tail) if x))
        if r.category == "float8" and (r.added_vs_float8_median is not None or r.gemm is not None):
            out.append(f"    float8: {_float8_facts(r)}")
        if r.suggestion:
            out.append(f"    fix: {r.suggestion}")
    return "\n".join(out)


def _float8_facts(r: OpRecord) -> str:
    """A float8 row's own error against the other float8 matmuls', and its GEMM size against the GPU rule."""
    facts = []
    if r.added_vs_float8_median is not None:
        facts.append(f"added {r.added_vs_float8_median:.1f}x the median float8 matmul's")
    if r.gemm is not None:
        m, k, n = r.gemm
        facts.append(f"M, K, N = {m}, {k}, {n}" + (" (too small to pay on a GPU)" if r.float8_too_small else ""))
    return "; ".join(facts)


def _dtypes(names: Iterable[str]) -> str:
    short = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64", "float8_e4m3fn": "e4m3", "float4_e2m1fn": "e2m1"}
    return ",".join(short.get(n, n) for n in names) or "-"


def _flops(x: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}" if x else ""


RULE_WIDTH = 40  # the rule column's cells are cut here (the row's ``detail`` and ``why`` keep the whole text)


def _rule(r: OpRecord) -> str:
    """The rule column's cell: the rule, its detail and why, cut after a word at ``RULE_WIDTH`` (``...``)."""
    text = (f"{r.category}:{r.detail}" if r.detail else r.category) + (f" [{r.why}]" if r.why else "")
    if len(text) <= RULE_WIDTH:
        return text
    cut = text[: RULE_WIDTH - 3]
    space = cut.rfind(" ")
    if text[len(cut)] != " " and space > RULE_WIDTH // 2:  # a word would be cut: end before it
        cut = cut[:space]
    return cut.rstrip(",;:[ ") + "..."


# what each marker of the table means: (marker, how a row's cell shows it, its line in the legend)
_LEGEND = (
    ("!", lambda row: row[7].endswith("!"), "! = a fix is due (row.suggestion)"),
    (
        "inf",
        lambda row: any(c.startswith("inf") for c in row[7:9]),
        "inf = not finite (in added: the op overflows by itself)",
    ),
    ("...", lambda row: row[2].endswith("..."), "... = the rule's text is cut (row.detail and row.why hold it)"),
    ("small", lambda row: row[-3].endswith(" small"), "small = a float8 matmul too small to pay on a GPU"),
)


def legend(rows: Sequence[Sequence[str]], compared: bool) -> str:
    """One line under the table naming each marker its cells show (``!``, ``inf``, ``...``, ``small``)."""
    found = [
        text
        for marker, shows, text in _LEGEND
        if (compared or marker in ("...", "small")) and any(shows(row) for row in rows)
    ]
    return ("markers: " + "; ".join(found)) if found else ""


def format_table(records: Iterable[OpRecord], summary: dict[str, Any], title: str, compared: bool = False) -> str:
    """Formats records as a fixed-width table, a line naming the markers it shows (``legend``), then the
    summary; ``compared``: with the columns ``added`` (the error the op adds by itself) and ``error`` (of its
    outputs), ``!`` marking a row with a fix and ``inf`` an overflow."""
    records = list(records)
    errors = ("added", "error") if compared else ()
    header = (
        "#",
        "op",
        "rule",
        "in before",
        "in after",
        "out before",
        "out after",
        *errors,
        "flops",
        "scope",
        "source",
    )
    rows = [
        (
            str(r.index),
            r.op,
            _rule(r),
            _dtypes(r.in_before),
            _dtypes(r.in_after),
            _dtypes(r.out_before),
            _dtypes(r.out_after),
            *((_short(r.added_error) + ("!" if r.suggestion else ""), _short(r.error)) if compared else ()),
            _flops(r.flops) + (" small" if r.float8_too_small else ""),
            r.scope,
            r.source,
        )
        for r in records
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    out = [title, line, "-" * len(line)]
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    marks = legend(rows, compared)
    if marks:
        out.append(textwrap.fill(marks, 100, subsequent_indent="    ", break_on_hyphens=False))
    out.append("")
    share = summary.get("low_precision_flop_share", 0.0)
    islands = summary.get("float32_islands", 0)
    out.append(
        f"{summary.get('ops', 0)} ops, {_flops(summary.get('flops', 0)) or 0} flops, "
        f"{share:.1%} of flops in low precision, {summary.get('casts_inserted', 0)} casts inserted, "
        f"{islands} float32 island{'' if islands == 1 else 's'}"
    )
    if summary.get("float8_flops"):
        out.append(f"{summary['float8_flop_share']:.1%} of flops in float8")
    out += _block_lines(records)
    size = size_line(records)
    if size:
        out.append(textwrap.fill(size, 100, subsequent_indent="    ", break_on_hyphens=False))
    out += [textwrap.fill(line, 100, subsequent_indent="    ", break_on_hyphens=False) for line in _by_rule(records)]
    return "\n".join(out)


def _block_lines(records: Iterable[OpRecord]) -> list[str]:
    """One line per block-scaled matmul: the shares of its operands flushed to zero and of saturated scales."""
    rows = [r for r in records if r.block_flushed is not None]
    return [
        f"  #{r.index} {r.detail.split(' ', 1)[0]}: {r.block_flushed:.2%} of nonzero elements flushed to zero, "
        f"{r.block_saturated:.2%} of blocks with a saturated scale"
        for r in rows
    ]


def _short(x: float | None) -> str:
    return "" if x is None else ("inf" if math.isinf(x) else format(x, ".1e"))


def _by_rule(records: Iterable[OpRecord]) -> list[str]:
    """One line per deciding rule: which ops it decided, with counts (``aten::linear x14``)."""
    counts: dict[str, dict[str, int]] = {}
    for r in records:
        if r.category in ("lower_precision", "float8", "float32", "promote"):
            per_op = counts.setdefault(r.category, {})
            per_op[r.op] = per_op.get(r.op, 0) + 1
    return [
        f"{rule}: " + ", ".join(f"{op} x{n}" for op, n in sorted(per_op.items(), key=lambda kv: (-kv[1], kv[0])))
        for rule, per_op in counts.items()
    ]
