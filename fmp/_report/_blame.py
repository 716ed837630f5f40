"""Who is charged with an op's error, and the fix to suggest: one rule for ``fmp.explain(compare=True)`` (JAX:
forward, loops, gradients) and ``fmp.torch.explain_fx(compare=True)``.

An op's row gets a fix for its own error (``needs_fix``: far above its dtype's roundoff, or non-finite), or,
where its error is inherited, a fix where its inputs lost their precision: a discrete op whose outputs
changed (``flips``: ``top_k`` on bfloat16 logits) or an op that magnifies its inputs' small error
(``amplified``: ``cos`` of angles rounded to bfloat16). Those are charged to the rows ``charged`` finds
upstream: the nearest ones that rounded values to a low-precision dtype, looked through ops that run in
float32 (a softmax between a router's logits and its ``top_k``) and ops that round nothing (a slice of the
rotary angles: ``passes_on``). Each framework hands in its graph as two functions (the inputs of a node,
the row of a node); ``fill`` writes the statistics and the fix into a row.

Framework-neutral: imports neither jax nor torch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

from fmp._core._dtypes import LOW_PRECISION
from fmp._core._rules import RuleSet
from fmp._report._compare import AMPLIFIED, FAR, Stats, unit_roundoff, with_stats
from fmp._report._fixes import fix_code
from fmp._report._row import OpRecord

# how many ops upstream an inherited error is traced to the rows that rounded its inputs
WALK = 16

# a rounding row whose output error is this many times the error it added is looked through by ``charged``
INHERITED = 4.0


def needs_fix(row: OpRecord) -> bool:
    """The op's own error is far above its dtype's roundoff, or it overflows."""
    if row.added_error is None:
        return False
    return not math.isfinite(row.added_error) or row.added_error > FAR * unit_roundoff(row)


def amplified(row: OpRecord, producers: Sequence[OpRecord] = (), inputs: Sequence[OpRecord] = ()) -> bool:
    """The op's output error is far above its dtype's roundoff and ``AMPLIFIED`` times the error of the rows
    that rounded its inputs (``producers``), of the rows that made its inputs (``inputs``) and its own: an
    ill-conditioned op (``cos`` of a large angle, a cancelling subtraction) that magnifies a small rounding of
    its inputs. An op after it (the sum of a softmax's ``exp``) inherits the magnified error from its inputs:
    it is not amplified itself."""
    if not row.error or not producers or not math.isfinite(row.error):
        return False
    inherited = max((p.error or 0.0) for p in (*producers, *inputs))
    own = row.added_error or 0.0
    return row.error > FAR * unit_roundoff(row) and row.error > AMPLIFIED * max(inherited, own)


def may_inherit(row: OpRecord) -> bool:
    """The row's error may be its inputs' (flips, or an error far above its dtype's roundoff): only then do
    the rows upstream matter to its fix."""
    return bool(row.flips) or (row.error or 0.0) > FAR * unit_roundoff(row)


def passes_on(row: OpRecord) -> bool:
    """The op rounded nothing: it moved (sliced, viewed) or exactly computed values already in its dtypes, so
    whatever rounded them lies upstream."""
    return row.added_error == 0.0 and set(row.out_after) <= set(row.in_after)


def rounds_down(row: OpRecord) -> bool:
    """The op made low-precision values and rounded them itself: an inherited error is charged to it."""
    return any(n in LOW_PRECISION for n in row.out_after) and not passes_on(row)


def passes_on_most(row: OpRecord) -> bool:
    """The op rounded, but its output carries ``INHERITED`` times more error than it added: most of it came
    from upstream (``x - max(x)`` in bfloat16 inside a softmax, after a router's float8 logits)."""
    added, error = row.added_error, row.error
    return added is not None and error is not None and math.isfinite(error) and error > INHERITED * added


def charged(
    start: Iterable[Hashable],
    inputs: Callable[[Any], Iterable[Hashable]],
    row: Callable[[Any], OpRecord | None],
    through: bool = False,
) -> list[OpRecord] | None:
    """The rows an op's inherited error is charged to: the nearest rows upstream that rounded values to a
    low-precision dtype (``rounds_down``), found from the op's inputs ``start`` through every other node
    (float32 ops, ops that round nothing, nodes without a row) up to ``WALK`` steps; in program order.
    ``through``: also past such a row whose inputs already carried error (its ``error`` above its
    ``added_error``) to the rows that rounded those: every rounding an amplified error is made of.

    Without ``through``, a rounding row that mostly passes on its inputs' error (``passes_on_most``:
    ``x - max(x)`` in bfloat16 inside a softmax, after a router's float8 logits) is looked through: the rows
    beyond it are charged, unless its error is ``AMPLIFIED`` times theirs (then it magnified them, as ``cos``
    of rounded angles, and is charged itself), or nothing beyond it is found.

    ``None`` when a row reached has flips itself: the error comes from a discrete op upstream, whose own
    row names the fix. ``inputs(node)``: the nodes it reads; ``row(node)``: its compared row, or ``None``.
    """
    found: dict[int, OpRecord] = {}
    looked: dict[int, OpRecord] = {}
    seen: set[Hashable] = set()
    frontier: list[tuple[Hashable, OpRecord | None]] = [(node, None) for node in start]
    for _ in range(WALK):
        upstream: list[tuple[Hashable, OpRecord | None]] = []
        for node, via in frontier:
            if node in seen:
                continue
            seen.add(node)
            made = row(node)
            if made is not None and made.flips:
                return None
            if made is not None and rounds_down(made) and not through and passes_on_most(made):
                looked[made.index] = made
                upstream += [(n, made) for n in inputs(node)]
            elif made is not None and rounds_down(made):
                magnified = via is not None and (via.error or 0.0) > AMPLIFIED * (made.error or 0.0)
                culprit = via if via is not None and magnified else made
                found[culprit.index] = culprit
                if through and (made.error or 0.0) > (made.added_error or 0.0):
                    upstream += [(n, via) for n in inputs(node)]
            else:
                upstream += [(n, via) for n in inputs(node)]
        frontier = upstream
    found = found or looked
    return [found[i] for i in sorted(found)]


def culprits(
    row: OpRecord, producers: Sequence[OpRecord] | None = (), inputs: Sequence[OpRecord] = ()
) -> list[OpRecord]:
    """The rows a fix of ``row`` runs in float32, ``[]`` when it needs none.

    A discrete op whose outputs changed, or an op that magnifies its inputs' small error (``amplified``), is
    fixed where its inputs lost their precision: ``producers``, the rows ``charged`` with it (empty when the
    op rounded its inputs down itself; ``None`` when flips upstream made them), are named when they ran in
    low precision; with none, the flips are inherited. Any other op is fixed where its own error is large.
    ``inputs``: the rows that made its inputs (an error they already had is not magnified by ``row``).
    """
    if producers is None:  # flips upstream: a discrete op's changed outputs are theirs
        if row.flips:
            return []
        producers = ()
    low = [p for p in producers if any(n in LOW_PRECISION for n in p.out_after)]
    if row.flips:
        rounds_itself = not producers and any(n in LOW_PRECISION for n in row.in_after)
        if not (low or rounds_itself):
            return []
        return low or [row]
    if low and amplified(row, producers, inputs):
        return low
    return [row] if needs_fix(row) else []


def suggestion(
    row: OpRecord,
    rules: RuleSet,
    producers: Sequence[OpRecord] | None = (),
    framework: str = "jax",
    inputs: Sequence[OpRecord] = (),
) -> str | None:
    """The fix of ``row`` (``fix_code`` of its ``culprits``), or ``None``."""
    found = culprits(row, producers, inputs)
    return fix_code(found, rules, framework) if found else None


def fill(
    row: OpRecord,
    stats: Stats,
    added_error: Any,
    rules: RuleSet,
    upstream: Callable[..., list[OpRecord] | None] | None = None,
    framework: str = "jax",
    inputs: Sequence[OpRecord] = (),
) -> OpRecord:
    """``row`` with its statistics (``stats``: of its outputs against the reference; ``added_error``: its own)
    and its fix (``suggestion``, and the rows it runs in float32: ``culprits``). ``upstream(through=False)`` gives the
    rows ``charged`` with an inherited error (asked only where the row may have inherited it); ``None`` when
    the op rounded its inputs down itself. ``inputs``: the compared rows that made the op's inputs."""
    row = with_stats(row, stats, added_error)
    producers = upstream() if upstream is not None and may_inherit(row) else ()
    found = culprits(row, producers, inputs)
    if producers and not row.flips and found != [row] and found:  # amplified: every rounding it magnifies
        found = culprits(row, upstream(through=True), inputs)  # type: ignore[misc]
    if not found:
        return row
    fix = fix_code(found, rules, framework)
    return dataclasses.replace(row, suggestion=fix, culprits=tuple(c.index for c in found))


S = TypeVar("S")


class Job(NamedTuple, Generic[S]):
    """A compared row and its statistics: ``Stats`` once known, or what gives them (a JAX ``Deferred``, an
    output of the compiled comparison)."""

    row: int  # the row's index in the records
    out: S  # the statistics of the op's outputs against the reference
    alone: S | None  # the statistics of the op alone (its added error); None where it could not run alone
    down: bool  # the op's rule rounded its inputs down itself: no inherited error is charged upstream
    node: Hashable = None  # where the walk upstream starts (a torch graph node); None: the row itself


def fill_rows(
    records: list[OpRecord],
    jobs: Sequence[Job[Stats]],
    rules: RuleSet,
    makers: Mapping[int, Sequence[int]] | Callable[[Any], Iterable[Hashable]],
    row: Callable[[Any], OpRecord | None] | None = None,
    framework: str = "jax",
) -> None:
    """Writes each job's statistics into its row of ``records``, with the blame and suggestion they call
    for (``fill``). The graph the blame walks: ``makers``, the rows that made each compared row's inputs
    (JAX), or ``makers(node)``, the nodes a node reads, with ``row(node)``, a node's compared row or
    ``None`` (torch: a graph's nodes)."""
    inputs = (lambda n: makers.get(n, ())) if isinstance(makers, Mapping) else makers
    row = row or records.__getitem__
    for job in jobs:  # in program order: the rows upstream of one are filled before it
        start = job.row if job.node is None else job.node
        upstream = functools.partial(charged, inputs(start), inputs, row)
        made = [r for n in inputs(start) if (r := row(n)) is not None]
        added = None if job.alone is None else job.alone.error
        filled = fill(records[job.row], job.out, added, rules, None if job.down else upstream, framework, made)
        records[job.row] = filled


def backward_suggestion(row: OpRecord, forward: Sequence[OpRecord], rules: RuleSet) -> str | None:
    """The fix of a backward row whose own error is large or non-finite: the forward rows of the op it
    differentiates (the same source line and scope) that ran in low precision, since a backward op runs in
    the dtypes its forward op's rule gave it; ``None`` where the line is unknown."""
    if not (row.nonfinite or needs_fix(row)) or not row.source_full:
        return None
    rows = [
        f
        for f in forward
        if f.source_full == row.source_full
        and f.scope == row.scope
        and f.category not in ("cast", "user_cast")
        and any(n in LOW_PRECISION for n in f.out_after)
    ]
    return fix_code(rows, rules) if rows else None
