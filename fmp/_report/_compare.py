"""How far one run's values are from a reference run's, and the fix to suggest: the statistics both
``fmp.explain(compare=True)`` and ``fmp.torch.explain_fx(compare=True)`` report (one formula for both).

Framework-neutral: ``array_parts`` takes the array library (``numpy``, ``jax.numpy`` or ``torch``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from fmp._core._dtypes import LOW_PRECISION as LOW
from fmp._core._rules import DEFAULT_RULES, RuleSet

OpRecord = Any  # fmp._report._records.OpRecord (whose plot imports this module)

# unit roundoff (half the machine epsilon) of each floating dtype an op may run in
UNIT_ROUNDOFF = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
    "float8_e4m3fn": 2.0**-4,
    "float8_e5m2": 2.0**-3,
}

# an op's own error this many unit roundoffs above its dtype's (or non-finite, or changed discrete outputs)
# gets a suggestion; a correctly rounded elementwise op adds about one, a well-conditioned reduction a few
FAR = 4.0

# an op whose output error is this many times its inputs' (and above FAR roundoffs) magnifies them
AMPLIFIED = 16.0


# operations that compute no new floating value: they move, select, reorder or negate their inputs' values,
# or pick one of them (max, min); run on values of their output dtype, they add exactly zero error
EXACT_OPS = frozenset(
    {
        "abs",
        "broadcast_in_dim",
        "clamp",
        "concatenate",
        "copy",
        "copy_p",
        "dynamic_slice",
        "dynamic_update_slice",
        "expand_dims",
        "gather",
        "max",
        "min",
        "neg",
        "optimization_barrier",
        "pad",
        "reduce_max",
        "reduce_min",
        "reshape",
        "rev",
        "select_n",
        "slice",
        "sort",
        "split",
        "squeeze",
        "stop_gradient",
        "transpose",
    }
)


def combine(parts: Sequence[Sequence[Any]], flips: int = 0) -> tuple[Any, Any, Any, bool, int]:
    """``output_stats`` from the ``_parts`` of each floating output (any array library's scalars)."""
    if not parts:
        return None, None, None, False, flips
    signal = noise = max_abs = 0.0
    nonfinite = False
    for part in parts:
        r_max, r_sq, d_max, d_sq, bad, over = (float(x) for x in part)
        nonfinite |= bool(over)
        signal += r_max * r_max * r_sq
        noise += math.inf if bad else d_max * d_max * d_sq
        max_abs = max(max_abs, math.inf if bad else d_max)
    if noise == 0.0:
        return 0.0, math.inf, max_abs, nonfinite, flips
    error = math.sqrt(noise / signal) if signal > 0.0 else math.inf
    sqnr = 10.0 * math.log10(signal / noise) if signal > 0.0 and math.isfinite(noise) else -math.inf
    return error, sqnr, max_abs, nonfinite, flips


def array_parts(xp: Any, p: Any, r: Any, top: Any = None) -> tuple[Any, ...]:
    """Largest |reference| and sum of squares scaled by it, the same of the difference, any non-finite
    difference, any non-finite value where the reference is finite (``xp``: ``numpy``, ``jax.numpy`` or
    ``torch``; ``top``: the largest element of a non-negative array, 0 when empty, if ``xp.max`` has no
    ``initial``)."""
    top = top or (lambda x: xp.max(x, initial=0.0))
    same = (p == r) | (xp.isnan(p) & xp.isnan(r))
    diff = xp.where(same, 0.0, p - r)
    finite = xp.isfinite(r)
    ok = xp.isfinite(diff)
    r0 = xp.abs(xp.where(finite, r, 0.0))
    d0 = xp.abs(xp.where(ok, diff, 0.0))
    r_max, d_max = top(r0), top(d0)
    r_sq = xp.sum(xp.square(r0 / xp.where(r_max > 0, r_max, 1.0)))
    d_sq = xp.sum(xp.square(d0 / xp.where(d_max > 0, d_max, 1.0)))
    return r_max, r_sq, d_max, d_sq, xp.any(~ok), xp.any(~xp.isfinite(p) & finite)


def unit_roundoff(row: OpRecord) -> float:
    """The unit roundoff of the lowest-precision floating dtype the op ran with."""
    names = [n for n in (*row.in_after, *row.out_after) if n in UNIT_ROUNDOFF]
    return max((UNIT_ROUNDOFF[n] for n in names), default=UNIT_ROUNDOFF["float32"])


def needs_fix(row: OpRecord) -> bool:
    """The op's own error is far above its dtype's roundoff, or it overflows."""
    if row.added_error is None:
        return False
    return not math.isfinite(row.added_error) or row.added_error > FAR * unit_roundoff(row)


def amplified(row: OpRecord, producers: Sequence[OpRecord] = ()) -> bool:
    """The op's output error is far above its dtype's roundoff and ``AMPLIFIED`` times its inputs' errors,
    while the op adds none of it: an ill-conditioned op (``cos`` of a large angle, a cancelling
    subtraction) that magnifies a small rounding of its inputs."""
    if not row.error or not producers or not math.isfinite(row.error):
        return False
    inherited = max((p.error or 0.0) for p in producers)
    own = row.added_error or 0.0
    return row.error > FAR * unit_roundoff(row) and row.error > AMPLIFIED * max(inherited, own)


def suggestion(row: OpRecord, rules: RuleSet, producers: Sequence[OpRecord] = (), framework: str = "jax") -> str | None:
    """Code to paste that runs the op in float32: an override of its scope, or a rule-table move.

    A discrete op whose outputs changed (``top_k`` on bfloat16 logits), or an op that magnifies its
    inputs' small error (``amplified``: ``cos`` of an angle rounded to bfloat16), is fixed where its
    inputs lost their precision: ``producers``, the rows that made its inputs (empty when the op rounded
    its inputs down itself), are named when they ran in low precision; with none, the flips are
    inherited. ``framework="torch"`` moves ``aten::`` ops in the rule-table line.
    """
    culprits = [row]
    low = [p for p in producers if any(n in LOW for n in p.out_after)]
    if row.flips:
        rounds_itself = not producers and any(n in LOW for n in row.in_after)
        if not (low or rounds_itself):
            return None
        culprits = low or [row]
    elif low and amplified(row, producers):
        culprits = low
    elif not needs_fix(row):
        return None
    if all(c.scope for c in culprits):
        scopes = ", ".join(f'"{s}": "float32"' for s in dict.fromkeys(c.scope for c in culprits))
        return f"overrides={{{scopes}}}"
    base = "fmp.DEFAULT_RULES" if rules is DEFAULT_RULES else "rules"
    ops = ", ".join(f'"{op}"' for op in dict.fromkeys(c.op for c in culprits))
    where = 'framework="torch", ' if framework == "torch" else ""
    return f"rules={base}.derive({where}float32=[{ops}])"
