"""``fmp.explain``: which dtype every operation runs in after the rewrite."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp

from fmp._autocast._args import trace
from fmp._autocast._checks import check_args
from fmp._autocast._engine._rows import flops
from fmp._autocast._explain import _cache, _compiled, _forward, _grads, _outputs
from fmp._autocast._float8_checks import check_state
from fmp._autocast._transform import configure, make_context, rewrite_top
from fmp._autocast._wrap import autocast_resolved
from fmp._core._dtypes import INIT_SCALE
from fmp._core._renamed import NOT_GIVEN, renamed_argument
from fmp._core._rules import RuleSet
from fmp._float8._state import Float8State, SiteFeeder
from fmp._policy import Policy
from fmp._report._float8_choice import choose
from fmp._report._records import Report
from fmp._resolved import ResolvedPolicy
from fmp._scaling._scaler import GradScaler

_MSG_COMPARE_STATE = (
    "fmp.explain(..., compare=True) does not take float8_state yet: compare without it (delayed float8 sites then "
    "run, and are compared as, current scaling), or call explain without compare=True to see the delayed rows."
)


def explain(
    fn: Callable[..., Any],
    policy: str | Policy = "mixed_bfloat16",
    *,
    rules: RuleSet | None = None,
    overrides: Mapping[str, Any] | None = None,
    float8_state: Float8State | None = None,
    compare: bool = False,
    grads: bool = False,
    argnums: int | Sequence[int] = 0,
    loss_scale: float | GradScaler | None = None,
    fp8_state: Any = NOT_GIVEN,
) -> Callable[..., Report]:
    """Reports the dtype every operation of ``fn`` runs in under `fmp.autocast`.

    Returns a function taking ``fn``'s arguments; it traces and rewrites ``fn``
    (nothing is computed) and returns a ``Report``: one
    row per equation after the rewrite (nested bodies flattened in order) with
    the primitive, the user's source line (the innermost frame outside fmp,
    JAX, the standard library and installed packages such as flax; ``""``
    when there is none; ``FMP_USER_PACKAGES=pkg1,pkg2`` names installed
    packages that are yours), input and output dtypes before and
    after, the rule that decided it and its FLOPs, plus one ``cast`` row per
    cast fmp inserted. ``print(report)`` shows a table; ``report.to_dict()``
    returns plain data; ``report.summary`` holds the low-precision FLOP share,
    the casts inserted and the float32 islands.

    With ``compare=True`` the function also runs: once as written and once
    under the policy, on the given inputs, equation by equation, and every
    row gets the error of its outputs against the program as written
    (``error``, ``sqnr_db``, ``max_abs_error``, ``nonfinite``, ``flips``),
    the error the op adds by itself (``added_error``: the op in the policy's
    dtypes on the reference inputs) and, where that is far above the dtype's
    unit roundoff, overflows or changes discrete outputs, a ``suggestion``:
    code to paste that runs it in float32 (a float8 matmul: in the compute
    dtype, also where its own error stands out from the other float8
    matmuls', see ``Report.needs_fix``). ``report.worst(k)`` lists the
    culprits, ``print(report)`` starts with them and ``report.plot()``
    draws them (needs matplotlib). The reference is the
    program in the dtypes it was written in (float64 only where it says so).
    A ``scan`` or ``while`` body's rows stand for all its iterations (the worst
    one's errors, with ``error_mean`` / ``added_error_mean``; an op that writes
    the carry is charged the error the carry ends with); a ``cond`` is compared
    in the branch the policy run takes. ``shard_map`` bodies and linear solves
    are not compared yet (a ``NotImplementedError`` says so). A program without
    loops, branches or float8 is compared as one compiled program, kept for the
    next call of the same function object (a bound method: of the same object),
    policy, rules and overrides on arguments of the same types, through this
    wrapper or a new one (its roundings are those of the op-by-op comparison,
    which every other call runs). ``report.output_error`` holds the outputs'
    relative error against the program as written and ``report.baseline_error``
    that of the program as written on its floating inputs and constants rounded
    to the compute dtype (see ``Report.verdict``).

    With ``grads=True`` as well, ``report.grad_errors`` maps each gradient leaf
    of the ``argnums`` arguments (its key path, as ``jax.tree_util.keystr``
    writes it) to a ``GradError``: the relative L2 error and cosine of
    ``jax.grad(fmp.autocast(fn, ...))`` (compiled, as users train) against
    ``jax.grad(fn)`` of the program as written (both compiled once: a repeated
    call on arguments of the same structure, shapes and non-array values reuses
    them, as ``jax.jit`` would). ``report.grad_rows`` holds one
    row per backward operation with the forward rows' fields, compared with the
    same backward evaluated with every float16/bfloat16 dtype widened (for a
    program that writes no low-precision dtypes itself, the reference's own
    backward); ``report.worst(k, grads=True)`` lists the culprits, whose
    ``suggestion`` is the fix of the forward operation they differentiate.
    Under a float16 policy the backward runs at ``loss_scale`` and each leaf
    says which fraction of it float16 flushes to zero or holds as subnormals
    there, and which powers of two hold it (``scale_needed``, ``scale_max``).

    Args:
      fn: The function to inspect.
      policy: As for `fmp.autocast`.
      rules: As for `fmp.autocast`.
      overrides: As for `fmp.autocast`.
      float8_state: As for `fmp.autocast`: under a delayed float8 policy, the sites are
        labelled ``delayed`` only with a state (without one they run, and say, ``tensorwise (no state)``).
      compare: Run the program and compare every op with the program as written.
      grads: With ``compare=True``: compare the gradients and the backward operations too
        (``fn`` returns a scalar loss).
      argnums: Which positional arguments to differentiate, as for ``jax.grad``.
      loss_scale: The scale the policy's backward runs at (a number or an `fmp.GradScaler`, whose
        current scale is used); default ``2**16`` (a new GradScaler's) for a float16 compute dtype, else 1.
      fp8_state: Deprecated name of ``float8_state`` (warns; removed in the next release).

    Raises:
      TypeError: ``compare=True`` with traced arguments (call it outside ``jit``/``grad``), or a
        ``grads``, ``argnums`` or ``loss_scale`` of the wrong type.
      ValueError: ``grads=True`` without ``compare=True``, or a ``loss_scale`` that is not finite and > 0.
      NotImplementedError: ``compare=True`` on a ``shard_map`` body or a linear solve, or
        together with ``float8_state``.

    Examples:
      >>> rep = fmp.explain(lambda x, w: jax.nn.softmax(x @ w))(jnp.ones((4, 8)), jnp.ones((8, 8)))
      >>> [(r.op, r.out_after) for r in rep.records if r.op in ("dot_general", "exp")]
      [('dot_general', ('bfloat16',)), ('exp', ('float32',))]
      >>> rep.summary["low_precision_flop_share"]
      1.0
      >>> rules = fmp.DEFAULT_RULES.derive(lower_precision=["exp"])
      >>> x = jnp.linspace(0.0, 80.0, 64)
      >>> def f(x):
      ...     return jnp.exp(x).sum()
      >>> rep = fmp.explain(f, rules=rules, compare=True)(x)
      >>> top = rep.worst(1)[0]
      >>> top.op, top.added_error > 1e-3, top.suggestion  # outside any scope: its source line
      ('exp', True, 'overrides={"<doctest ...>:2:...": "float32"}')
      >>> rep.needs_fix == [top], fmp.explain(f, rules=rules, compare=True, **rep.suggested())(x).needs_fix
      (True, [])
      >>> def loss(p, x):
      ...     return jnp.mean(jnp.tanh(x @ p["w"]) ** 2)
      >>> params, x = {"w": jnp.eye(8) / 4}, jnp.linspace(-2.0, 2.0, 32).reshape(4, 8)
      >>> rep = fmp.explain(loss, "mixed_float16", compare=True, grads=True)(params, x)
      >>> err = rep.grad_errors["['w']"]
      >>> bool(err.error < 1e-2), bool(err.cosine > 0.9999), err.underflow, rep.grads.loss_scale
      (True, True, 0.0, 65536.0)
      >>> rep.worst(1, grads=True)[0].category
      'backward'
    """
    float8_state = renamed_argument(float8_state, fp8_state, "explain(fp8_state=...)", "explain(float8_state=...)")
    if not callable(fn):
        raise TypeError(f"explain(fn) expects a callable, got {type(fn).__name__}")
    config = configure(policy, rules, overrides)
    return explain_resolved(fn, config, float8_state, compare, grads, argnums, loss_scale)


def explain_resolved(
    fn: Callable[..., Any],
    config: ResolvedPolicy,
    float8_state: Float8State | None = None,
    compare: bool = False,
    grads: bool = False,
    argnums: int | Sequence[int] = 0,
    loss_scale: float | GradScaler | None = None,
) -> Callable[..., Report]:
    """``explain(fn, ...)`` of a policy already resolved (`fmp.testing.assert_precision` resolves it once for
    its explain and its autocast); validates the other arguments as ``explain`` does."""
    if not isinstance(compare, bool):
        raise TypeError(f"explain(compare=...) expects True or False, got {compare!r}")
    if compare and float8_state is not None:
        raise NotImplementedError(_MSG_COMPARE_STATE)
    argnums, scale = _grad_args(compare, grads, argnums, loss_scale, config.policy)
    if float8_state is not None:
        check_state(float8_state, config.policy, config.overrides, str(config.policy))

    traces = _cache.Traces()  # the compiled gradients of each argument signature, for repeated calls
    policy_fn = autocast_resolved(fn, config) if grads else None

    def run(*args: Any, **kwargs: Any) -> Report:
        check_args(args, kwargs, api="fmp.explain")
        closed, arrays, out_tree = trace(fn, args, kwargs)
        sites = None if float8_state is None else SiteFeeder(float8_state)
        ctx = make_context(config, records=[], fp8_sites=sites)
        ends = None
        if not compare:
            rewrite_top(closed, ctx)
        else:  # one compiled program, op by op where one program does not do
            ends = _compiled.run(closed, arrays, ctx, fn)
            ends = ends if ends is not None else _forward.run(closed, arrays, ctx)
        if sites is not None:
            sites.finish()
        records = choose(tuple(ctx.records or ()), config.rules)  # which float8 matmuls to keep in bfloat16
        back = None
        if grads:
            fp16 = config.policy.compute_dtype == jnp.float16
            s = scale if scale is not None else (INIT_SCALE if fp16 else 1.0)
            back = _grads.compare(fn, policy_fn, args, kwargs, argnums, s, fp16, records, config.rules, traces)
        outputs = _outputs.split(ends) if ends is not None else ([], [])
        errors = [_outputs.named(e, out_tree) for e in outputs] if compare else [None, None]
        return Report(
            records,
            policy=str(config.policy),
            framework="jax",
            compared=compare,
            grads=back,
            output_error=errors[0],
            baseline_error=errors[1],
        )

    return run


def _grad_args(compare: bool, grads: bool, argnums: Any, loss_scale: Any, policy: Policy) -> tuple[Any, Any]:
    """Validates the gradient arguments: ``(argnums, scale or None)``."""
    if not isinstance(grads, bool):
        raise TypeError(f"explain(grads=...) expects True or False, got {grads!r}")
    if grads and not compare:
        raise ValueError("explain(grads=True) compares gradients: pass compare=True as well")
    if isinstance(argnums, int) and not isinstance(argnums, bool):
        pass
    elif isinstance(argnums, Sequence) and argnums and all(type(a) is int for a in argnums):
        argnums = tuple(argnums)
    else:
        raise TypeError(f"explain(argnums=...) expects an int or a sequence of ints, as jax.grad, got {argnums!r}")
    if isinstance(loss_scale, GradScaler):
        loss_scale = float(loss_scale.loss_scale)
    if loss_scale is not None:
        if isinstance(loss_scale, bool) or not isinstance(loss_scale, int | float):
            raise TypeError(f"explain(loss_scale=...) expects a number or an fmp.GradScaler, got {loss_scale!r}")
        if not (math.isfinite(loss_scale) and loss_scale > 0):
            raise ValueError(f"explain(loss_scale=...) must be finite and > 0, got {loss_scale!r}")
        loss_scale = float(loss_scale)
    return argnums, loss_scale


__all__ = ["explain", "explain_resolved", "flops"]
