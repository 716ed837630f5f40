"""``fmp.plan``: the JAX face of the precision plan. It finds the sites (``fmp.explain``'s rows under a
float8 policy), runs each assignment the search asks for (compiled, on every batch, against the program in
float32) and leaves the choosing to ``fmp._plan``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from fmp._autocast._explain._api import explain
from fmp._autocast._wrap import autocast
from fmp._core._rules import RuleSet
from fmp._plan._device import Device, device_of
from fmp._plan._formats import DEFAULT_FORMATS, FORMATS, formats_of
from fmp._plan._measure import arg_sets, leaf, measured, worse
from fmp._plan._plan import Plan, check_budget, make_plan
from fmp._plan._search import Assignment, Measured, policy_and_overrides
from fmp._plan._sites import sites_of

GROUP = 8  # assignments compiled together


def plan(
    fn: Callable[..., Any],
    *args: Any,
    budget: float | None = None,
    formats: Sequence[str] = DEFAULT_FORMATS,
    grads: bool = True,
    batches: Sequence[Any] | None = None,
    device: str | Mapping[str, Any] | Device = "h100",
    argnums: int | Sequence[int] = 0,
    rules: RuleSet | None = None,
) -> Plan:
    """Chooses a format for every matmul and convolution of ``fn`` from errors measured on its inputs.

    A *site* is the ``overrides`` key of matmuls and convolutions with a weight operand (their innermost
    ``jax.named_scope`` or flax module path, else their source line). Each site is run alone in each of its
    candidate formats (the others in float32) and the error it adds to the outputs and, with ``grads=True``,
    to the gradients of the ``argnums`` arguments is measured (relative L2 against float32; the worst
    gradient leaf; the worst batch). The candidates are ``formats`` where the device model runs them and
    they pay (a float8 format not for GEMMs below torchao's size rule); non-matmul ops follow the rule table.

    ``budget=None``: every site in its cheapest format, except where that format overflows, flips discrete
    outputs or its error stands out from the alike sites' (above its unit roundoff and 3x their median, or
    above 4 unit roundoffs); the combined plan is measured and that error is its budget. A ``budget``:
    the cheapest plan of a fixed sequence (the worst site moved one format up at a time) whose combined
    error, measured by running it, is within the budget; a looser budget never gives a costlier plan.

    Args:
      fn: The function; with ``grads=True`` it returns a scalar loss.
      *args: Its arguments (concrete arrays: call it outside ``jit``).
      budget: The largest relative L2 error allowed (outputs, and each gradient leaf), or ``None``.
      formats: Candidate names: ``"float8"`` (tensorwise), ``"float8_rowwise"``, ``"float8_blockwise"``,
        ``"mxfp8"``, ``"mxfp4"``, ``"nvfp4"`` (offered where the device has them: ``"b200"``),
        ``"bfloat16"``, ``"float32"``.
      grads: Measure the gradients of ``argnums`` too, and price the backward GEMMs.
      batches: More inputs to measure on: each a tuple that replaces the last arguments of ``args``
        (``fmp.plan(loss, params, x, y, batches=[(x1, y1), (x2, y2)])``), or one value replacing the
        last argument; every batch must have the shapes of ``args``'.
      device: ``"h100"``, ``"h200"``, ``"b200"``, or a table ``{"peak": {"float32": FLOP/s, "bfloat16":
        FLOP/s, "float8": FLOP/s}, "bandwidth": bytes/s, "size_rule": True}`` (the precision guide
        names the sources of the built-in peaks).
      argnums: The arguments whose gradients are measured, as for ``jax.grad``.
      rules: As for `fmp.autocast`.

    Returns:
      An `fmp.Plan`: ``fmp.autocast(fn, plan.policy, overrides=plan.overrides)`` runs it.

    Raises:
      ValueError: No site, an unknown format or device, a budget no plan meets, a bad ``batches``.
      TypeError: Arguments of the wrong type; ``grads=True`` with a loss that is not a scalar.

    Examples:
      >>> def loss(p, x):
      ...     with jax.named_scope("mlp"):
      ...         h = jnp.tanh(x @ p["w1"])
      ...     with jax.named_scope("head"):
      ...         return jnp.mean((h @ p["w2"]) ** 2)
      >>> p = {"w1": jnp.eye(16) / 2, "w2": jnp.ones((16, 16)) / 4}
      >>> x = jnp.linspace(-1.0, 1.0, 64).reshape(4, 16)
      >>> plan = fmp.plan(loss, p, x)
      >>> plan.formats  # on an H100, float8 does not pay for GEMMs this small
      {'mlp': 'bfloat16', 'head': 'bfloat16'}
      >>> plan.policy, plan.overrides
      ('mixed_bfloat16', {})
      >>> bool(plan.error <= plan.budget)
      True
    """
    if not callable(fn):
        raise TypeError(f"plan(fn) expects a callable, got {type(fn).__name__}")
    if not isinstance(grads, bool):
        raise TypeError(f"plan(grads=...) expects True or False, got {grads!r}")
    fmts, dev, budget = formats_of(formats), device_of(device), check_budget(budget)
    sets = arg_sets(args, batches)
    quant = next((f for f in fmts if f.quantised), FORMATS["float8"])
    sites = sites_of(explain(fn, quant.policy, rules=rules)(*sets[0]).records)
    measure = Runner(fn, sets, grads, argnums, rules)
    return make_plan(sites, measure, budget=budget, formats=fmts, device=dev, grads=grads, framework="jax")


class Runner:
    """Runs assignments compiled on every argument set, against the program as written (float32)."""

    def __init__(self, fn: Callable[..., Any], arg_sets: list[tuple[Any, ...]], grads: bool, argnums: Any, rules: Any):
        self.fn, self.arg_sets, self.grads, self.argnums, self.rules = fn, arg_sets, grads, argnums, rules
        self.refs = [self._call(fn, a) for a in arg_sets]  # NumPy leaves

    def _call(self, fn: Callable[..., Any], a: tuple[Any, ...]) -> tuple[Any, Any]:
        if not self.grads:
            return _leaves(jax.jit(fn)(*a)), None
        try:
            out, g = jax.jit(jax.value_and_grad(fn, self.argnums))(*a)
        except TypeError as e:
            if "scalar" not in str(e):
                raise
            raise TypeError(f"plan(grads=True) differentiates fn: it must return a scalar loss ({e})") from None
        return _leaves(out), _leaves(g)

    def _program(self, assignment: Assignment) -> Callable[..., Any]:
        policy, overrides = policy_and_overrides(assignment)
        g = autocast(self.fn, policy, rules=self.rules, overrides=overrides)
        return jax.value_and_grad(g, self.argnums) if self.grads else g

    def __call__(self, assignment: Assignment) -> Measured:
        return self.many([assignment])[0]

    def many(self, assignments: Sequence[Assignment]) -> list[Measured]:
        """Each assignment measured; up to ``GROUP`` of them compiled as one program (one compilation costs
        less than several of the same size together)."""
        out: list[Measured] = []
        for start in range(0, len(assignments), GROUP):
            programs = [self._program(a) for a in assignments[start : start + GROUP]]
            run = jax.jit(lambda *a, ps=programs: [p(*a) for p in ps])
            worst = [Measured(0.0, 0.0, 0.0 if self.grads else None) for _ in programs]
            for a, (ref, ref_g) in zip(self.arg_sets, self.refs, strict=True):
                for i, got in enumerate(run(*a)):
                    o, g = got if self.grads else (got, None)
                    worst[i] = worse(worst[i], measured(ref, _leaves(o), ref_g, None if g is None else _leaves(g)))
            out += worst
        return out


def _leaves(tree: Any) -> list[np.ndarray]:
    return [leaf(x) for x in jax.tree_util.tree_leaves(tree)]
