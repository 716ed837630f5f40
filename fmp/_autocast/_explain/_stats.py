"""Error statistics of one equation's outputs against the reference run (JAX arrays): the comparison core's
(``fmp._report._compare``, shared with the torch side) on ``JAX_OPS``, its adapter for JAX arrays.

The statistics are computed without waiting for the device: ``Deferred`` starts them (large arrays
reduced by a small compiled function to plain sums of squares, small ones copied as they are) and
``resolve`` fetches every started statistic in one transfer, so a comparison streams through the
program instead of stopping at each op. Where the plain sums are not exact enough (a non-finite value,
a sum that overflows or underflows, all rare), ``resolve`` recomputes the scaled statistics of
``array_parts`` from the arrays, which a ``Deferred`` holds until it is resolved (``held``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fmp._report._compare import Parts, Stats, array_parts, combine, split_outputs, value_kind, wide_dtype

__all__ = ["HOLD", "JAX_OPS", "Deferred", "from_fetched", "output_stats", "resolve"]

# statistics are resolved once the arrays they hold reach this many bytes (and at the end)
HOLD = 64 << 20


class JaxCompareOps:
    """The comparison core's adapter (``fmp._report._compare.CompareOps``) for JAX arrays."""

    @staticmethod
    def dtype_name(x: Any) -> str:
        dtype = getattr(x, "dtype", None)
        if dtype is None:
            return ""
        try:
            return np.dtype(dtype).name
        except TypeError:  # an extended dtype (PRNG keys): not compared
            return ""

    @staticmethod
    def astype(x: Any, like: Any) -> Any:
        return jax.lax.convert_element_type(x, like.dtype)

    @staticmethod
    def parts(p: Any, r: Any) -> Parts:
        """On the host (NumPy, float64): the small outputs ``Deferred`` does not reduce on the device."""
        with np.errstate(all="ignore"):
            return array_parts(np, np.asarray(p).astype(np.float64), np.asarray(r).astype(np.float64))

    @staticmethod
    def changed(p: Any, r: Any) -> int:
        return int(np.count_nonzero(np.asarray(p) != np.asarray(r)))


JAX_OPS = JaxCompareOps()


class Deferred:
    """``output_stats`` of ``outs`` against ``refs``, started on the device; ``value`` once resolved."""

    def __init__(self, outs: Sequence[Any], refs: Sequence[Any], error_only: bool = False) -> None:
        """``error_only``: only the relative error is read (an op's added error): the largest values are not
        computed (half the reductions), and the other statistics of the result mean nothing."""
        self.device: list[Any] = []  # (plain sums, p, r, wide) of the large floating outputs
        self.host: list[tuple[Any, Any]] = []  # small floating outputs and their references, reduced on the host
        self.value: Stats | None = None
        floats, self.discrete = split_outputs(JAX_OPS, outs, refs)
        for p, r in floats:
            wide = jnp.dtype(wide_dtype(JAX_OPS.dtype_name(p), JAX_OPS.dtype_name(r)))
            if np.size(r) >= _ON_DEVICE:
                self.device.append((_sums(p, r, wide, error_only), p, r, wide))
            else:
                self.host.append((p, r))

    @classmethod
    def exact(cls, outs: Sequence[Any]) -> Deferred:
        """The statistics of ``outs`` against themselves: no error, nothing to fetch."""
        done = cls([], [])
        floats = any(value_kind(JAX_OPS.dtype_name(x)) == "float" for x in outs)
        done.value = Stats(0.0, math.inf, 0.0, False, 0, None) if floats else combine([], 0)
        return done

    def result(self) -> Stats:
        """The statistics, once ``resolve`` has fetched them."""
        if self.value is None:
            raise RuntimeError("fmp.explain(compare=True): statistics read before they were resolved")
        return self.value

    @property
    def held(self) -> int:
        """Bytes of the large arrays held until ``resolve``."""
        return sum(p.nbytes + r.nbytes for _, p, r, _ in self.device)

    @property
    def wides(self) -> list[Any]:
        """The dtype of each large output's plain sums (what ``from_fetched`` checks them in)."""
        return [wide for _, _, _, wide in self.device]

    def pending(self) -> list[Any]:
        """What is still to be fetched: the large outputs' plain sums, the small pairs, the discrete pairs."""
        return [[sums for sums, _, _, _ in self.device], self.host, self.discrete]

    def _finish(self, fetched: list[Any], scaled: dict[int, Any]) -> None:
        device, host, discrete = fetched
        parts = [scaled.get(id(d), _from_sums(*sums)) for d, sums in zip(self.device, device, strict=True)]
        self.value = _combined(parts, host, discrete)
        self.device, self.host, self.discrete = [], [], []


def _combined(parts: Sequence[Parts], host: Sequence[Any], discrete: Sequence[Any]) -> Stats:
    """The statistics from the large outputs' parts and the fetched small and discrete pairs."""
    flips = sum(JAX_OPS.changed(p, r) for p, r in discrete)
    return combine([*parts, *(JAX_OPS.parts(p, r) for p, r in host)], flips)


def resolve(deferred: Sequence[Deferred]) -> None:
    """Fetches the statistics of every unresolved ``Deferred`` in one transfer and sets their ``value``."""
    todo = list({id(d): d for d in deferred if d.value is None}.values())  # one may stand for two rows' parts
    fetched = jax.device_get([d.pending() for d in todo])
    redo = {
        id(entry): _float_stats(entry[1], entry[2], entry[3])
        for d, got in zip(todo, fetched, strict=True)
        for entry, sums in zip(d.device, got[0], strict=True)
        if not _plain(sums, entry[3])
    }
    scaled = jax.device_get(redo)
    for d, got in zip(todo, fetched, strict=True):
        d._finish(got, scaled)


def from_fetched(wides: Sequence[Any], fetched: Sequence[Any]) -> Stats | None:
    """The statistics from a ``Deferred``'s fetched pending values (its ``pending()``, computed elsewhere:
    ``_compiled``) and its ``wides``; ``None`` where a plain sum is not exact enough (the arrays it would
    recompute from are not at hand)."""
    device, host, discrete = fetched
    if not all(_plain(sums, wide) for sums, wide in zip(device, wides, strict=True)):
        return None
    return _combined([_from_sums(*sums) for sums in device], host, discrete)


def _sums(p: Any, r: Any, wide: Any, error_only: bool) -> Any:
    """The plain sums of one pair. On arrays: one small compiled function on values already in memory.
    Inside a program being traced (``_compiled``): a single pass that XLA's own emitter runs, in
    which a rounding made upstream is kept (XLA CPU's YNNPACK reductions, which the four plain ones become,
    may drop a round trip to bfloat16 fused into them, and so report no error)."""
    if p is r:
        return _plain_sums(p, r, wide)  # no rounding between them: any reduction will do
    if isinstance(p, jax.core.Tracer) or isinstance(r, jax.core.Tracer):
        return _one_pass_sums(p, r, wide)
    return _error_sums(p, r, wide) if error_only else _plain_sums(p, r, wide)


def _one_pass_sums(p: Any, r: Any, wide: Any) -> Any:
    """``_plain_sums`` as one variadic reduction over rows of up to 128 elements, then over the rows' partial
    results (summed in short runs: as exact as the plain sums)."""
    n = int(np.size(r))
    row = next((w for w in (128, 64, 32, 16, 8, 4, 2) if n % w == 0), 1)
    p, r = p.astype(wide).reshape(-1, row), r.astype(wide).reshape(-1, row)
    d = p - r
    zero = jnp.zeros((), wide)

    def step(a: Any, b: Any) -> Any:
        return a[0] + b[0], a[1] + b[1], jnp.maximum(a[2], b[2]), jnp.maximum(a[3], b[3])

    s_r, s_d, d_max, r_max = jax.lax.reduce((r * r, d * d, jnp.abs(d), jnp.abs(r)), (zero,) * 4, step, (1,))
    return jnp.stack([jnp.sum(s_r), jnp.sum(s_d), jnp.max(d_max, initial=0.0), jnp.max(r_max, initial=0.0)])


def output_stats(outs: Sequence[Any], refs: Sequence[Any]) -> Stats:
    """The ``Stats`` of ``outs`` against ``refs`` (the comparison core's ``output_stats``), computed as
    ``Deferred`` computes them: the large outputs' sums on the device."""
    d = Deferred(outs, refs)
    resolve([d])
    return d.result()


_ON_DEVICE = 1 << 16  # elements from which the statistics run compiled, not in NumPy


@functools.partial(jax.jit, static_argnums=2)
def _plain_sums(p: Any, r: Any, wide: Any) -> Any:
    """Sums of squares of the reference and of the difference, the largest difference and the largest
    reference value: four reductions, in one array (one transfer to the host, not four)."""
    p, r = p.astype(wide), r.astype(wide)
    d = p - r
    sums = jnp.sum(r * r), jnp.sum(d * d), jnp.max(jnp.abs(d), initial=0.0), jnp.max(jnp.abs(r), initial=0.0)
    return jnp.stack(sums)


@functools.partial(jax.jit, static_argnums=2)
def _error_sums(p: Any, r: Any, wide: Any) -> Any:
    """``_plain_sums`` for a relative error only: the two sums of squares, and 1 for both largest values
    (``_from_sums`` then leaves the sums unscaled)."""
    p, r = p.astype(wide), r.astype(wide)
    d = p - r
    one = jnp.ones((), wide)
    return jnp.stack([jnp.sum(r * r), jnp.sum(d * d), one, one])


def _plain(sums: Any, wide: Any) -> bool:
    """The plain sums are exact enough: every term finite, and each sum so large that the squares flushed
    below the smallest normal number cost it at most 2^-20 of itself."""
    s_r, s_d, _, _ = (float(x) for x in sums)
    low = float(jnp.finfo(wide).tiny) ** 0.625
    return math.isfinite(s_r) and math.isfinite(s_d) and s_r >= low and (s_d == 0.0 or s_d >= low)


def _from_sums(s_r: Any, s_d: Any, d_max: Any, r_max: Any) -> Parts:
    """The plain sums in ``array_parts``' form (sums scaled by the largest value)."""
    d_max, r_max = float(d_max), float(r_max)
    r_sq = float(s_r) / (r_max * r_max) if r_max > 0 else 0.0
    return Parts(r_max, r_sq, d_max, float(s_d) / (d_max * d_max) if d_max > 0 else 0.0, False, False)


@functools.partial(jax.jit, static_argnums=2)
def _float_stats(p: Any, r: Any, wide: Any) -> Parts:
    return array_parts(jnp, p.astype(wide), r.astype(wide))
