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
from fmp._report._row import OpRecord

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


# an output error within this factor of the baseline is the model's own sensitivity at the compute dtype
SENSITIVITY = 4.0


def _worst(errors: Any) -> float | None:
    """The largest of a report's per-output errors (a float, or a dict of them for several outputs)."""
    if isinstance(errors, dict):
        return max(errors.values(), default=None)
    return errors


def reading(records: Iterable[OpRecord], policy: str, output: Any, baseline: Any) -> str:
    """The verdict's second line: how far the output is from float32 against how far the float32 program
    itself moves with its inputs and parameters rounded to the compute dtype (the baseline), and what that
    says, where no op needs a fix: below the compute dtype's unit roundoff, the rounding the policy asks for;
    within ``SENSITIVITY`` times the baseline, the model's own sensitivity (and what helps); otherwise the ops
    that add the most error (those with a fix first), whether or not they cross the per-op threshold. ``""``
    without outputs."""
    out, base = _worst(output), _worst(baseline)
    if out is None:
        return ""
    name = compute_dtype(policy)
    several = " (the worst output's)" if isinstance(output, dict) and len(output) > 1 else ""
    if out == 0.0:
        return f"output error 0{several}: the policy computes the outputs exactly as the program as written"
    head = f"output error {out:.1e} vs float32{several}"
    if base is not None:
        head += f"; baseline {base:.1e} (the float32 program with its inputs and parameters rounded to {name})"
    u = UNIT_ROUNDOFF[name]
    if out <= u and not fix_rows(records):
        return f"{head}: below {name}'s unit roundoff u = {u:.1e}: the rounding the policy asks for"
    if math.isfinite(out) and base is not None and out <= SENSITIVITY * base and not fix_rows(records):
        return (
            f"{head}: within {SENSITIVITY:g}x of the baseline, the error is the model's own sensitivity at "
            f"{name}, not an op to fix; what helps: float32 for the inputs, the embedding or a norm"
        )
    rows = [r for r in records if r.added_error or r.suggestion]
    rows = sorted(rows, key=lambda r: (r.suggestion is not None, *_rank(r)))
    rows = rows[::-1][:3]  # the ops with a fix first
    if not math.isfinite(out):
        above = "not finite"
    else:
        above = f"{out / base:.1f}x the baseline" if base else "above the baseline"
    if not rows:
        return f"{head}: {above}"
    ops = ", ".join(
        f"#{r.index} {r.op} ({r.scope or r.source.split(' (')[0]}, added {r.added_error or 0.0:.1e}"
        + (f", error {r.error:.1e})" if r.suggestion and r.error is not None else ")")
        for r in rows
    )
    return f"{head}: {above}; the ops adding the most error (those with a fix first): {ops}"


def _where(r: OpRecord) -> str:
    return "  ".join(x for x in (r.source or "(no source line)", r.scope and f"scope {r.scope}") if x)


GRADIENT = "gradient "  # how ``failure`` tells a gradient leaf's name from an output's
SHOWN = 5  # gradient leaves a failure lists, worst first


def failure(
    records: Iterable[OpRecord],
    policy: str,
    errors: dict[str, float],
    max_error: float | None,
    notes: dict[str, str] | None = None,
    output: Any = None,
    baseline: Any = None,
) -> str:
    """Why a precision check fails, or ``""`` when it passes: the verdict (its second line reads ``output``
    against ``baseline``), the outputs whose error (``errors``: name -> relative L2 error) is above
    ``max_error`` or non-finite, then for gradient leaves (names starting ``"gradient "``) one line counting
    those above it and the ``SHOWN`` worst (``notes``: why a leaf is judged otherwise), then the op that needs
    a fix (its source line, error and suggestion) and the next four."""
    records = list(records)
    fixes = fix_rows(records)
    notes = notes or {}
    over = {k: e for k, e in errors.items() if not math.isfinite(e) or (max_error is not None and e > max_error)}
    if not fixes and not over:
        return ""
    lines = [verdict(records, policy)]
    second = reading(records, policy, output, baseline)
    if second:
        lines.append(textwrap.fill(second, 100, subsequent_indent="  "))
    bound = "" if max_error is None else f" > max_error {max_error:.1e}"
    leaves = {k: e for k, e in over.items() if k.startswith(GRADIENT)}
    for name, e in over.items():
        if name not in leaves:
            lines.append(f"{name}: relative error {e:.2e}{bound}")
    if leaves:
        ranked = sorted(leaves.items(), key=lambda kv: kv[1], reverse=True)
        total = sum(1 for k in errors if k.startswith(GRADIENT))
        exceed = f"exceed {max_error:.0e}" if max_error is not None else "are not finite"
        name, e = ranked[0]
        lines.append(f"{len(leaves)} of {total} gradient leaves {exceed}; worst: {name.removeprefix(GRADIENT)} {e:.2e}")
        lines += [f"  {k.removeprefix(GRADIENT)}: error {v:.2e}{notes.get(k, '')}" for k, v in ranked[:SHOWN]]
        if len(ranked) > SHOWN:
            lines.append(f"  ... and {len(ranked) - SHOWN} more (report.grad_errors has every leaf)")
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
