"""The text of a precision report: the worst ops first, then one row per op with a summary by rule."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

OpRecord = Any  # fmp._report._records.OpRecord (whose Report formats itself with this module)


def _rank(r: OpRecord) -> tuple[bool, bool, float, int, float]:
    return (r.nonfinite, r.suggestion is not None, r.added_error or 0.0, r.flips, r.error or 0.0)


def worst_rows(records: Iterable[OpRecord], k: int) -> tuple[OpRecord, ...]:
    """Compared rows, worst first: non-finite values, then rows with a fix, each by decreasing added error,
    flips and error."""
    rows = [r for r in records if r.error is not None or r.flips]
    return tuple(sorted(rows, key=_rank, reverse=True)[: max(k, 0)])


def _num(x: float | None, fmt: str = ".2e") -> str:
    return "-" if x is None else format(x, fmt)


def format_worst(
    rows: Iterable[OpRecord],
    title: str = "worst ops (overflows and fixes first; error = relative L2 vs the program as written)",
) -> str:
    """The worst ops, one block each: errors, where in the source, and the suggested fix."""
    out = [title]
    for r in rows:
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
        if r.suggestion:
            out.append(f"    fix: {r.suggestion}")
    return "\n".join(out)


def _dtypes(names: Iterable[str]) -> str:
    short = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64", "float8_e4m3fn": "e4m3"}
    return ",".join(short.get(n, n) for n in names) or "-"


def _flops(x: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}" if x else ""


def format_table(records: Iterable[OpRecord], summary: dict[str, Any], title: str) -> str:
    """Formats records as a fixed-width table followed by the summary."""
    header = ("#", "op", "rule", "in before", "in after", "out before", "out after", "flops", "scope", "source")
    rows = [
        (
            str(r.index),
            r.op,
            (f"{r.category}:{r.detail}" if r.detail else r.category) + (f" [{r.why}]" if r.why else ""),
            _dtypes(r.in_before),
            _dtypes(r.in_after),
            _dtypes(r.out_before),
            _dtypes(r.out_after),
            _flops(r.flops),
            r.scope,
            r.source,
        )
        for r in records
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    out = [title, line, "-" * len(line)]
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
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
    out += _by_rule(records)
    return "\n".join(out)


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
