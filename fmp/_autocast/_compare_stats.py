"""Error statistics of one equation's outputs against the reference run (JAX arrays); the formulas and the
fix to suggest are ``fmp._core._compare_math``'s, shared with the torch side."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fmp._core._compare_math import array_parts, combine, needs_fix, suggestion

__all__ = ["needs_fix", "output_stats", "suggestion"]


def _kind(x: Any) -> str:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return ""
    try:
        dt = np.dtype(dtype)
    except TypeError:  # an extended dtype (PRNG keys): not compared
        return ""
    if dt.kind == "f" or dt.name == "bfloat16" or dt.name.startswith("float8"):
        return "float"
    return "discrete" if dt.kind in "iub" else ""


def output_stats(outs: Sequence[Any], refs: Sequence[Any]) -> tuple[Any, Any, Any, bool, int]:
    """``(error, sqnr_db, max_abs_error, nonfinite, flips)`` of ``outs`` against ``refs``.

    ``error`` is the relative L2 error over all floating outputs (``None`` when
    there are none); ``nonfinite`` says an inf/NaN appeared where the reference
    is finite (then ``error`` is inf); ``flips`` counts changed integer and
    boolean elements. Sums of squares are scaled, so no value overflows them.
    """
    parts, flips = [], 0
    for p, r in zip(outs, refs, strict=True):
        kind = _kind(r)
        if kind == "discrete":
            flips += int(np.count_nonzero(np.asarray(p) != np.asarray(r)))
        if kind != "float" or _kind(p) != "float":
            continue
        wide = jnp.float64 if "float64" in (np.dtype(p.dtype).name, np.dtype(r.dtype).name) else jnp.float32
        parts.append(_float_stats(p, r, wide) if np.size(r) >= _ON_DEVICE else _float_stats_np(p, r, wide))
    return combine(parts, flips)


_ON_DEVICE = 1 << 16  # elements from which the statistics run compiled, not in NumPy


@functools.partial(jax.jit, static_argnums=2)
def _float_stats(p: Any, r: Any, wide: Any) -> tuple[Any, ...]:
    return array_parts(jnp, p.astype(wide), r.astype(wide))


def _float_stats_np(p: Any, r: Any, wide: Any) -> tuple[Any, ...]:
    with np.errstate(all="ignore"):
        return array_parts(np, np.asarray(p).astype(np.float64), np.asarray(r).astype(np.float64))


