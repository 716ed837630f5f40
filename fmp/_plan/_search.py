"""Choosing each site's format from measured errors: the default rule and the search under a budget.

**Candidates.** A site is offered the formats the device runs, cheapest first by the cost model, each
strictly more precise than the cheaper ones kept (a format slower *and* no more precise than another is never
worth choosing); a quantised format is left out where the size rule says it does not pay for any of the
site's GEMMs (``_device.does_not_pay``).

**Measurements.** ``measure(assignment)`` runs the program with every site in its assigned format against
the program in float32 and returns the error (``Measured``). Each site is measured alone in each of its
formats but the most precise, the others in float32: the error that site adds.

**The default rule** (``budget=None``): every site in its cheapest format, except where that format's
measured error overflows, flips discrete outputs, is above ``FAR`` (4) unit roundoffs of the format, or
stands out from the alike sites' (above the format's unit roundoff and ``STANDS_OUT`` (3) times the median
of the other sites' errors in the same format: the float8 report's layer-choice rule,
``fmp._report._float8_choice``); such a site takes the next format of its list and is held to the same
rule there. The combined plan is then measured; that error is its budget.

**Under a budget.** Errors combine, so a plan is verified by running it. The candidates form one sequence,
fixed by the per-site measurements alone: every site in its cheapest format, then, step by step, the site
whose format adds the largest error moves to its next format, until every site is in its most precise one.
Its predicted time never decreases along the sequence. The plan is the first assignment of the sequence
whose measured error is within the budget (assignments whose per-site errors, added in quadrature, exceed
``SLACK`` times the budget are not run). So a looser budget never gives a costlier plan, a tighter one
never a cheaper one, and the same measurements give the same plan.

Framework-neutral: imports neither jax nor torch.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Mapping, Sequence

from fmp._plan._device import Device, does_not_pay, gemm_time, offers
from fmp._plan._formats import FORMATS, Format
from fmp._plan._sites import Site
from fmp._report._compare import FAR
from fmp._report._float8_choice import STANDS_OUT

SLACK = 2.0  # an assignment whose quadrature estimate exceeds the budget this many times is not run


@dataclasses.dataclass(frozen=True)
class Measured:
    """One run of an assignment against float32 (the worst of the batches).

    Attributes:
      error: The larger of ``output_error`` and ``grad_error``.
      output_error: Relative L2 error of the outputs.
      grad_error: The largest relative L2 error of a gradient leaf (``None`` without gradients).
      nonfinite: An inf or NaN appeared where float32 has finite values.
      flips: Changed elements of integer or boolean outputs.
    """

    error: float
    output_error: float
    grad_error: float | None = None
    nonfinite: bool = False
    flips: int = 0


Assignment = Mapping[str, Format]
Measure = Callable[[Assignment], Measured]


@dataclasses.dataclass(frozen=True)
class Candidates:
    """A site's formats, cheapest first, with their predicted times; ``left_out``: why others are not offered."""

    site: Site
    chain: tuple[Format, ...]
    times: tuple[float, ...]
    left_out: tuple[tuple[str, str], ...]


def candidates(site: Site, formats: Sequence[Format], device: Device, grads: bool) -> Candidates:
    """The formats ``site`` is offered on ``device`` (see the module docstring)."""
    left_out: list[tuple[str, str]] = []
    timed = []
    for f in formats:
        if not offers(device, f):
            left_out.append((f.name, f"{device.name} has no {f.kind} GEMM"))
            continue
        small = [does_not_pay(device, f, g) for g in site.gemms]
        if all(small):
            left_out.append((f.name, f"does not pay ({small[0]})"))
            continue
        timed.append((sum(gemm_time(device, f, g, grads) for g in site.gemms), f.unit_roundoff, f))
    chain, times, finest = [], [], math.inf
    for t, u, f in sorted(timed, key=lambda x: (x[0], -x[1], x[2].name)):
        if u < finest:
            chain.append(f)
            times.append(t)
            finest = u
        else:
            left_out.append((f.name, "no faster than a format at least as precise"))
    return Candidates(site, tuple(chain), tuple(times), tuple(left_out))


def policy_and_overrides(assignment: Assignment) -> tuple[str, dict[str, str]]:
    """The policy and ``overrides`` that run ``assignment``: the policy of the quantised format most sites
    have (else ``mixed_bfloat16``: the other ops follow the rule table in bfloat16), and one key for each
    site in another format."""
    counts: dict[str, int] = {}
    for f in assignment.values():
        if f.quantised:
            counts[f.name] = counts.get(f.name, 0) + 1
    order = list(FORMATS)
    base = min(counts, key=lambda n: (-counts[n], order.index(n))) if counts else "bfloat16"
    policy = FORMATS[base].policy
    return policy, {k: f.policy for k, f in assignment.items() if f.name != base}


class Search:
    """The measurements of one program's sites, and the choices made from them (cached)."""

    def __init__(self, cands: Sequence[Candidates], measure: Measure) -> None:
        self.cands = {c.site.key: c for c in cands}
        self._measure = measure
        self._runs: dict[tuple[tuple[str, str], ...], Measured] = {}
        self.alone: dict[str, dict[str, Measured]] = {}

    @staticmethod
    def _key(assignment: Assignment) -> tuple[tuple[str, str], ...]:
        return tuple(sorted((k, f.name) for k, f in assignment.items()))

    def run(self, assignment: Assignment) -> Measured:
        key = self._key(assignment)
        if key not in self._runs:
            self._runs[key] = self._measure(assignment)
        return self._runs[key]

    @property
    def runs(self) -> int:
        """How many assignments were measured."""
        return len(self._runs)

    def measure_sites(self) -> None:
        """Each site alone in each of its formats but the most precise, the others in float32 (through the
        measurement's ``many`` where it has one: several programs compiled together cost less)."""
        f32 = {k: FORMATS["float32"] for k in self.cands}
        jobs = [(key, f, {**f32, key: f}) for key, c in self.cands.items() for f in c.chain[:-1]]
        many = getattr(self._measure, "many", None)
        if many is not None:
            todo = [a for _, _, a in jobs if self._key(a) not in self._runs]
            for a, m in zip(todo, many(todo), strict=True):
                self._runs[self._key(a)] = m
        for key, f, a in jobs:
            self.alone.setdefault(key, {})[f.name] = self.run(a)

    def error_of(self, key: str, fmt: Format) -> float:
        """The error ``key`` adds alone in ``fmt`` (0 in its most precise format; inf with non-finite values)."""
        m = self.alone.get(key, {}).get(fmt.name)
        if m is None:
            return 0.0
        return math.inf if m.nonfinite else m.error

    def _too_far(self, key: str, fmt: Format) -> str:
        """Why the default rule moves ``key`` out of ``fmt`` (``""``: it stays)."""
        m = self.alone[key].get(fmt.name)
        if m is None:
            return ""
        if m.nonfinite:
            return f"{fmt.name} overflows"
        if m.flips:
            return f"{fmt.name} flips {m.flips} discrete outputs"
        u = fmt.unit_roundoff
        if m.error > FAR * u:
            return f"{fmt.name} adds {m.error:.1e} > {FAR:g}u"
        peers = [self.error_of(k, fmt) for k, c in self.cands.items() if k != key and fmt in c.chain[:-1]]
        peers = [e for e in peers if math.isfinite(e)]
        if peers and m.error > u:
            median = statistics.median(peers)
            if m.error > STANDS_OUT * median:
                ratio = "inf" if median == 0 else f"{m.error / median:.0f}"
                return f"{fmt.name} stands out: {m.error:.1e}, {ratio}x the median of alike sites"
        return ""

    def default(self) -> tuple[dict[str, Format], dict[str, str]]:
        """The default rule's assignment and, per moved site, why."""
        out, why = {}, {}
        for key, c in self.cands.items():
            reasons = []
            for f in c.chain:
                reason = self._too_far(key, f)
                if not reason:
                    out[key] = f
                    break
                reasons.append(reason)
            why[key] = "; ".join(reasons)
        return out, why

    def sequence(self) -> list[dict[str, Format]]:
        """Every site in its cheapest format, then the worst site one format up at a time (module docstring)."""
        at = {k: 0 for k in self.cands}
        order = list(self.cands)
        seq = [{k: self.cands[k].chain[0] for k in order}]
        while True:
            open_ = [k for k in order if at[k] < len(self.cands[k].chain) - 1]
            if not open_:
                return seq
            worst = max(open_, key=lambda k: (self.error_of(k, self.cands[k].chain[at[k]]), -order.index(k)))
            at[worst] += 1
            seq.append({k: self.cands[k].chain[at[k]] for k in order})

    def estimate(self, assignment: Assignment) -> float:
        """The per-site errors of ``assignment`` added in quadrature."""
        return math.sqrt(sum(self.error_of(k, f) ** 2 for k, f in assignment.items()))

    def within(self, budget: float) -> tuple[dict[str, Format], Measured]:
        """The first assignment of ``sequence`` whose measured error is within ``budget``.

        Raises:
          ValueError: None is (the message gives the smallest error measured, the most precise plan's).
        """
        seq = self.sequence()
        for a in seq:
            if self.estimate(a) > SLACK * budget:
                continue
            m = self.run(a)
            if m.error <= budget:
                return a, m
        best = self.run(seq[-1])
        raise ValueError(
            f"plan(budget={budget:g}): no plan meets it; the most precise one (every site in its most precise "
            f"format) measures {best.error:.3g}. Pass a budget of at least that, or formats with float32"
        )
