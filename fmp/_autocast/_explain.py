"""``fmp.explain``: which dtype every operation runs in after the rewrite."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from jax.extend.core import JaxprEqn

from fmp._autocast import _wrap
from fmp._autocast._transform import Context, check_overrides, check_rules, rewrite_top
from fmp._core._report import Report
from fmp._core._rules import RuleSet
from fmp._fp8._state import SiteFeeder
from fmp._policy import Policy, get_policy


def flops(eqn: JaxprEqn) -> float:
    """Estimated floating-point operations of a matmul or convolution (0 for other ops)."""
    name = eqn.primitive.name
    if name not in ("dot_general", "conv_general_dilated"):
        return 0.0
    out = eqn.outvars[0].aval
    if name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval
        k = math.prod(lhs.shape[d] for d in lhs_contract)
        return 2.0 * math.prod(out.shape) * k
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval
        out_feature_dim = eqn.params["dimension_numbers"].rhs_spec[0]
        per_output = math.prod(rhs.shape) / rhs.shape[out_feature_dim]
        return 2.0 * math.prod(out.shape) * per_output
    return 0.0


def explain(
    fn: Callable[..., Any],
    policy: str | Policy = "mixed_bfloat16",
    *,
    rules: RuleSet | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Callable[..., Report]:
    """Reports the dtype every operation of ``fn`` runs in under :func:`fmp.autocast`.

    Returns a function taking ``fn``'s arguments; it traces and rewrites ``fn``
    (nothing is computed) and returns a :class:`~fmp._core._report.Report`: one
    row per equation after the rewrite (nested bodies flattened in order) with
    the primitive, the user's source line, input and output dtypes before and
    after, the rule that decided it and its FLOPs, plus one ``cast`` row per
    cast fmp inserted. ``print(report)`` shows a table; ``report.to_dict()``
    returns plain data; ``report.summary`` holds the low-precision FLOP share,
    the casts inserted and the float32 islands.

    Args:
      fn: The function to inspect.
      policy: As for :func:`fmp.autocast`.
      rules: As for :func:`fmp.autocast`.
      overrides: As for :func:`fmp.autocast`.

    Examples:
      >>> rep = fmp.explain(lambda x, w: jax.nn.softmax(x @ w))(jnp.ones((4, 8)), jnp.ones((8, 8)))
      >>> [(r.op, r.out_after) for r in rep.records if r.op in ("dot_general", "exp")]
      [('dot_general', ('bfloat16',)), ('exp', ('float32',))]
      >>> rep.summary["low_precision_flop_share"]
      1.0
    """
    if not callable(fn):
        raise TypeError(f"explain(fn) expects a callable, got {type(fn).__name__}")
    pol = get_policy(policy)
    ruleset = check_rules(rules)
    over = check_overrides(overrides)

    def run(*args: Any, **kwargs: Any) -> Report:
        closed, _, _ = _wrap.trace(fn, args, kwargs)
        ctx = Context(pol, ruleset, over, records=[], fp8_sites=SiteFeeder(None))  # delayed sites as with a state
        rewrite_top(closed, ctx)
        return Report(records=tuple(ctx.records or ()), policy=str(pol), framework="jax")

    return run


__all__ = ["explain", "flops"]
