"""How far one run's values are from a reference run's: the statistics both ``fmp.explain(compare=True)``
and ``fmp.torch.explain_fx(compare=True)`` report, written once for both frameworks.

Framework-neutral: a framework hands in its values and a small adapter (``CompareOps``: the dtype name of a
value, a conversion, the statistics' parts of one pair) and this module does the rest: which values are
floating or discrete (``value_kind``), a reference value rounded as the policy run saw it (``round_as``,
``as_arrived``),
the error statistics of an op's outputs (``output_stats``, from ``array_parts`` and ``combine``) and the
row they fill (``with_stats``). Who is charged with an error and the fix to suggest: ``_blame``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from fmp._core._dtypes import UNIT_ROUNDOFF
from fmp._report._row import OpRecord


class Stats(NamedTuple):
    """The statistics of an op's outputs against the reference: the row fields (``OpRecord``) of the same
    names. ``error`` is ``None`` when no output is floating."""

    error: float | None
    sqnr_db: float | None
    max_abs_error: float | None
    nonfinite: bool
    flips: int
    ref_max: float | None


class Parts(NamedTuple):
    """One floating output's part of ``Stats`` (``array_parts``): any array library's scalars."""

    ref_max: Any  # largest |reference|
    ref_sq: Any  # sum of squares of the reference, scaled by ref_max
    diff_max: Any  # largest |difference|
    diff_sq: Any  # sum of squares of the difference, scaled by diff_max
    bad: Any  # a non-finite difference
    over: Any  # a non-finite value where the reference is finite


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


def combine(parts: Sequence[Parts], flips: int = 0) -> Stats:
    """``output_stats`` from the ``array_parts`` of each floating output (any array library's scalars) and the
    count of changed discrete elements."""
    if not parts:
        return Stats(None, None, None, False, flips, None)
    signal = noise = max_abs = ref_max = 0.0
    nonfinite = False
    for part in parts:
        r_max, r_sq, d_max, d_sq, bad, over = (float(x) for x in part)
        nonfinite |= bool(over)
        ref_max = max(ref_max, r_max)
        signal += r_max * r_max * r_sq
        noise += math.inf if bad else d_max * d_max * d_sq
        max_abs = max(max_abs, math.inf if bad else d_max)
    if noise == 0.0:
        return Stats(0.0, math.inf, max_abs, nonfinite, flips, ref_max)
    error = math.sqrt(noise / signal) if signal > 0.0 else math.inf
    sqnr = 10.0 * math.log10(signal / noise) if signal > 0.0 and math.isfinite(noise) else -math.inf
    return Stats(error, sqnr, max_abs, nonfinite, flips, ref_max)


def array_parts(xp: Any, p: Any, r: Any, top: Any = None) -> Parts:
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
    return Parts(r_max, r_sq, d_max, d_sq, xp.any(~ok), xp.any(~xp.isfinite(p) & finite))


def unit_roundoff(row: OpRecord) -> float:
    """The unit roundoff of the lowest-precision floating dtype the op ran with."""
    names = [n for n in (*row.in_after, *row.out_after) if n in UNIT_ROUNDOFF]
    return max((UNIT_ROUNDOFF[n] for n in names), default=UNIT_ROUNDOFF["float32"])


class CompareOps(Protocol):
    """What the comparison needs from an array library (JAX or torch): the rest is written once, here."""

    def dtype_name(self, x: Any) -> str:
        """The dtype's name (``"bfloat16"``, ``"int32"``, ``"bool"``); ``""`` for a value that is no array or
        whose dtype has no such name (a PRNG key)."""
        ...

    def astype(self, x: Any, like: Any) -> Any:
        """``x`` converted to the dtype of ``like``."""
        ...

    def parts(self, p: Any, r: Any) -> Parts:
        """``array_parts`` of one floating output against its reference, in ``wide_dtype`` of the two."""
        ...

    def changed(self, p: Any, r: Any) -> int:
        """How many elements of a discrete output differ from its reference."""
        ...


def value_kind(name: str) -> str:
    """``"float"`` for a floating dtype name (float8 to float64, bfloat16), ``"discrete"`` for an integer or
    boolean one (compared as flips), ``""`` for anything else (complex, keys, no array)."""
    if name.startswith(("float", "bfloat")):
        return "float"
    return "discrete" if name == "bool" or name.startswith(("int", "uint")) else ""


def wide_dtype(*names: str) -> str:
    """The dtype the statistics of a pair are computed in: float64 when either is, float32 otherwise (the
    sums are scaled, so none overflows)."""
    return "float64" if "float64" in names else "float32"


def round_as(ops: CompareOps, ref: Any, like: Any, back: bool = True) -> Any:
    """``ref`` rounded to the floating dtype of ``like`` (and ``back`` to its own): a reference value as it
    reached an op in the policy run. ``ref`` itself (the same object) when the dtypes agree or either value
    is not floating."""
    a, b = ops.dtype_name(ref), ops.dtype_name(like)
    if a == b or value_kind(a) != "float" or value_kind(b) != "float":
        return ref
    rounded = ops.astype(ref, like)
    return ops.astype(rounded, ref) if back else rounded


def as_arrived(ops: CompareOps, refs: Sequence[Any], likes: Sequence[Any]) -> tuple[list[Any], list[Any] | None]:
    """The inputs an op's added error is measured on: the reference inputs ``refs`` rounded to the dtypes
    they reached the op in under the policy (those of ``likes``), for the op under the policy; and the same
    rounded back to their own dtypes, for the op as written (``None`` when nothing was rounded: the
    reference output is then its baseline). So a rounding where a value was made counts at the op that made
    it, and a cast an op's rule inserts counts at that op."""
    arrived = [round_as(ops, r, x, back=False) for r, x in zip(refs, likes, strict=True)]
    if all(a is r for a, r in zip(arrived, refs, strict=True)):
        return arrived, None
    # ``round_as(ops, r, x)``, from the rounding already made: one conversion per value, not two
    return arrived, [r if a is r else ops.astype(a, r) for a, r in zip(arrived, refs, strict=True)]


def split_outputs(ops: CompareOps, outs: Sequence[Any], refs: Sequence[Any]) -> tuple[list, list]:
    """The ``(policy, reference)`` pairs of the floating outputs (compared by their error) and of the
    discrete ones (compared by their flips); other outputs are not compared."""
    floats, discrete = [], []
    for p, r in zip(outs, refs, strict=True):
        kind = value_kind(ops.dtype_name(r))
        if kind == "discrete":
            discrete.append((p, r))
        elif kind == "float" and value_kind(ops.dtype_name(p)) == "float":
            floats.append((p, r))
    return floats, discrete


def output_stats(ops: CompareOps, outs: Sequence[Any], refs: Sequence[Any]) -> Stats:
    """The ``Stats`` of ``outs`` against ``refs``.

    ``error`` is the relative L2 error over all floating outputs (``None`` when there are none);
    ``nonfinite`` says an inf/NaN appeared where the reference is finite (then ``error`` is inf); ``flips``
    counts changed integer and boolean elements. Sums of squares are scaled, so no value overflows them.
    """
    floats, discrete = split_outputs(ops, outs, refs)
    return combine([ops.parts(p, r) for p, r in floats], sum(ops.changed(p, r) for p, r in discrete))


def with_stats(row: OpRecord, stats: Stats, added_error: Any) -> OpRecord:
    """``row`` with the statistics of its outputs (``output_stats``) and the error it adds by itself."""
    return dataclasses.replace(row, added_error=added_error, **stats._asdict())
