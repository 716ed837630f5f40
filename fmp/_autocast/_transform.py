"""The public rewrite: ``autocast_jaxpr``, and the one place a rewrite's context is built.

``make_context`` validates a policy, a rule set and overrides and gives the
interpreter (``_interp``) its handlers: ``_control.HANDLERS`` for higher-order
primitives and ``_leaf.leaf`` for every other equation. ``fmp.autocast``
(``_wrap``), ``fmp.autocast_jaxpr`` (here) and ``fmp.explain`` (``_explain``)
all build their context here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from jax.extend.core import ClosedJaxpr

from fmp._autocast import _leaf
from fmp._autocast._engine._cast import cast
from fmp._autocast._engine._context import Context, dtype_name, is_castable
from fmp._autocast._engine._interp import eval_jaxpr, transform_closed_uncached
from fmp._autocast._engine._weights import top_weights
from fmp._autocast._hops import _control
from fmp._core._rules import DEFAULT_RULES, RuleSet
from fmp._policy import Policy, get_policy
from fmp._report._records import OpRecord
from fmp._resolved import ResolvedPolicy


def configure(
    policy: str | Policy, rules: RuleSet | None = None, overrides: Mapping[str, Any] | None = None
) -> ResolvedPolicy:
    """Validates the user's arguments (raises ``TypeError``/``ValueError`` with what was wrong): the policy,
    rule set and overrides of one ``autocast``/``explain`` call, resolved once."""
    pol = get_policy(policy)
    label = policy if isinstance(policy, str) else str(pol)
    return ResolvedPolicy.of(pol, check_rules(rules), check_overrides(overrides), label=label)


def make_context(
    config: ResolvedPolicy, records: list[OpRecord] | None = None, fp8_sites: Any = None, key: Any = None
) -> Context:
    """The context of one rewrite: the resolved policy plus the interpreter's handlers and leaf rules.

    ``fp8_sites`` (an ``fmp._float8._state.SiteFeeder``) hands delayed-scaling float8 sites their history rows;
    ``key`` is the caller's key for stochastic rounding.
    """
    return Context(
        config.policy,
        config.rules,
        config.overrides,
        records=records,
        handlers=_control.HANDLERS,
        leaf=_leaf.leaf,
        keeps=_leaf.keeps,
        fp8_sites=fp8_sites,
        key=key,
    )


def check_overrides(overrides: Mapping[str, Any] | None) -> tuple[tuple[str, Policy], ...]:
    """Validates ``overrides`` (scope substring -> policy spec) into a hashable tuple."""
    if overrides is None:
        return ()
    if not isinstance(overrides, Mapping):
        raise TypeError(
            f"overrides must be a mapping from a name-scope substring to a policy (e.g. "
            f"{{'LayerNorm': 'float32'}}), got {type(overrides).__name__}"
        )
    out = []
    for key, spec in overrides.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"overrides keys must be non-empty str name-scope substrings, got {key!r}")
        out.append((key, get_policy(spec)))
    return tuple(out)


def check_rules(rules: RuleSet | None) -> RuleSet:
    if rules is None:
        return DEFAULT_RULES
    if not isinstance(rules, RuleSet):
        raise TypeError(
            f"rules must be an fmp.RuleSet (e.g. fmp.DEFAULT_RULES.derive(...)), got {type(rules).__name__}"
        )
    return rules


def autocast_jaxpr(
    closed_jaxpr: ClosedJaxpr,
    policy: str | Policy = "mixed_bfloat16",
    rules: RuleSet | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
) -> ClosedJaxpr:
    """Rewrites a closed jaxpr under a mixed-precision policy (the transform behind ``autocast``).

    Every equation is decided by the rule table from the dtypes its inputs have
    in the rewritten program: ``lower_precision`` ops (matmuls, convolutions) run
    in the policy's compute dtype, ``float32`` ops in float32, ``promote`` ops in
    their widest floating input, unlisted ops in the dtypes they are given. The
    epilogue rule (``rules.jax_epilogue``, default ``add``/``sub``) runs a bias
    along the output features added to a linear layer's or a convolution's
    result in the compute dtype; a contraction summing one element per output
    is decided as ``mul`` (``rules.jax_uncontracted``); no constant is cast
    into a dtype in which it rounds to infinity. Loop carries
    take the dtypes of a fixed point of the body rewrite.
    float64, integer and boolean values are never cast, an explicit
    ``convert_element_type`` keeps its target, and ``jit``, ``scan``,
    ``while``, ``cond``, ``checkpoint``, ``custom_jvp``, ``custom_vjp`` and
    ``shard_map`` bodies are rewritten too (custom derivative rules are kept).

    Inputs keep their dtypes. Outputs that were float32 come back in the
    policy's ``output_dtype``; every other output keeps its original dtype.

    Args:
      closed_jaxpr: The program, e.g. from ``jax.make_jaxpr(f)(*args)``.
      policy: A policy spec or `fmp.Policy`.
      rules: A `fmp.RuleSet`; ``None`` means ``fmp.DEFAULT_RULES``.
      overrides: Optional ``{scope_key: policy}``: equations whose name
        scope contains the key run under that policy (the innermost match
        wins; a key never matches inside a number: ``"blocks/1"`` does not select ``blocks/10``), with their
        inputs first returned to their original dtypes.

    Returns:
      A new ``ClosedJaxpr`` with the same input avals.

    Raises:
      ValueError: an op in the ``banned`` category runs under a float16 policy.
      NotImplementedError: a primitive carries a sub-jaxpr fmp cannot rewrite.

    Examples:
      >>> cj = jax.make_jaxpr(lambda x, w: jnp.tanh(x @ w))(jnp.ones((2, 3)), jnp.ones((3, 4)))
      >>> new = fmp.autocast_jaxpr(cj, "mixed_bfloat16")
      >>> [e.primitive.name for e in new.eqns]
      ['convert_element_type', 'convert_element_type', 'dot_general', 'tanh', 'convert_element_type', 'reduce_precision']
      >>> new.out_avals[0].dtype
      dtype('float32')
    """
    if not isinstance(closed_jaxpr, ClosedJaxpr):
        raise TypeError(
            f"autocast_jaxpr(closed_jaxpr) expects a ClosedJaxpr (from jax.make_jaxpr), got {type(closed_jaxpr).__name__}"
        )
    return rewrite_top(closed_jaxpr, make_context(configure(policy, rules, overrides)))


def _top_out_dtypes(closed: ClosedJaxpr, ctx: Context) -> list[Any]:
    """float32 outputs -> the policy's output dtype; other floating outputs keep their dtype."""
    return [
        ctx.policy.output_dtype if dtype_name(a.dtype) == "float32" else a.dtype if is_castable(a.dtype) else None
        for a in closed.out_avals
    ]


def _top(closed: ClosedJaxpr, ctx: Context) -> Context:
    """``ctx`` for the autocast function's own program: every input of it is a weight (the float8 scope rule)."""
    return dataclasses.replace(ctx, weights_in=top_weights(closed.jaxpr))


def rewrite_top(closed: ClosedJaxpr, ctx: Context) -> ClosedJaxpr:
    """The rewritten program as a new closed jaxpr."""
    return transform_closed_uncached(closed, closed.in_avals, _top(closed, ctx), "", _top_out_dtypes(closed, ctx))


def run_top(closed: ClosedJaxpr, args: Sequence[Any], ctx: Context) -> list[Any]:
    """Evaluates the rewritten program directly in the caller's trace (one trace fewer than
    ``jaxpr_as_fun(rewrite_top(...))``, with the same equations)."""
    outs = eval_jaxpr(closed.jaxpr, closed.consts, args, _top(closed, ctx), "")
    return [o if d is None else cast(o, d, ctx) for o, d in zip(outs, _top_out_dtypes(closed, ctx), strict=True)]
