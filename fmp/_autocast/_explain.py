"""``fmp.explain``: which dtype every operation runs in after the rewrite."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fmp._autocast._args import trace
from fmp._autocast._checks import check_args
from fmp._autocast._fp8_checks import check_state
from fmp._autocast._rows import flops
from fmp._autocast._transform import configure, make_context, rewrite_top
from fmp._core._report import Report
from fmp._core._rules import RuleSet
from fmp._fp8._state import Float8State, SiteFeeder
from fmp._policy import Policy


def explain(
    fn: Callable[..., Any],
    policy: str | Policy = "mixed_bfloat16",
    *,
    rules: RuleSet | None = None,
    overrides: Mapping[str, Any] | None = None,
    fp8_state: Float8State | None = None,
) -> Callable[..., Report]:
    """Reports the dtype every operation of ``fn`` runs in under `fmp.autocast`.

    Returns a function taking ``fn``'s arguments; it traces and rewrites ``fn``
    (nothing is computed) and returns a ``Report``: one
    row per equation after the rewrite (nested bodies flattened in order) with
    the primitive, the user's source line, input and output dtypes before and
    after, the rule that decided it and its FLOPs, plus one ``cast`` row per
    cast fmp inserted. ``print(report)`` shows a table; ``report.to_dict()``
    returns plain data; ``report.summary`` holds the low-precision FLOP share,
    the casts inserted and the float32 islands.

    Args:
      fn: The function to inspect.
      policy: As for `fmp.autocast`.
      rules: As for `fmp.autocast`.
      overrides: As for `fmp.autocast`.
      fp8_state: As for `fmp.autocast`: under a delayed float8 policy, the sites are
        labelled ``delayed`` only with a state (without one they run, and say, ``tensorwise (no state)``).

    Examples:
      >>> rep = fmp.explain(lambda x, w: jax.nn.softmax(x @ w))(jnp.ones((4, 8)), jnp.ones((8, 8)))
      >>> [(r.op, r.out_after) for r in rep.records if r.op in ("dot_general", "exp")]
      [('dot_general', ('bfloat16',)), ('exp', ('float32',))]
      >>> rep.summary["low_precision_flop_share"]
      1.0
    """
    if not callable(fn):
        raise TypeError(f"explain(fn) expects a callable, got {type(fn).__name__}")
    config = configure(policy, rules, overrides)
    if fp8_state is not None:
        check_state(fp8_state, config.policy, config.overrides, str(config.policy))

    def run(*args: Any, **kwargs: Any) -> Report:
        check_args(args, kwargs, api="fmp.explain")
        closed, _, _ = trace(fn, args, kwargs)
        sites = None if fp8_state is None else SiteFeeder(fp8_state)
        ctx = make_context(config, records=[], fp8_sites=sites)
        rewrite_top(closed, ctx)
        if sites is not None:
            sites.finish()
        return Report(records=tuple(ctx.records or ()), policy=str(config.policy), framework="jax")

    return run


__all__ = ["explain", "flops"]
