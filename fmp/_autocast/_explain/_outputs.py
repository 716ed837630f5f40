"""How far a compared program's outputs are from the program as written (``Report.output_error``), and how
far the program as written moves by itself when its floating inputs and constants are rounded to the policy's
compute dtype (``Report.baseline_error``: the model's own conditioning at that precision).

Both are error statistics of the comparison core (``_stats.Deferred``), started where the comparison runs:
op by op (``_forward``) or inside the one compiled program (``_compiled``), whose outputs then carry them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

from fmp._autocast._explain._stats import Deferred


def rounded(x: Any, dtype: Any) -> Any:
    """A floating array wider than ``dtype`` rounded to it and back; anything else as it is."""
    dt = getattr(x, "dtype", None)
    if dt is None or not jnp.issubdtype(dt, jnp.floating) or np.dtype(dt).itemsize <= np.dtype(dtype).itemsize:
        return x
    return jnp.asarray(x).astype(dtype).astype(dt)


def baseline(closed: ClosedJaxpr, arrays: Sequence[Any], dtype: Any) -> list[Any] | None:
    """The program as written on its inputs and constants rounded to ``dtype``; ``None`` when nothing is
    rounded (the reference itself)."""
    consts = [rounded(c, dtype) for c in closed.consts]
    args = [rounded(a, dtype) for a in arrays]
    if all(c is d for c, d in zip(consts, closed.consts, strict=True)) and all(
        a is b for a, b in zip(args, arrays, strict=True)
    ):
        return None
    return list(jaxpr_as_fun(ClosedJaxpr(closed.jaxpr, consts))(*args))


def started(outs: Sequence[Any], refs: Sequence[Any], base: Sequence[Any] | None) -> list[Deferred]:
    """Per output: the statistics of the policy run's value against the reference's, then (the second half)
    those of the baseline's against the reference's (exact where nothing was rounded)."""
    errors = [Deferred([p], [r], error_only=True) for p, r in zip(outs, refs, strict=True)]
    if base is None:
        return errors + [Deferred.exact([r]) for r in refs]
    return errors + [Deferred([b], [r], error_only=True) for b, r in zip(base, refs, strict=True)]


def split(stats: Sequence[Any]) -> tuple[list[float | None], list[float | None]]:
    """The per-output relative errors of ``started``'s statistics: ``(outputs, baselines)``."""
    errors = [s[0] for s in stats]
    half = len(errors) // 2
    return errors[:half], errors[half:]


def named(errors: Sequence[float | None], out_tree: Any) -> float | dict[str, float] | None:
    """The error of a program's one floating output, or each floating output's by its key path
    (``jax.tree_util.keystr``) for several; ``None`` without floating outputs."""
    paths = [
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_leaves_with_path(
            jax.tree_util.tree_unflatten(out_tree, list(range(len(errors))))
        )
    ]
    if len(errors) == 1:
        return errors[0]
    found = {p: e for p, e in zip(paths, errors, strict=True) if e is not None}
    return found or None
