"""The sites of a plan: the matmuls and convolutions with a weight operand, grouped by the ``overrides`` key
that selects them (their innermost scope or module path, else their source line), from a report's rows.

A site whose key also selects another site's scope (``"Dense_0"`` selects ``"Block_0/Dense_0"``) is one site
with the shorter key: an ``overrides`` entry cannot tell them apart. Products of two activations (attention's
``q @ k.T``) are no site: no float8 recipe quantises them by default, they run in the plan's compute dtype.

Framework-neutral: imports neither jax nor torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from fmp._core._scopes import is_location, matches
from fmp._report._fixes import location_key

Gemm = tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class Site:
    """One ``overrides`` key and the weight GEMMs ``(M, K, N)`` it selects, in program order."""

    key: str
    gemms: tuple[Gemm, ...]

    @property
    def flops(self) -> float:
        return float(sum(2 * m * k * n for m, k, n in self.gemms))

    @property
    def gemm(self) -> Gemm:
        """The site's largest GEMM."""
        return max(self.gemms, key=lambda g: g[0] * g[1] * g[2])


def sites_of(records: Sequence[Any]) -> tuple[Site, ...]:
    """The sites of a report run under a float8 policy (its ``float8`` rows carry their GEMM), in program
    order of their first row."""
    gemms: dict[str, list[Gemm]] = {}
    for r in records:
        if r.category != "float8" or r.gemm is None:
            continue
        key = r.scope or location_key(r)
        if key:
            gemms.setdefault(key, []).append(tuple(r.gemm))
    owner = {k: k for k in gemms}

    def root(k: str) -> str:
        while owner[k] != k:
            k = owner[k]
        return k

    keys = list(gemms)
    for a in keys:
        for b in keys:
            if a != b and not is_location(a) and not is_location(b) and matches(b, a):
                ra, rb = root(a), root(b)
                if ra != rb:  # the shorter key names the group (it selects the longer one's scope)
                    short, long_ = sorted((ra, rb), key=lambda k: (len(k), k))
                    owner[long_] = short
    out: dict[str, list[Gemm]] = {}
    for k in keys:
        out.setdefault(root(k), []).extend(gemms[k])
    return tuple(Site(k, tuple(g)) for k, g in out.items())
