"""Which matmuls to keep out of float8, from the report's own numbers: the ones whose float8 error stands out
from the rest (an accuracy fix), and the ones too small for float8 to pay on a GPU (a speed choice).

**Stands out.** A float8 matmul that quantises well-scaled operands adds about half a unit roundoff of e4m3
(u = 2⁻⁴) by itself, whatever its shape: on the float8 guide's small language model the 13 float8 matmuls add
3.5e-2 to 4.0e-2 each (0.57u to 0.64u, within 1.1x of their median). A matmul whose operands the format cannot
hold (one channel 10⁴ times the rest sets the scale, the rest falls to e4m3's subnormals) adds far more. So a
float8 matmul **stands out** when its ``added_error`` is above both ``STANDS_OUT`` (3) times the median
``added_error`` of the report's other float8 matmuls and one unit roundoff of its float8 format (more than
float8 rounding can explain; this also keeps a report whose float8 matmuls are nearly exact quiet). Its row
gets a suggestion that keeps it in the compute dtype (``overrides={"LM/Dense_0": "mixed_bfloat16"}``): one
step out of float8, not float32. A report with one float8 matmul has no peers: only the rule every op is held
to (``_blame.needs_fix``) applies. Flips (a router's ``top_k``) are charged by ``_blame`` as for bfloat16; a
float8 culprit's fix is the compute dtype there too (``_fixes.keep_value``).

**Too small.** Float8 pays on a GPU only where the faster GEMM repays the quantisation passes around it.
The size rule is torchao's (``torchao.float8._auto_filter_for_recipe``, torchao 0.18, whose docstring calls its
thresholds heuristics from microbenchmarks on H100 GPUs; its float8 README's performance section gives, for
M, K, N = 1024, 2048, 1024, a float8 speedup of 0.80, for 4096, 8192, 16384 of 1.39): with ``K`` the weight's
input features and ``N`` its output features, a layer stays in bfloat16 when ``K`` or ``N`` is not a multiple
of 16 (the float8 GEMM's requirement), under tensorwise scaling when ``K <= 4096 and N <= 1024``, under
rowwise scaling when ``N <= 2048``, ``K <= 1024``, or ``K <= 2048 and N <= 4096``. ``M`` (tokens) does not
enter, as in torchao's filter. fmp applies the tensorwise thresholds to its ``delayed`` recipe (per-tensor
scales) and the rowwise ones to ``blockwise`` and the block-scaled formats ``mxfp8``, ``mxfp4`` and ``nvfp4``
(finer scales, no published rule); a mark on such a matmul names its own scaling and the rule it borrows
(``"nvfp4 (rowwise rule): N <= 2048"``). Transformer
Engine's "GEMM Speedups Across Precisions" page says the same in general: the speedup, quantisation included,
depends on the model's matrix dimensions. fmp's own measurement agrees: on an H200, GPT-2 small (d = 768,
every matmul small by this rule under rowwise, two of four per block under tensorwise) ran its float8 step
7% (tensorwise) and 19% (rowwise) slower than bfloat16, and one 8192³ matmul 1.26x (tensorwise) and 1.29x
(rowwise) faster (docs/benchmarks.md, "On a GPU"). The mark is information (``OpRecord.float8_too_small``, a line in the
report); ``Report.suggested(small_float8=True)`` adds the overrides that keep those matmuls in bfloat16.

Framework-neutral: imports neither jax nor torch.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from fmp._core._dtypes import BLOCK_FORMATS
from fmp._core._rules import RuleSet
from fmp._report._compare import FAR, unit_roundoff
from fmp._report._fixes import fix_code, keep_value, location_key
from fmp._report._row import OpRecord

# a float8 matmul whose own error is this many times the median of the other float8 matmuls' (and above its
# float8 format's unit roundoff) stands out: its row gets a suggestion that keeps it in the compute dtype
STANDS_OUT = 3.0

# torchao's size thresholds (see the module docstring): a GEMM whose (K, N) lies in one of its scaling
# family's boxes (K <= k_max and N <= n_max) is too small for float8 to pay on a GPU
_INF = math.inf
SMALL_BOXES: dict[str, tuple[tuple[float, float], ...]] = {
    "tensorwise": ((4096, 1024),),
    "rowwise": ((_INF, 2048), (1024, _INF), (2048, 4096)),
}
# fmp's recipes (a Float8Recipe's scaling, as a float8 row's detail names it) by the torchao rule they follow
FAMILY = {"tensorwise": "tensorwise", "delayed": "tensorwise", "rowwise": "rowwise", "blockwise": "rowwise"}
FAMILY.update(dict.fromkeys(BLOCK_FORMATS, "rowwise"))  # mxfp8, mxfp4, nvfp4: blocks finer than rows
ALIGN = 16  # the float8 GEMM takes K and N in multiples of this


def _box_text(k_max: float, n_max: float) -> str:
    parts = [f"K <= {k_max:g}" if math.isfinite(k_max) else "", f"N <= {n_max:g}" if math.isfinite(n_max) else ""]
    return " and ".join(p for p in parts if p)


def _ran(family: str, scalings: Iterable[str]) -> str:
    """What ran, and the rule it follows where that is another scaling's: ``"rowwise"``, ``"nvfp4 (rowwise
    rule)"``, ``"blockwise, mxfp8 (rowwise rule)"``."""
    names = sorted(set(scalings))
    return family if names == [family] else f"{', '.join(names)} ({family} rule)"


def rule_text(family: str, scalings: Iterable[str] = ()) -> str:
    """The size rule of a scaling family in words, naming the ``scalings`` that follow it (the family alone
    by default): ``"tensorwise: K <= 4096 and N <= 1024"``, ``"nvfp4 (rowwise rule): N <= 2048, or ..."``."""
    return f"{_ran(family, scalings or (family,))}: " + ", or ".join(_box_text(*box) for box in SMALL_BOXES[family])


def too_small(k: int, n: int, scaling: str) -> str:
    """Why a ``K x N`` weight's float8 matmul does not pay on a GPU under ``scaling`` (an fmp recipe's scaling
    or its family), ``""`` when it pays: ``"K or N not a multiple of 16"``, or the box of torchao's size rule
    that holds it, named by what ran (``"tensorwise: K <= 4096 and N <= 1024"``, ``"nvfp4 (rowwise rule):
    N <= 2048"``)."""
    if k % ALIGN or n % ALIGN:
        return f"K or N not a multiple of {ALIGN}"
    family = FAMILY.get(scaling, scaling)
    for k_max, n_max in SMALL_BOXES.get(family, ()):
        if k <= k_max and n <= n_max:
            return f"{_ran(family, (scaling,))}: {_box_text(k_max, n_max)}"
    return ""


def scaling_of(row: OpRecord) -> str:
    """The scaling a float8 row ran (``"rowwise"``) from its ``detail`` (``"rowwise, scaled_mm (linear)"``,
    ``"tensorwise (no state)"``)."""
    return row.detail.split(" ", 1)[0].rstrip(",")


def _added(rows: Iterable[OpRecord]) -> dict[int, float]:
    return {
        r.index: r.added_error
        for r in rows
        if r.category == "float8" and r.added_error is not None and math.isfinite(r.added_error)
    }


def stands_out(row: OpRecord) -> bool:
    """The float8 row's own error stands out from the other float8 matmuls' (the module docstring's rule)."""
    ratio = row.added_vs_float8_median
    return ratio is not None and ratio > STANDS_OUT and (row.added_error or 0.0) > unit_roundoff(row)


def choose(records: Sequence[OpRecord], rules: RuleSet, framework: str = "jax") -> tuple[OpRecord, ...]:
    """``records`` with each float8 row's size mark (``float8_too_small``, from its ``gemm``) and, where
    compared, its ``added_vs_float8_median``; a float8 row that ``stands_out`` and has no fix yet gets the
    one that keeps it in the compute dtype (``fix_code``)."""
    added = _added(records)
    out = []
    for r in records:
        if r.category != "float8":
            out.append(r)
            continue
        changes: dict[str, Any] = {}
        if r.gemm is not None:
            changes["float8_too_small"] = too_small(r.gemm[1], r.gemm[2], scaling_of(r))
        others = [e for i, e in added.items() if i != r.index]
        if r.index in added and others:
            median = statistics.median(others)
            changes["added_vs_float8_median"] = added[r.index] / median if median > 0 else math.inf
        r = dataclasses.replace(r, **changes)
        if r.suggestion is None and stands_out(r):
            r = dataclasses.replace(r, suggestion=fix_code([r], rules, framework) or None, culprits=(r.index,))
        out.append(r)
    return tuple(out)


def clause(records: Sequence[OpRecord]) -> str:
    """The verdict's words on the stand-out rule, ``""`` for a report without compared float8 matmuls."""
    added = _added(records)
    if len(added) < 2:
        return ""
    u8 = max(unit_roundoff(r) for r in records if r.index in added)
    return (
        f"; a float8 matmul, against float8's u8 = {u8:.1e}: above {FAR:g}u8, or above u8 and {STANDS_OUT:g}x "
        f"the median float8 matmul's ({statistics.median(added.values()):.1e})"
    )


def small_fixes(records: Iterable[OpRecord]) -> list[str]:
    """The overrides that keep each float8 matmul marked ``float8_too_small`` in its compute dtype (by scope,
    else source location; a row with neither is left out: only the rule table could move it, everywhere)."""
    out = []
    for r in records:
        key = (r.scope or location_key(r)) if r.category == "float8" and r.float8_too_small else ""
        if key:
            out.append(f'overrides={{"{key}": "{keep_value(r)}"}}')
    return out


def size_line(records: Sequence[OpRecord]) -> str:
    """The report's line on the size mark, ``""`` when no float8 matmul has a size."""
    sized = [r for r in records if r.category == "float8" and r.gemm is not None]
    small = [r for r in sized if r.float8_too_small]
    if not sized:
        return ""
    ran: dict[str, set[str]] = {}  # each family's scalings in the report
    for r in sized:
        ran.setdefault(FAMILY.get(scaling_of(r), scaling_of(r)), set()).add(scaling_of(r))
    rules = "; ".join(rule_text(f, ran[f]) for f in sorted(ran.keys() & SMALL_BOXES.keys())) or "none published"
    head = f"{len(small)} of {len(sized)} float8 matmuls are below the size where float8 pays on a GPU"
    rule = f"(torchao's rule from H100 timings, K x N of the weight: {rules}; or not multiples of {ALIGN})"
    if not small:
        return f"{head} {rule}"
    tail = "marked 'small' by their flops; suggested(small_float8=True) keeps them in the compute dtype"
    if len(small) == len(sized):
        tail += ", which here is the policy without float8"
    return f"{head} {rule}: {tail}"
