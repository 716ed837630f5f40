"""The error statistics of ``explain_fx(compare=True)`` on torch tensors, by the JAX side's formulas.

The sums, maxima and non-finite checks are ``fmp._report._compare.array_parts`` run with ``torch``
as the array library (on the tensors' own device), and the totals are its ``combine``: one
definition of every number the two frameworks report.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fmp._report._compare import array_parts, combine
from fmp._report._grads import GradError, relative_error


def _top(x: torch.Tensor) -> torch.Tensor:
    return x.max() if x.numel() else x.new_zeros(())


def _kind(x: Any) -> str:
    if not isinstance(x, torch.Tensor) or x.is_complex():
        return ""
    return "float" if x.dtype.is_floating_point else "discrete"


def float_parts(p: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``_parts`` of one floating output against its reference: in float32 (the sums are scaled, so none
    overflows), in float64 when either is float64, as the JAX side's compiled statistics."""
    wide = torch.float64 if torch.float64 in (p.dtype, r.dtype) else torch.float32
    with torch.no_grad():
        return array_parts(torch, p.detach().to(wide), r.detach().to(wide), _top)


def output_stats(outs: Any, refs: Any) -> tuple[Any, Any, Any, bool, int]:
    """``(error, sqnr_db, max_abs_error, nonfinite, flips)`` of the tensors in ``outs`` against ``refs``.

    The structures are flattened alike; floating tensors give the errors, integer and boolean ones the
    flips (changed elements), as the JAX side's ``output_stats``.
    """
    parts, flips = [], 0
    for p, r in zip(pytree.tree_leaves(outs), pytree.tree_leaves(refs), strict=True):
        kind = _kind(r)
        if kind == "discrete" and isinstance(p, torch.Tensor) and p.shape == r.shape:
            flips += int(torch.count_nonzero(p != r))
        elif kind == "float" and _kind(p) == "float":
            parts.append(float_parts(p, r))
    return combine(parts, flips)


def grad_error(p: torch.Tensor, r: torch.Tensor) -> GradError:
    """A gradient against its reference: relative L2 error, cosine, max abs error, non-finite values (the
    formulas of the JAX report's gradients)."""
    with torch.no_grad():
        a, b = (t.detach().to(torch.float64).cpu().numpy() for t in (p, r))
    err, cos, max_abs, nonfinite = relative_error(a, b)
    return GradError(error=err, cosine=cos, max_abs_error=max_abs, nonfinite=nonfinite)


def round_as(ref: Any, like: Any, back: bool = True) -> Any:
    """``ref`` rounded to the floating dtype of ``like`` (and ``back`` to its own); ``ref`` when they agree."""
    if not (_kind(ref) == "float" and _kind(like) == "float") or ref.dtype == like.dtype:
        return ref
    rounded = ref.to(like.dtype)
    return rounded.to(ref.dtype) if back else rounded


def rounds(refs: Sequence[Any], likes: Sequence[Any]) -> bool:
    """Whether any floating ``refs`` would be rounded to the dtype of its ``likes``."""
    return any(round_as(r, x, back=False) is not r for r, x in zip(refs, likes, strict=True))
