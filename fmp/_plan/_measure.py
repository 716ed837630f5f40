"""What one run of an assignment measured, from its values and float32's (NumPy leaves, either framework),
and the argument sets a plan measures on.

The statistics are the precision report's (``fmp._report._grads.relative_error``): one relative L2 error
over the floating outputs, the count of changed discrete elements, and the worst gradient leaf.

Framework-neutral: imports neither jax nor torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fmp._plan._search import Measured
from fmp._report._grads import relative_error


def floating(x: np.ndarray) -> bool:
    return np.issubdtype(x.dtype, np.floating) or x.dtype.name == "bfloat16"


def leaf(x: Any) -> np.ndarray:
    """A leaf as NumPy: floating values in float64."""
    a = np.asarray(x)
    return a.astype(np.float64) if floating(a) else a


def measured(
    ref: Sequence[np.ndarray],
    out: Sequence[np.ndarray],
    ref_grads: Sequence[np.ndarray] | None = None,
    grads: Sequence[np.ndarray] | None = None,
) -> Measured:
    """The error of one run: its output leaves against float32's (one relative L2 error over the floating
    leaves, the changed discrete elements), its gradient leaves against float32's (the worst leaf; a leaf
    whose float32 gradient is zero has no relative error and is left out)."""
    pairs = list(zip(out, ref, strict=True))
    floats = [(o, r) for o, r in pairs if floating(r)]
    flips = sum(int(np.sum(o != r)) for o, r in pairs if not floating(r))
    out_err, nonfinite = 0.0, False
    if floats:
        o_flat = np.concatenate([np.ravel(o) for o, _ in floats])
        r_flat = np.concatenate([np.ravel(r) for _, r in floats])
        out_err, _, _, nonfinite = relative_error(o_flat, r_flat)
    grad_err = None
    if ref_grads is not None and grads is not None:
        grad_err = 0.0
        for g, r in zip(grads, ref_grads, strict=True):
            if floating(r) and np.any(r != 0):
                e, _, _, bad = relative_error(g, r)
                grad_err, nonfinite = max(grad_err, e), nonfinite or bad
    return Measured(max(out_err, grad_err or 0.0), out_err, grad_err, nonfinite, flips)


def worse(a: Measured, b: Measured) -> Measured:
    """The worse of two batches' measurements, field by field."""
    grad = None if a.grad_error is None or b.grad_error is None else max(a.grad_error, b.grad_error)
    return Measured(
        max(a.error, b.error),
        max(a.output_error, b.output_error),
        grad,
        a.nonfinite or b.nonfinite,
        max(a.flips, b.flips),
    )


def arg_sets(args: tuple[Any, ...], batches: Sequence[Any] | None) -> list[tuple[Any, ...]]:
    """``args``, then ``args`` with each batch in place of its last arguments (a batch that is no tuple
    replaces the last one).

    Raises:
      TypeError: No arguments, or ``batches`` is not a sequence.
      ValueError: A batch longer than the arguments.
    """
    if not args:
        raise TypeError("plan: pass the function's arguments (the module's inputs) after it")
    if batches is None:
        return [tuple(args)]
    if isinstance(batches, str | bytes) or not isinstance(batches, Sequence):
        raise TypeError(f"plan(batches=...) expects a sequence of batches, got {type(batches).__name__}")
    out = [tuple(args)]
    for b in batches:
        b = b if isinstance(b, tuple) else (b,)
        if len(b) > len(args):
            raise ValueError(
                f"plan(batches=...): a batch of {len(b)} values replaces more than the {len(args)} arguments"
            )
        out.append(tuple(args[: len(args) - len(b)]) + b)
    return out
