"""What an explain row says about an equation: its source line and its FLOPs."""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

from jax.extend.core import JaxprEqn

from fmp._autocast._engine._dims import contracted_size
from fmp._core import _frames


def source(eqn: JaxprEqn, traceback: Any = None) -> str:
    """The user's source line of ``eqn`` (``""`` when no frame is the user's, see ``fmp._core._frames``);
    ``traceback`` replaces the equation's own."""
    try:
        return _summary(eqn.source_info.traceback if traceback is None else traceback, _frames.rule())
    except Exception:  # noqa: BLE001 - a report line must never break the rewrite
        return ""


@functools.lru_cache(maxsize=256)
def _summary(traceback: Any, rule: _frames.Rule) -> str:
    """``file:line:column (function)`` of the innermost user frame of a JAX traceback, as JAX writes it."""
    if traceback is None:
        return ""
    codes, offsets = traceback.raw_frames()  # innermost first
    i = _frames.user_frame(range(len(codes)), lambda k: codes[k].co_filename, rule)
    if i is None:
        return ""
    code = codes[i]
    line, _, column, _ = next(itertools.islice(code.co_positions(), offsets[i] // 2, None), (None,) * 4)
    line = code.co_firstlineno if line is None else line
    where = f"{code.co_filename}:{line}:{column}" if column else f"{code.co_filename}:{line}"
    return f"{where} ({code.co_qualname})"


def flops(eqn: JaxprEqn) -> float:
    """Estimated floating-point operations of a matmul or convolution (0 for other ops)."""
    name = eqn.primitive.name
    if name not in ("dot_general", "conv_general_dilated"):
        return 0.0
    out = eqn.outvars[0].aval
    if name == "dot_general":
        return 2.0 * math.prod(out.shape) * contracted_size(eqn)
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval
        out_feature_dim = eqn.params["dimension_numbers"].rhs_spec[0]
        per_output = math.prod(rhs.shape) / rhs.shape[out_feature_dim]
        return 2.0 * math.prod(out.shape) * per_output
    return 0.0


def gemm(eqn: JaxprEqn, weight: str = "rhs") -> tuple[int, int, int] | None:
    """``(M, K, N)`` of a matmul or convolution seen as a GEMM (None for other ops): ``K`` the elements summed
    per output, ``N`` the output features (the free size of the ``weight`` operand, ``"lhs"`` or ``"rhs"``, of a
    ``dot_general``; a convolution's output channels), ``M`` the other output elements (batch dims included)."""
    name = eqn.primitive.name
    out = math.prod(eqn.outvars[0].aval.shape)
    if name == "dot_general":
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        side = 0 if weight == "lhs" else 1
        shape, skip = eqn.invars[side].aval.shape, set((lc, rc)[side]) | set((lb, rb)[side])
        n = math.prod(s for d, s in enumerate(shape) if d not in skip)
        k = contracted_size(eqn)
    elif name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        n = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
        k = math.prod(rhs) // max(n, 1)
    else:
        return None
    return out // max(n, 1), k, n
