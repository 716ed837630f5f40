"""``fmp.torch.plan_fx``: the torch face of the precision plan. It finds the sites (`explain_fx`'s rows
under a float8 policy: module paths), runs each assignment the search asks for through `autocast_fx` on
every batch against the module as written, and leaves the choosing to ``fmp._plan``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from fmp._plan._device import Device, device_of
from fmp._plan._formats import DEFAULT_FORMATS, FORMATS, formats_of
from fmp._plan._measure import arg_sets, leaf, measured, worse
from fmp._plan._plan import Plan, check_budget, make_plan
from fmp._plan._search import Assignment, Measured, policy_and_overrides
from fmp._plan._sites import sites_of
from fmp.torch._fx._api import autocast_fx
from fmp.torch._fx._explain._api import explain_fx


def plan_fx(
    module: torch.nn.Module,
    example_inputs: Sequence[Any],
    *,
    budget: float | None = None,
    formats: Sequence[str] = DEFAULT_FORMATS,
    grads: bool = True,
    batches: Sequence[Any] | None = None,
    device: str | Mapping[str, Any] | Device = "h100",
) -> Plan:
    """`fmp.plan` for a torch module: a format for every ``linear``/``matmul`` with a weight, by module path.

    Each site (the module path of matmuls whose second operand is a 2-D parameter: what `autocast_fx`
    runs in float8) is run alone in each candidate format through `autocast_fx` (the others as written,
    in float32), and the error it adds to the output and, with ``grads=True``, to each parameter's
    gradient is measured against the module as written; the choice is `fmp.plan`'s, and so is the
    returned `fmp.Plan`. Run it with ``fmp.torch.autocast_fx(module, inputs, plan.policy,
    overrides=plan.overrides)``. Only ``"float8"`` and ``"float8_rowwise"`` run in torch (one of them
    per plan), besides ``"bfloat16"`` and ``"float32"``.

    Args:
      module: The module; with ``grads=True`` it returns a scalar loss.
      example_inputs: Its positional inputs (a tuple).
      budget: As for `fmp.plan`.
      formats: As for `fmp.plan`.
      grads: Measure the parameters' gradients too, and price the backward GEMMs.
      batches: More inputs: each a tuple replacing the last inputs, or one tensor replacing the last.
      device: As for `fmp.plan`.

    Returns:
      An `fmp.Plan` (``framework="torch"``).

    Raises:
      ValueError, TypeError: As `fmp.plan`'s.

    Examples:
      >>> import torch
      >>> class Loss(torch.nn.Module):
      ...     def __init__(self):
      ...         super().__init__()
      ...         self.layer = torch.nn.Linear(16, 16)
      ...     def forward(self, x):
      ...         return self.layer(x).tanh().square().mean()
      >>> plan = fmp.torch.plan_fx(Loss(), (torch.linspace(-1.0, 1.0, 64).reshape(4, 16),))
      >>> plan.formats, plan.policy
      ({'layer': 'bfloat16'}, 'mixed_bfloat16')
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"plan_fx(module, ...) expects a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(grads, bool):
        raise TypeError(f"plan_fx(grads=...) expects True or False, got {grads!r}")
    fmts, dev, budget = formats_of(formats), device_of(device), check_budget(budget)
    inputs = arg_sets(tuple(example_inputs), batches)
    quant = next((f for f in fmts if f.quantised), FORMATS["float8"])
    sites = sites_of(explain_fx(module, inputs[0], quant.policy).records)
    runner = _Runner(module, inputs, grads)
    return make_plan(sites, runner, budget=budget, formats=fmts, device=dev, grads=grads, framework="torch")


class _Runner:
    """Runs assignments through `autocast_fx` on every input set, against the module as written."""

    def __init__(self, module: torch.nn.Module, inputs: list[tuple[Any, ...]], grads: bool) -> None:
        self.module, self.inputs, self.grads = module, inputs, grads
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.refs = [self._run(module, a) for a in inputs]

    def _run(self, fn: Callable[..., Any], a: tuple[Any, ...]) -> tuple[Any, Any]:
        out = fn(*a)
        if not self.grads:
            return _numpy(out), None
        if not (isinstance(out, torch.Tensor) and out.numel() == 1):
            raise TypeError("plan_fx(grads=True) differentiates the module: it must return a scalar loss")
        grads = torch.autograd.grad(out, self.params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, self.params, strict=True)]
        return _numpy(out), _numpy(grads)

    def __call__(self, assignment: Assignment) -> Measured:
        policy, overrides = policy_and_overrides(assignment)
        gm = autocast_fx(self.module, self.inputs[0], policy, overrides=overrides)
        worst = Measured(0.0, 0.0, 0.0 if self.grads else None)
        for a, (ref, ref_g) in zip(self.inputs, self.refs, strict=True):
            out, g = self._run(gm, a)
            worst = worse(worst, measured(ref, out, ref_g, g))
        return worst


def _numpy(x: Any) -> list[Any]:
    """The tensors of an output (a tensor, or a list, tuple or dict of them) as NumPy leaves."""
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu()
        return [leaf(t.double().numpy() if t.is_floating_point() else t.numpy())]
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, list | tuple):
        return [v for item in x for v in _numpy(item)]
    return []
