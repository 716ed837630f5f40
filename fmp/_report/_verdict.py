"""The verdict of a compared report: which rows need a fix, worst first, and the line ``str(report)`` opens
with (``no op needs a fix`` or ``N ops need a fix``, with the policy's unit roundoff and the threshold).

Framework-neutral: ``fmp.explain(compare=True)`` and ``fmp.torch.explain_fx(compare=True)`` give the same
answer on the same rows.
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Iterable
from typing import Any

from fmp._core._dtypes import UNIT_ROUNDOFF
from fmp._report._compare import FAR
from fmp._report._float8_choice import clause

OpRecord = Any  # fmp._report._records.OpRecord (whose Report asks this module for its verdict)

# the compute dtype in a report's policy text: "params=float32,compute=float16,..." (JAX) or
# "autocast(device_type='cpu', dtype=bfloat16)" (torch)
_COMPUTE = re.compile(r"(?:compute|dtype)=(?P<name>[a-z0-9_]+)")


def _rank(r: OpRecord) -> tuple[bool, float, int, float]:
    added = r.added_error if r.added_error is not None else 0.0
    overflow = r.nonfinite or not math.isfinite(added)
    return (overflow, added, r.flips, r.error or 0.0)


def fix_rows(records: Iterable[OpRecord]) -> list[OpRecord]:
    """The rows with a suggestion: overflows first, then by decreasing added error, flips and error."""
    return sorted((r for r in records if r.suggestion), key=_rank, reverse=True)


def compute_dtype(policy: str) -> str:
    """The compute dtype named in a report's policy text, ``"float32"`` when none is named."""
    m = _COMPUTE.search(policy)
    return m["name"] if m is not None and m["name"] in UNIT_ROUNDOFF else "float32"


def verdict(records: Iterable[OpRecord], policy: str) -> str:
    """The verdict ``str(report)`` opens with (wrapped at 100 columns): how many ops need a fix, the unit
    roundoff ``u`` of the policy's compute dtype, and the threshold an op's own error is held to (and, with
    float8 matmuls, the rule that keeps one in the compute dtype: ``_float8_choice``)."""
    records = list(records)
    n = len(fix_rows(records))
    head = "no op needs a fix" if n == 0 else f"{n} op{'s' if n > 1 else ''} need{'' if n > 1 else 's'} a fix"
    name = compute_dtype(policy)
    u = UNIT_ROUNDOFF[name]
    text = (
        f"{head} ({name} unit roundoff u = {u:.1e}; a fix is due where an op overflows, flips discrete "
        f"outputs or adds an error above {FAR:g}u = {FAR * u:.1e}{clause(records)})"
    )
    return textwrap.fill(text, 100, subsequent_indent="  ")


def _where(r: OpRecord) -> str:
    return "  ".join(x for x in (r.source or "(no source line)", r.scope and f"scope {r.scope}") if x)


def failure(records: Iterable[OpRecord], policy: str, errors: dict[str, float], max_error: float | None) -> str:
    """Why a precision check fails, or ``""`` when it passes: the ops that need a fix (the worst one's
    source line, error and suggestion first), and the outputs or gradient leaves (``errors``: name ->
    relative L2 error) whose error is above ``max_error`` (or non-finite)."""
    records = list(records)
    fixes = fix_rows(records)
    over = {k: e for k, e in errors.items() if not math.isfinite(e) or (max_error is not None and e > max_error)}
    if not fixes and not over:
        return ""
    lines = [verdict(records, policy)]
    for name, e in over.items():
        bound = "" if max_error is None else f" > max_error {max_error:.1e}"
        lines.append(f"{name}: relative error {e:.2e}{bound}")
    if fixes:
        worst = fixes[0]
        lines.append(
            f"worst op: #{worst.index} {worst.op} at {_where(worst)}: added error {worst.added_error:.2e}, "
            f"error {worst.error if worst.error is not None else math.nan:.2e}"
        )
        lines.append(f"fix: {worst.suggestion}")
        lines += [f"also: #{r.index} {r.op} at {_where(r)}; fix: {r.suggestion}" for r in fixes[1:5]]
    else:
        worst_rows = sorted((r for r in records if r.added_error is not None), key=_rank, reverse=True)
        if worst_rows:
            w = worst_rows[0]
            lines.append(
                f"worst op: #{w.index} {w.op} at {_where(w)}: added error {w.added_error:.2e} (within its dtype's "
                f"rounding: no fix to suggest)"
            )
    return "\n".join(lines)
