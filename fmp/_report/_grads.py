"""The gradient part of a precision report: each gradient leaf against the reference, and float16's range.

Framework-neutral: plain numbers per leaf (``GradError``), the backward rows (``OpRecord``s, kept as the
report's), and the loss scale they were measured at. ``float16_range`` says which part of a gradient
float16 cannot hold at a loss scale, and which powers of two would hold it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from fmp._core._dtypes import MAX_FINITE, SMALLEST_NORMAL, UNIT_ROUNDOFF
from fmp._report._row import OpRecord

FLOAT16_MAX = MAX_FINITE["float16"]
FLOAT16_TINY = SMALLEST_NORMAL["float16"]
FLOAT16_UNIT = UNIT_ROUNDOFF["float16"]


@dataclasses.dataclass(frozen=True)
class GradError:
    """One gradient leaf under the policy against the reference gradient.

    Attributes:
      error: Relative L2 error, ``|g - g_ref| / |g_ref|`` (inf with non-finite values).
      cosine: Cosine similarity with the reference gradient (NaN with non-finite values).
      max_abs_error: Largest absolute difference.
      nonfinite: inf/NaN in the policy gradient where the reference is finite.
      underflow: Under a float16 policy: the fraction of the reference gradient's nonzero elements that
        round to zero in float16 at the loss scale; ``None`` otherwise.
      subnormal: The fraction that is subnormal there: float16 keeps it with fewer significant bits.
      scale_needed: The smallest power of two that lifts the gradient into float16's normal range: every
        element but the smallest ones, whose joint L2 norm is below float16's unit roundoff (2^-11) of the
        gradient's (losing them costs less than rounding the gradient to float16 does).
      scale_max: The largest power of two at which no element overflows float16.
      norm: L2 norm of the reference gradient.
      diff_norm: L2 norm of the difference, ``|g - g_ref|`` (inf with non-finite values): a leaf whose
        reference gradient is tiny against the others' is judged by it (``fmp.testing.assert_precision``).
    """

    error: float
    cosine: float
    max_abs_error: float
    nonfinite: bool
    underflow: float | None = None
    subnormal: float | None = None
    scale_needed: float | None = None
    scale_max: float | None = None
    norm: float | None = None
    diff_norm: float | None = None


@dataclasses.dataclass(frozen=True)
class GradReport:
    """The backward comparison of ``fmp.explain(..., compare=True, grads=True)``.

    Attributes:
      errors: Key path of each gradient leaf (as ``jax.tree_util.keystr`` writes it) -> ``GradError``.
      rows: One row per backward operation (the same fields as the forward rows).
      loss_scale: The scale the policy's backward ran at (the loss multiplied by it, the gradients divided).
      float16: Whether the policy computes in float16 (the range fields are filled).
      scale_needed, scale_max: Over every leaf and every float16 value of the backward: the smallest
        power of two that flushes none of them to zero, and the largest that overflows none.
    """

    errors: Mapping[str, GradError]
    rows: tuple[OpRecord, ...]
    loss_scale: float
    float16: bool = False
    scale_needed: float | None = None
    scale_max: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "errors": {k: dataclasses.asdict(v) for k, v in self.errors.items()},
            "rows": [r.to_dict() for r in self.rows],
            "loss_scale": self.loss_scale,
            "float16": self.float16,
            "scale_needed": self.scale_needed,
            "scale_max": self.scale_max,
        }


def relative_error(p: np.ndarray, r: np.ndarray) -> tuple[float, float, float, bool]:
    """``(error, cosine, max_abs_error, nonfinite)`` of ``p`` against ``r`` (float64 arrays)."""
    with np.errstate(all="ignore"):
        nonfinite = bool(np.any(~np.isfinite(p) & np.isfinite(r)))
        if nonfinite or not np.all(np.isfinite(p)):
            return math.inf, math.nan, math.inf, nonfinite
        d = p - r
        nr, npn, nd = (float(np.linalg.norm(x)) for x in (r, p, d))
        error = nd / nr if nr > 0 else (0.0 if nd == 0 else math.inf)
        if nr == 0 or npn == 0:
            cosine = 1.0 if nr == npn else 0.0
        else:
            cosine = min(1.0, max(-1.0, float(np.vdot(p / npn, r / nr))))
        return error, cosine, float(np.max(np.abs(d), initial=0.0)), False


def grad_error(p: np.ndarray, r: np.ndarray, **extra: Any) -> GradError:
    """A gradient ``p`` against its reference ``r`` (float64 arrays, unscaled); ``extra``: the float16 range
    fields of a float16 policy."""
    error, cosine, max_abs, nonfinite = relative_error(p, r)
    with np.errstate(all="ignore"):
        norm = float(np.linalg.norm(r[np.isfinite(r)]))
        diff = float(np.linalg.norm(p - r)) if np.all(np.isfinite(p)) else math.inf
    return GradError(error, cosine, max_abs, nonfinite, **extra, norm=norm, diff_norm=diff)


class Float16Range(NamedTuple):
    """What float16 does to a gradient at a loss scale (``float16_range``)."""

    underflow: float  # the fraction of its nonzero elements that round to zero
    subnormal: float  # the fraction that is subnormal
    scale_needed: float | None  # the smallest power of two that lifts ``lo`` into the normal range
    scale_max: float | None  # the largest power of two that overflows none of it
    lo: float  # the smallest magnitude that must stay in the normal range
    hi: float  # its largest magnitude


def float16_range(r: np.ndarray, scale: float) -> Float16Range:
    """Of a gradient ``r`` (float64, unscaled) held in float16 at ``scale``: a ``Float16Range``; the scales
    are ``None`` when ``r`` is 0.

    ``lo`` is the smallest magnitude that must stay in float16's normal range: the elements below it
    together have an L2 norm of at most float16's unit roundoff times ``r``'s, so losing them changes
    the gradient less than rounding it to float16 does. ``scale_needed`` lifts ``lo`` there.
    """
    a = np.abs(r[np.isfinite(r)])
    a = np.sort(a[a > 0])
    if not a.size:
        return Float16Range(0.0, 0.0, None, None, math.inf, 0.0)
    hi = float(a[-1])
    cum = np.cumsum(np.square(a / hi))
    k = int(np.searchsorted(cum, (FLOAT16_UNIT**2) * cum[-1], side="right"))
    lo = float(a[min(k, a.size - 1)])
    with np.errstate(all="ignore"):
        held = np.abs((a * scale).astype(np.float16))
    underflow = float(np.mean(held == 0))
    subnormal = float(np.mean((held > 0) & (held < FLOAT16_TINY)))
    needed, most = scales(lo, hi)
    return Float16Range(underflow, subnormal, needed, most, lo, hi)


def scales(lo: float, hi: float) -> tuple[float | None, float | None]:
    """The smallest power of two that lifts ``lo`` into float16's normal range, the largest that keeps ``hi``
    at most float16's largest value (``None`` for an empty range)."""
    if not (0 < lo <= hi < math.inf):
        return None, None
    return 2.0 ** math.ceil(math.log2(FLOAT16_TINY / lo)), 2.0 ** math.floor(math.log2(FLOAT16_MAX / hi))


def _pow2(x: float | None) -> str:
    if x is None:
        return "-"
    k = math.log2(x)
    return f"2^{int(k)}" if k == int(k) else f"{x:.3g}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def format_grads(g: GradReport) -> str:
    """The leaf table, and under float16 which loss scales hold the gradients."""
    head = ("leaf", "error", "cosine", "flushed", "subnormal", "keeps from", "overflows above")
    rows = [
        (key, f"{e.error:.2e}", f"{e.cosine:.6f}", _pct(e.underflow), _pct(e.subnormal))
        + (_pow2(e.scale_needed), _pow2(e.scale_max))
        for key, e in g.errors.items()
    ]
    if not g.float16:
        head, rows = head[:3], [row[:3] for row in rows]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]
    line = "  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))
    out = [f"gradients (under the policy at loss scale {_pow2(g.loss_scale)} vs the program as written)"]
    out += [line, "-" * len(line)]
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    if g.float16:
        out.append(scale_advice(g.loss_scale, g.scale_needed, g.scale_max))
    return "\n".join(out)


def scale_advice(scale: float, needed: float | None, most: float | None) -> str:
    """One line: whether ``scale`` holds every gradient value in float16, and which scale would."""
    if needed is None or most is None:
        return "float16: no nonzero gradient values to hold"
    fits = needed <= most
    now = "holds every value" if needed <= scale <= most else ("underflows" if scale < needed else "overflows")
    if not fits:
        return (
            f"float16 at loss scale {_pow2(scale)} {now}; no single scale holds them all (subnormal below "
            f"{_pow2(needed)}, overflow above {_pow2(most)}): keep the ops with the widest range in float32"
        )
    return f"float16 at loss scale {_pow2(scale)} {now}; scales {_pow2(needed)} to {_pow2(most)} hold every value"
