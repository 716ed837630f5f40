"""``Report.plot``: a compared report's errors along the program and its worst ops, drawn with matplotlib.

matplotlib is optional (the ``plot`` extra); it is imported when a plot is drawn, never by ``import fmp``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from fmp._core._dtypes import BELOW_FLOAT32, UNIT_ROUNDOFF
from fmp._core._optional import require
from fmp._report._row import OpRecord

_MSG_AX = (
    "Report.plot(ax=...) expects a matplotlib Axes or a pair of them (errors along the program, worst ops), got {got}"
)
_NAMED = 5  # ops labelled in the left panel at most
_LABEL = 48  # characters of a scope shown in a label (its end: the innermost modules)


def label(row: OpRecord) -> str:
    """``"#12 exp LM/Block_0/Attn_0"``: the row's position, op and scope (its end when long)."""
    scope = row.scope if len(row.scope) <= _LABEL else "..." + row.scope[-(_LABEL - 3) :]
    return " ".join(x for x in (f"#{row.index}", row.op, scope) if x)


def _finite_or_nan(x: float | None) -> float:
    return math.nan if x is None or x <= 0.0 or not math.isfinite(x) else x


def _axes(ax: Any) -> tuple[Any, Any, Any]:
    """``(figure, program axes, worst-ops axes or None)``: a new figure with both panels when ``ax`` is None."""
    require("matplotlib", "Report.plot")
    if ax is None:
        import matplotlib.pyplot as plt  # a pyplot figure: plt.show() shows it, as pandas' plots do

        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), width_ratios=(3, 2), layout="constrained")
        return fig, left, right
    from matplotlib.axes import Axes

    if isinstance(ax, Axes):
        return ax.figure, ax, None
    try:  # a list, a tuple or the array plt.subplots(1, 2) returns
        pair = tuple(ax)
    except TypeError:
        pair = ()
    if len(pair) == 2 and all(isinstance(a, Axes) for a in pair):
        return pair[0].figure, pair[0], pair[1]
    raise TypeError(_MSG_AX.format(got=type(ax).__name__))


def plot(
    records: Sequence[OpRecord], worst: Sequence[OpRecord], *, title: str, ax: Any = None, path: Any = None
) -> Any:
    """Draws ``records``' errors in program order and ``worst``'s own errors; returns the matplotlib Figure.

    Of ``worst``, only the rows that add error, overflow or flip outputs are labelled and drawn as bars.
    """
    fig, left, right = _axes(ax)
    culprits = [r for r in worst if r.nonfinite or r.flips or (r.added_error or 0.0) > 0.0]
    low = sorted({d for r in records if r.error is not None for d in r.out_after if d in BELOW_FLOAT32})
    _program(left, records, culprits, low)
    if ax is None:
        fig.suptitle(title, fontsize=9)
    else:  # the caller's figure keeps its own title
        left.set_title(title, fontsize=9)
    if right is not None:
        _culprits(right, culprits, low)
    if path is not None:
        fig.savefig(path)
    return fig


def _roundoff(ax: Any, low: Sequence[str], horizontal: bool) -> None:
    """A dotted line at the unit roundoff of each low-precision dtype the ops ran in."""
    for name in low:
        u = UNIT_ROUNDOFF[name]
        (ax.axhline if horizontal else ax.axvline)(u, ls=":", lw=0.8, color="0.4")
        if horizontal:  # labelled at the right end, clear of the labels of the first ops
            ax.annotate(f"{name} unit roundoff", (1.0, u), xycoords=("axes fraction", "data"), xytext=(-2, 2),
                        textcoords="offset points", fontsize=7, color="0.4", ha="right")  # fmt: skip
        else:
            ax.annotate(f"{name} unit roundoff", (u, 0.0), xycoords=("data", "axes fraction"), xytext=(2, 2),
                        textcoords="offset points", fontsize=7, color="0.4", rotation=90)  # fmt: skip


def _program(ax: Any, records: Sequence[OpRecord], culprits: Sequence[OpRecord], low: Sequence[str]) -> None:
    """Per compared op, in program order: its output's error and the error it adds, on a log scale."""
    from matplotlib.ticker import MaxNLocator

    rows = [r for r in records if r.error is not None]
    x = [r.index for r in rows]
    ax.plot(x, [_finite_or_nan(r.error) for r in rows], ".-", lw=0.8, ms=3, color="C0", label="error (accumulated)")
    ax.plot(x, [_finite_or_nan(r.added_error) for r in rows], "o", ms=4, color="C3", label="added_error (own)")
    ax.set_yscale("log")
    top = max((v for r in rows for v in (r.error, r.added_error) if v and math.isfinite(v)), default=1.0)
    # inf/NaN and changed discrete outputs have no place on a log axis: marked above the finite errors
    bad = [r.index for r in rows if r.nonfinite]
    flipped = [r.index for r in records if r.flips]
    for xs, marker, name in ((bad, "x", "non-finite (overflow)"), (flipped, "v", "flips (discrete outputs changed)")):
        if xs:
            ax.plot(xs, [top * 4] * len(xs), marker, color="C3", ms=6, label=name)
    _roundoff(ax, low, horizontal=True)
    # the ops to fix (a suggestion, an overflow), else the worst few; staggered so that neighbours stay legible
    named = [r for r in culprits if r.suggestion or r.nonfinite][:_NAMED] or list(culprits[:3])
    for i, r in enumerate(named):
        y = top * 4 if r.nonfinite or r.flips else _finite_or_nan(r.added_error)
        if not math.isnan(y):  # an op that adds nothing: no place on the log axis
            ax.annotate(label(r), (r.index, y), xytext=(6, -4 - 10 * i), textcoords="offset points", fontsize=7,
                        arrowprops={"arrowstyle": "-", "color": "0.5", "lw": 0.5},
                        bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8})  # fmt: skip
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("op (program order: the # of the text report)")
    ax.set_ylabel("relative L2 error vs the program as written")
    ax.legend(loc="lower right", fontsize=7)


def _culprits(ax: Any, culprits: Sequence[OpRecord], low: Sequence[str]) -> None:
    """The worst ops' own errors as horizontal bars, the worst at the top; non-finite ones hatched."""
    rows = list(reversed(culprits))
    inf = [r.nonfinite or r.added_error == math.inf for r in rows]
    cap = max((r.added_error for r in rows if r.added_error and math.isfinite(r.added_error)), default=1.0) * 4
    widths = [cap if bad else (r.added_error or 0.0) for r, bad in zip(rows, inf, strict=True)]
    bars = ax.barh(range(len(rows)), widths, color=["C3" if r.suggestion else "C7" for r in rows])
    for bar, bad in zip(bars, inf, strict=True):
        if bad:
            bar.set_hatch("//")
    ax.set_yticks(range(len(rows)), [label(r) + (f" ({r.flips} flips)" if r.flips else "") for r in rows], fontsize=7)
    if any(w > 0 for w in widths):
        from matplotlib.ticker import LogLocator, NullFormatter

        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(numticks=4))
        ax.xaxis.set_minor_formatter(NullFormatter())
        _roundoff(ax, low, horizontal=False)
    ax.set_xlabel("added_error" + (" (hatched: non-finite)" if any(inf) else ""))
    ax.set_title(f"worst {len(rows)} ops (red: a suggestion fixes it)", fontsize=9)
