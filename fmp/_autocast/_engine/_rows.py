"""What an explain row says about an equation: its source line and its FLOPs."""

from __future__ import annotations

import math
from typing import Any

from jax.extend import source_info_util
from jax.extend.core import JaxprEqn

from fmp._autocast._engine._dims import contracted_size


def source(eqn: JaxprEqn, traceback: Any = None) -> str:
    """The user's source line of ``eqn`` (``""`` when unknown); ``traceback`` replaces the equation's own."""
    try:
        info = eqn.source_info if traceback is None else eqn.source_info.replace(traceback=traceback)
        return source_info_util.summarize(info)
    except Exception:  # noqa: BLE001 - a report line must never break the rewrite
        return ""


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
