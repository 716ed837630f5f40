"""Whether a plan still holds on other inputs: the plan run as a whole against its budget, and each site alone
in its format against its share of the budget (``fmp.testing.assert_plan``).

A site's *share* is the error it added alone when the plan was made, times the room the plan left under its
budget (``budget / error``), times ``1 + rtol``: a site whose own error grew more than the others' is the one
to name when the plan no longer meets its budget.

Framework-neutral: imports neither jax nor torch.
"""

from __future__ import annotations

from typing import Any

from fmp._plan._formats import FORMATS
from fmp._plan._search import Measure

Plan = Any  # fmp._plan._plan.Plan


def failure(plan: Plan, measure: Measure, rtol: float) -> str:
    """Why ``plan`` fails on the inputs ``measure`` runs, ``""`` when it holds."""
    assignment = {r.site: FORMATS[r.format] for r in plan.rows}
    f32 = {k: FORMATS["float32"] for k in assignment}
    room = plan.budget / plan.error if plan.error > 0 else 1.0
    rows = [r for r in plan.rows if r.error > 0]  # a site in its most precise format has nothing to bound
    jobs = [{**f32, r.site: assignment[r.site]} for r in rows] + [assignment]
    many = getattr(measure, "many", None)
    *alone, whole = many(jobs) if many is not None else [measure(a) for a in jobs]
    over = []
    for r, got in zip(rows, alone, strict=True):
        share = r.error * room * (1 + rtol)
        if got.nonfinite or got.error > share:
            over.append((got.error / share if share > 0 else float("inf"), r, got.error, share))
    limit = plan.budget * (1 + rtol)
    if not over and not whole.nonfinite and whole.error <= limit:
        return ""
    lines = [
        f"the plan measures {whole.error:.2e} on these inputs (budget {plan.budget:.2e}, with rtol {rtol:g}: "
        f"{limit:.2e}){' and has non-finite values' if whole.nonfinite else ''}"
    ]
    for _, r, err, share in sorted(over, key=lambda o: -o[0]):
        lines.append(
            f"site {r.site!r} ({r.format}) adds {err:.2e} alone, above its share {share:.2e} (it added "
            f"{r.error:.2e} when planned)"
        )
    if len(lines) == 1:
        lines.append("no site exceeds its share alone: their errors combine worse than when planned")
    return "\n".join(lines)
