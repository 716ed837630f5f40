"""Precision checks for users' own tests: ``fmp.testing.assert_precision`` and ``fmp.testing.assert_plan``.

A test asserts that a model runs under a mixed-precision policy with no op that needs a fix and with its
outputs (and, with ``grads=True``, its gradients) within a relative error of the program as written.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from fmp._autocast._explain._api import explain_resolved
from fmp._autocast._explain._plan import Runner
from fmp._autocast._float8_checks import check_state
from fmp._autocast._transform import configure
from fmp._autocast._wrap import autocast_resolved
from fmp._plan import _check
from fmp._plan._plan import Plan
from fmp._policy import Policy
from fmp._report._records import Report
from fmp._report._verdict import GRADIENT, failure

__all__ = ["assert_plan", "assert_precision"]

_KWARGS = ("rules", "overrides")


def assert_precision(
    fn: Callable[..., Any],
    policy: str | Policy,
    *args: Any,
    max_error: float | None = None,
    grads: bool = False,
    argnums: int | tuple[int, ...] = 0,
    **autocast_kwargs: Any,
) -> Report:
    """Asserts that ``fn(*args)`` keeps its precision under ``policy``; returns the precision report.

    Runs ``fmp.explain(fn, policy, compare=True)(*args)`` and ``fmp.autocast(fn, policy)(*args)`` against
    ``fn(*args)`` as written. Fails where an op needs a fix (``Report.needs_fix``: it overflows, flips
    discrete outputs or adds an error far above its dtype's roundoff), where an output leaf is not finite,
    or where an output leaf's relative L2 error is above ``max_error``. With ``grads=True`` (``fn``
    returns a scalar loss) each gradient leaf of the ``argnums`` arguments is bounded the same way; a leaf
    whose reference gradient is tiny against the whole gradient (its norm below 1e-3 of the gradient's, such
    as an attention key's bias, whose exact gradient is zero) is judged by its absolute error against the
    gradient's norm instead, and the message says so. Under pytest a failure shows the message, not this
    function's source or arguments.

    Args:
      fn: The function to check, called as ``fn(*args)``.
      policy: As for `fmp.autocast` (``"mixed_bfloat16"``, ``"mixed_float16"``, a `Policy`).
      *args: The inputs, concrete arrays (call it outside ``jit``).
      max_error: The largest relative L2 error allowed for each output leaf (and gradient leaf); ``None``
        bounds only the verdict and finiteness.
      grads: Also compare the gradients of ``argnums`` (``fn`` returns a scalar).
      argnums: Which positional arguments to differentiate, as for ``jax.grad``.
      **autocast_kwargs: ``rules=`` and ``overrides=``, as for `fmp.autocast` (paste
        ``**report.suggested()`` here to check the fixes).

    Returns:
      The ``Report`` of ``fmp.explain(fn, policy, compare=True, grads=grads)``.

    Raises:
      AssertionError: The check fails; the message opens with the verdict (its second line: the output's
        error against the baseline), then the outputs above ``max_error``, a count of the gradient leaves
        above it with the five worst, and the worst op's source line, error and suggestion.
      TypeError: An ``autocast_kwargs`` key other than ``rules`` or ``overrides``.
      ValueError: ``max_error`` is not a number >= 0.

    Examples:
      >>> from fmp.testing import assert_precision
      >>> def mlp(w, x):
      ...     return jnp.mean(jnp.tanh(x @ w) ** 2)
      >>> w, x = jnp.eye(8) / 2, jnp.linspace(-1.0, 1.0, 32).reshape(4, 8)
      >>> rep = assert_precision(mlp, "mixed_bfloat16", w, x, max_error=1e-2, grads=True)
      >>> rep.needs_fix
      []
      >>> assert_precision(lambda x: jnp.sum(x @ x.T), "mixed_float16", x * 1e3)
      Traceback (most recent call last):
        ...
      AssertionError: 1 op needs a fix (float16 unit roundoff u = 4.9e-04; ...
    """
    __tracebackhide__ = True  # pytest shows the message, not this function's source and arguments
    unknown = sorted(set(autocast_kwargs) - set(_KWARGS))
    if unknown:
        raise TypeError(
            f"assert_precision takes rules= and overrides= as autocast keywords, got {', '.join(unknown)}; "
            f"pass the inputs positionally after the policy"
        )
    if max_error is not None and (isinstance(max_error, bool) or not isinstance(max_error, int | float)):
        raise TypeError(f"assert_precision(max_error=...) expects a number or None, got {max_error!r}")
    if max_error is not None and not max_error >= 0:
        raise ValueError(f"assert_precision(max_error=...) must be >= 0, got {max_error!r}")
    config = configure(policy, **autocast_kwargs)  # once, for the report and the outputs alike
    check_state(None, config.policy, config.overrides, config.label)  # a delayed recipe runs current scaling
    report = explain_resolved(fn, config, compare=True, grads=grads, argnums=argnums)(*args)
    want = jax.tree_util.tree_leaves_with_path(fn(*args))
    got = jax.tree_util.tree_leaves(autocast_resolved(fn, config)(*args))
    errors = {f"output{jax.tree_util.keystr(k)}": _relative(g, w) for (k, w), g in zip(want, got, strict=True)}
    notes: dict[str, str] = {}
    if grads:
        for k, e in _judged(report.grad_errors).items():
            errors[f"{GRADIENT}{k}"], notes[f"{GRADIENT}{k}"] = e
    message = failure(
        report.records, report.policy, errors, max_error, notes, report.output_error, report.baseline_error
    )
    if message:
        raise AssertionError(message)
    return report


# a gradient leaf whose reference norm is below this fraction of the whole gradient's is tiny: its relative
# error measures rounding noise against a value near zero, so its absolute error is set against the gradient
TINY = 1e-3


def _judged(grad_errors: dict[str, Any]) -> dict[str, tuple[float, str]]:
    """Each gradient leaf's error and a note: its relative error, or, for a leaf whose reference gradient is
    tiny against the others' (``TINY``), its absolute error over the whole gradient's norm."""
    scale = math.sqrt(sum((e.norm or 0.0) ** 2 for e in grad_errors.values()))
    out = {}
    for k, e in grad_errors.items():
        if e.norm is not None and e.diff_norm is not None and scale > 0 and e.norm < TINY * scale:
            judged = e.diff_norm / scale
            note = (
                f" (tiny reference gradient: |g| = {e.norm:.1e} vs the gradient's {scale:.1e}, so judged by "
                f"absolute error over the gradient's norm; relative error {e.error:.2g})"
            )
            out[k] = (judged, note)
        else:
            out[k] = (e.error, "")
    return out


def _relative(got: Any, want: Any) -> float:
    """Relative L2 error of one floating leaf (0 for other leaves; inf where ``got`` is not finite)."""
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.issubdtype(np.asarray(want).dtype, np.floating) and np.asarray(want).dtype.name != "bfloat16":
        return 0.0
    if not np.all(np.isfinite(g)):
        return float("inf")
    norm = np.linalg.norm(w)
    diff = np.linalg.norm(g - w)
    return float(diff / norm) if norm > 0 else float(diff)


def assert_plan(
    fn: Callable[..., Any],
    plan: Plan,
    *args: Any,
    rtol: float = 0.5,
    argnums: int | tuple[int, ...] = 0,
) -> None:
    """Asserts that a precision plan (`fmp.plan`) still meets its budget on ``args``.

    Runs ``fn`` under the plan against float32 (the outputs and, for a plan made with gradients, the
    gradients of ``argnums``), and each site alone in its format. Fails where the plan's error is above
    ``plan.budget * (1 + rtol)``, or where a site's own error is above its share: the error it added when
    the plan was made, times ``plan.budget / plan.error``, times ``1 + rtol``.

    Args:
      fn: The function the plan was made for, called as ``fn(*args)``.
      plan: The `fmp.Plan` (made now or loaded with ``fmp.Plan.load``).
      *args: The inputs, concrete arrays (call it outside ``jit``).
      rtol: The slack over the budget and the shares (inputs other than the plan's add their own spread).
      argnums: Which positional arguments the plan's gradients were of, as for ``jax.grad``.

    Raises:
      AssertionError: The plan measures more than its budget, or a site more than its share; the message
        names the sites above their share, worst first. Under pytest a failure shows the message, not this
        function's source or arguments.
      TypeError, ValueError: ``plan`` is not an ``fmp.Plan``; ``rtol`` is not a number >= 0.

    Examples:
      >>> from fmp.testing import assert_plan
      >>> def loss(w, x):
      ...     with jax.named_scope("layer"):
      ...         return jnp.mean(jnp.tanh(x @ w) ** 2)
      >>> w, x = jnp.eye(16) / 2, jnp.linspace(-1.0, 1.0, 64).reshape(4, 16)
      >>> plan = fmp.plan(loss, w, x)
      >>> assert_plan(loss, plan, w, x * 2)
      >>> assert_plan(loss, plan, w, x * 1e3, rtol=0.0)
      Traceback (most recent call last):
        ...
      AssertionError: the plan measures ...
    """
    __tracebackhide__ = True  # pytest shows the message, not this function's source and arguments
    if not isinstance(plan, Plan):
        raise TypeError(f"assert_plan(fn, plan, ...) expects an fmp.Plan, got {type(plan).__name__}")
    if isinstance(rtol, bool) or not isinstance(rtol, int | float) or not rtol >= 0:
        raise ValueError(f"assert_plan(rtol=...) expects a number >= 0, got {rtol!r}")
    runner = Runner(fn, [tuple(args)], plan.grad_error is not None, argnums, None)
    message = _check.failure(plan, runner, float(rtol))
    if message:
        raise AssertionError(message)
