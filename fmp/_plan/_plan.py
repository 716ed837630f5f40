"""``Plan``: a format for every matmul/convolution site, what the plan measured, and what the device model
predicts; and ``make_plan``, which both frameworks' faces call with their sites and their measurement.

Framework-neutral: imports neither jax nor torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from fmp._plan._device import Device, gemm_time
from fmp._plan._formats import FORMATS, Format
from fmp._plan._search import Candidates, Measure, Measured, Search, candidates, policy_and_overrides
from fmp._plan._sites import Site

_VERSION = 1


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """One site of a plan.

    Attributes:
      site: The ``overrides`` key that selects it (a scope, a module path or a source line).
      format: What it runs in (``"float8"``, ``"float8_rowwise"``, ``"bfloat16"``, ``"float32"``).
      gemm: Its largest GEMM, ``(M, K, N)``.
      error: The error it adds alone in ``format`` (the others in float32): relative L2 of the outputs or
        of the worst gradient leaf; 0 in its most precise format.
      flop_share: Its share of the FLOPs of every site.
      predicted_time: Seconds the device model gives its GEMMs in ``format`` (forward, and backward with
        gradients).
      errors: The error it adds alone in each format measured.
      why: Why it is not in its cheapest format (``""`` where it is): the rule or the budget that moved it,
        and the formats not offered.
    """

    site: str
    format: str
    gemm: tuple[int, int, int]
    error: float
    flop_share: float
    predicted_time: float
    errors: Mapping[str, float] = dataclasses.field(default_factory=dict)
    why: str = ""


@dataclasses.dataclass(frozen=True)
class Plan:
    """A precision plan: each matmul/convolution site's format, chosen from measured errors (see `fmp.plan`).

    Pass it on as ``fmp.autocast(fn, plan.policy, overrides=plan.overrides)`` (torch:
    ``fmp.torch.autocast_fx(module, inputs, plan.policy, overrides=plan.overrides)``).

    Attributes:
      rows: One ``PlanRow`` per site, in program order.
      budget: The error budget the plan meets: the one given, or, by default, the error it measured.
      error: The plan's measured error against float32: the larger of the outputs' relative L2 error and
        the worst gradient leaf's, over the batches.
      output_error: The outputs' part of ``error``.
      grad_error: The gradients' part (``None`` without gradients).
      predicted_time: The device model's seconds for every site's GEMMs.
      predicted_speedup: Every site's GEMMs in bfloat16 over ``predicted_time``.
      policy: The policy to run it under (a spec string).
      overrides: ``{site: policy spec}`` of every site in another format than ``policy``'s.
      device: The cost model's device (its name and table).
      framework: ``"jax"`` or ``"torch"``.
      runs: How many programs were run to choose it.

    Examples:
      >>> import os, tempfile
      >>> def loss(w, x):
      ...     with jax.named_scope("layer"):
      ...         return jnp.mean(jnp.tanh(x @ w) ** 2)
      >>> plan = fmp.plan(loss, jnp.eye(16) / 2, jnp.linspace(-1.0, 1.0, 64).reshape(4, 16))
      >>> print(str(plan).splitlines()[0])  # doctest: +ELLIPSIS
      precision plan (jax, h100): error ... within budget ..., predicted speedup 1.00x
      >>> path = os.path.join(tempfile.mkdtemp(), "plan.json")
      >>> plan.save(path)
      >>> fmp.Plan.load(path) == plan
      True
    """

    rows: tuple[PlanRow, ...]
    budget: float
    error: float
    output_error: float
    grad_error: float | None
    predicted_time: float
    predicted_speedup: float
    policy: str
    overrides: Mapping[str, str]
    device: Mapping[str, Any]
    framework: str
    runs: int = 0

    @property
    def formats(self) -> dict[str, str]:
        """``{site: format}``."""
        return {r.site: r.format for r in self.rows}

    def __str__(self) -> str:
        counts: dict[str, int] = {}
        for r in self.rows:
            counts[r.format] = counts.get(r.format, 0) + 1
        mix = ", ".join(f"{n} in {f}" for f, n in counts.items())
        head = (
            f"precision plan ({self.framework}, {self.device['name']}): error {self.error:.2e} within budget "
            f"{self.budget:.2e}, predicted speedup {self.predicted_speedup:.2f}x\n"
            f"over bfloat16 on the device model; sites: {mix}"
        )
        cols = ("site", "format", "gemm (M, K, N)", "error", "flops", "time (us)", "why")
        body = [
            (r.site, r.format, "x".join(map(str, r.gemm)), f"{r.error:.1e}", f"{r.flop_share:.0%}")
            + (f"{r.predicted_time * 1e6:.3g}", r.why)
            for r in self.rows
        ]
        widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c) for i, c in enumerate(cols)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip()]
        lines.append("-" * len(lines[0]))
        lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)).rstrip() for b in body]
        return head + "\n\n" + "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (``Plan.from_dict`` reads it back)."""
        out = dataclasses.asdict(self)
        out["overrides"] = dict(self.overrides)
        out["device"] = dict(self.device)
        out["version"] = _VERSION
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """The plan ``to_dict`` wrote."""
        if data.get("version") != _VERSION:
            raise ValueError(f"Plan.from_dict: a plan of version {data.get('version')!r}, this fmp reads {_VERSION}")
        fields = {k: v for k, v in data.items() if k != "version"}
        rows = tuple(PlanRow(**{**r, "gemm": tuple(r["gemm"])}) for r in fields.pop("rows"))
        return cls(rows=rows, **fields)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the plan as JSON (``fmp.Plan.load`` reads it back)."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1, allow_nan=True)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """The plan ``save`` wrote to ``path``."""
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


def check_budget(budget: Any) -> float | None:
    """``budget`` as a float (``None`` as is).

    Raises:
      TypeError, ValueError: Not a number, or not finite and > 0.
    """
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, int | float):
        raise TypeError(f"plan(budget=...) expects a relative L2 error such as 1e-2, or None, got {budget!r}")
    if not (math.isfinite(budget) and budget > 0):
        raise ValueError(f"plan(budget=...) must be finite and > 0 (a relative L2 error), got {budget!r}")
    return float(budget)


def make_plan(
    sites: Sequence[Site],
    measure: Measure,
    *,
    budget: float | None,
    formats: Sequence[Format],
    device: Device,
    grads: bool,
    framework: str,
) -> Plan:
    """Measures and chooses (``fmp._plan._search``) and returns the ``Plan``."""
    if not sites:
        raise ValueError(
            "plan: the program has no matmul or convolution with a weight operand under a scope, module path or "
            "source line an overrides key can select: there is nothing to plan"
        )
    cands = [candidates(s, formats, device, grads) for s in sites]
    empty = [c.site.key for c in cands if not c.chain]
    if empty:
        raise ValueError(f"plan(formats=...): {device.name} offers none of the formats for {empty[0]!r}")
    search = Search(cands, measure)
    search.measure_sites()
    why: dict[str, str] = {}
    if budget is None:
        chosen, why = search.default()
        got = search.run(chosen)
        met = got.error
    else:
        chosen, got = search.within(budget)
        met = budget
        for k, f in chosen.items():
            if f != search.cands[k].chain[0]:
                why[k] = f"{search.cands[k].chain[0].name} backed off to meet the budget"
    return _assemble(cands, search, chosen, why, got, met, device, framework)


def _assemble(
    cands: Sequence[Candidates],
    search: Search,
    chosen: Mapping[str, Format],
    why: Mapping[str, str],
    got: Measured,
    budget: float,
    device: Device,
    framework: str,
) -> Plan:
    total = sum(c.site.flops for c in cands) or 1.0
    grads = got.grad_error is not None
    rows = []
    for c in cands:
        f = chosen[c.site.key]
        reasons = [why.get(c.site.key, "")] + [f"{n}: {w}" for n, w in c.left_out]
        rows.append(
            PlanRow(
                site=c.site.key,
                format=f.name,
                gemm=c.site.gemm,
                error=search.error_of(c.site.key, f),
                flop_share=c.site.flops / total,
                predicted_time=c.times[c.chain.index(f)],
                errors={n: m.error for n, m in search.alone[c.site.key].items()},
                why="; ".join(r for r in reasons if r),
            )
        )
    time = sum(r.predicted_time for r in rows)
    bf16 = sum(gemm_time(device, FORMATS["bfloat16"], g, grads) for c in cands for g in c.site.gemms)
    policy, overrides = policy_and_overrides(chosen)
    return Plan(
        rows=tuple(rows),
        budget=budget,
        error=got.error,
        output_error=got.output_error,
        grad_error=got.grad_error,
        predicted_time=time,
        predicted_speedup=bf16 / time if time > 0 else 1.0,
        policy=policy,
        overrides=overrides,
        device=device.to_dict(),
        framework=framework,
        runs=search.runs,
    )
