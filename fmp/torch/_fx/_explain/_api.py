"""The precision report of the FX autocast rewrite: the same ``Report`` as ``fmp.explain`` for JAX."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from fmp._core._rules import RuleSet
from fmp._report._float8_choice import choose
from fmp._report._grads import GradReport
from fmp._report._records import OpRecord, Report, short_source
from fmp._resolved import ResolvedPolicy
from fmp.torch._fx._common import Event, float_names, module_path, node_source
from fmp.torch._fx._explain import _compare
from fmp.torch._fx._explain._runner import kept_buffers
from fmp.torch._fx._float8 import float8_events
from fmp.torch._fx._prepare import low_dtype, prepare, resolve_policy, rewrite

_MATMUL = {"aten::mm", "aten::bmm", "aten::matmul", "aten::linear", "aten::addmm", "aten::baddbmm", "aten::addbmm"}
_MATMUL |= {"aten::_addmm_activation", "aten::linalg_vecdot", "fmp::float8_linear"}
_MSG_FLOAT8 = (
    "explain_fx(compare=True) does not compare float8 policies yet: compare under the policy without float8 "
    "(e.g. 'mixed_bfloat16'), or call explain_fx without compare=True to see the float8 rows."
)


def _flops(op: str, node: torch.fx.Node) -> float:
    """2·M·N·K for matrix products, 2·out·(C_in/g·k) for convolutions, 0 otherwise."""
    out = node.meta.get("val")
    args = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not isinstance(out, torch.Tensor) or not tensors:
        return 0.0
    if op in _MATMUL:
        first = (
            tensors[1]
            if op in ("aten::addmm", "aten::baddbmm", "aten::addbmm", "aten::_addmm_activation")
            else tensors[0]
        )
        k = first.shape[-1] if first.dim() else 1
        if op == "aten::addbmm":
            k *= first.shape[0]
        return 2.0 * out.numel() * k
    if "conv" in op and len(tensors) >= 2:
        weight = tensors[1]
        return 2.0 * out.numel() * math.prod(weight.shape[1:])
    return 0.0


def _gemm(node: torch.fx.Node) -> tuple[int, int, int] | None:
    """``(M, K, N)`` of a float8 matmul node (``float8_linear(x, w_t, ...)``, ``w_t`` of shape ``[K, N]``)."""
    x, w = (a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in node.args[:2])
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or w.dim() != 2:
        return None
    k, n = (int(d) for d in w.shape)
    return x.numel() // max(k, 1), k, n


def _cast_scope(node: torch.fx.Node, origin: torch.fx.Node) -> str:
    """What an inserted cast casts: a parameter's qualified name, a graph input, or the consumer's activation."""
    operand = node.args[0] if node.args else None
    if isinstance(operand, torch.fx.Node) and operand.op == "get_attr":
        return str(operand.target)
    if isinstance(operand, torch.fx.Node) and operand.op == "placeholder":
        return f"input {operand.target}"
    name = f"{operand.name} (activation)" if isinstance(operand, torch.fx.Node) else "activation"
    scope = module_path(origin)
    return f"{scope}: {name}" if scope else name


def records(events: list[Event]) -> tuple[OpRecord, ...]:
    rows = []
    for i, ev in enumerate(events):
        node = ev.node
        origin = ev.origin if ev.origin is not None else node
        full = node_source(origin)
        rows.append(
            OpRecord(
                index=i,
                op=ev.op,
                source=short_source(full),
                source_full=full,
                scope=_cast_scope(node, origin) if ev.category == "cast" else module_path(origin),
                category=ev.category,
                in_before=ev.in_before,
                in_after=ev.in_after,
                out_before=ev.out_before,
                out_after=float_names(node.meta.get("val")),
                flops=_flops(ev.op, node),
                detail=ev.detail,
                gemm=_gemm(node) if ev.category == "float8" else None,
            )
        )
    return tuple(rows)


def _policy_name(policy: ResolvedPolicy) -> str:
    return f"autocast(device_type={policy.device_type!r}, dtype={policy.compute})"


def explain_graph(
    graph_module: torch.fx.GraphModule,
    policy: Any = None,
    rules: RuleSet | None = None,
    *,
    device_type: str | None = None,
    dtype: Any = None,
) -> Report:
    """The precision report of `autocast_graph` on ``graph_module``.

    Args and policy spellings are those of `autocast_graph`.

    Returns:
      An ``fmp`` ``Report`` (``framework="torch"``): one row per ATen op of the
      rewritten graph and per inserted cast, with the rule that decided it and the
      floating dtypes before and after.

    Examples:
      >>> import torch
      >>> from torch.fx.experimental.proxy_tensor import make_fx
      >>> gm = make_fx(lambda a: torch.mm(a, a).sum(), pre_dispatch=True)(torch.ones(2, 2))
      >>> [(r.op, r.category) for r in fmp.torch.explain_graph(gm, "cpu").records]  # a cast per use, as eager
      [('aten::_to_copy', 'cast'), ('aten::_to_copy', 'cast'), ('aten::mm', 'lower_precision'), ('aten::sum', 'unlisted')]
    """
    if not isinstance(graph_module, torch.fx.GraphModule):
        raise TypeError(f"graph_module must be a torch.fx.GraphModule, got {type(graph_module).__name__}")
    resolved = resolve_policy(policy, device_type, dtype, rules)
    events: list[Event] = []
    rewrite(graph_module, resolved, events)
    return Report(records(events), _policy_name(resolved), "torch")


def explain_fx(
    fn_or_module: Callable | torch.nn.Module,
    example_inputs: Sequence[Any],
    policy: Any = None,
    *,
    device_type: str | None = None,
    dtype: Any = None,
    rules: RuleSet | None = None,
    overrides: Mapping[str, Any] | None = None,
    compare: bool = False,
    grads: bool = False,
    float8_matmul: str = "auto",
) -> Report:
    """The precision report of `autocast_fx`: which op runs in which dtype, and why.

    Takes the arguments of `autocast_fx`. Each row gives the op
    (``aten::linear``), the user's source line (as ``fmp.explain``'s: past torch and installed
    packages such as transformers; ``FMP_USER_PACKAGES`` names yours), the module path (``scope``), the rule
    (``lower_precision``, ``float32``, ``promote``, ``unlisted``, ``cast`` for an inserted
    cast, ``user_cast`` for one the program makes, ``override`` for an op a float32
    override runs as written, ``float8`` for a float8 matmul, whose ``detail`` names its
    scaling, its kernel and the op it replaced: ``"rowwise, scaled_mm (aten::linear)"``), and the floating dtypes of its inputs and outputs
    before and after the rewrite. ``str(report)`` is a table.

    With ``compare=True`` the program also runs, on ``example_inputs``: once as the traced
    graph is written (float32, no autocast: the reference) and once as the autocast graph,
    side by side, node by node, keeping per-op statistics rather than the intermediates.
    Each op's row then carries, as ``fmp.explain(compare=True)``'s do: ``error`` (relative
    L2 error of its output against the reference's, accumulated so far), ``added_error``
    (its own: the op and the casts its rule inserted, run on the reference inputs rounded
    as they reached it, against the op as written on those inputs), ``sqnr_db``,
    ``max_abs_error``, ``nonfinite`` (inf/NaN in the policy run only), ``flips`` (changed
    integer/boolean outputs: ``argmax``, ``topk`` indices, comparisons) and ``suggestion``
    (``overrides={"<module path>": "float32"}`` for ``autocast_fx``, or a
    ``RuleSet.derive`` line for an op outside any submodule); `Report.worst` ranks them.
    With ``grads=True`` as well, the program's output must be a scalar loss:
    ``report.grad_errors`` maps each parameter's name to its gradient's relative error and
    cosine against the reference gradient (a ``GradError``). The module's buffers
    (BatchNorm running statistics) are restored afterwards.

    Returns:
      An ``fmp`` ``Report`` with ``framework="torch"``, comparable row for row with
      the JAX ``fmp.explain``.

    Raises:
      ValueError: ``compare=True`` on a program that draws random numbers (dropout in
        training mode: call ``model.eval()``); ``grads=True`` whose output is not a scalar,
        or without ``compare=True``.
      NotImplementedError: ``compare=True`` with a float8 policy.

    Examples:
      >>> import torch
      >>> lin = torch.nn.Linear(4, 3)
      >>> report = fmp.torch.explain_fx(lin, (torch.ones(2, 4),), ("cpu", torch.bfloat16))
      >>> [(r.op, r.category, r.out_after) for r in report.records]  # doctest: +NORMALIZE_WHITESPACE
      [('aten::_to_copy', 'cast', ('bfloat16',)), ('aten::_to_copy', 'cast', ('bfloat16',)),
       ('aten::_to_copy', 'cast', ('bfloat16',)), ('aten::linear', 'lower_precision', ('bfloat16',))]
      >>> rules = fmp.DEFAULT_RULES.derive(framework="torch", lower_precision=["aten::softmax.int"])
      >>> logits = torch.linspace(0.0, 4.0, 128).reshape(8, 16) + 100.0  # large: bfloat16 loses them
      >>> rep = fmp.torch.explain_fx(lambda x: x.softmax(-1), (logits,), "cpu", rules=rules, compare=True)
      >>> top = rep.worst(1)[0]
      >>> top.op, top.added_error > 0.1, top.suggestion
      ('aten::softmax.int', True,
       'rules=fmp.DEFAULT_RULES.derive(framework="torch", float32=["aten::softmax.int"])')
      >>> mlp = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
      >>> loss = torch.nn.Sequential(mlp, torch.nn.Flatten(0))
      >>> sorted(fmp.torch.explain_fx(loss, (torch.randn(1, 16),), "cpu", compare=True, grads=True).grad_errors)
      ['0.0.bias', '0.0.weight', '0.2.bias', '0.2.weight']
    """

    def check(recipe: Any) -> None:
        if not isinstance(compare, bool) or not isinstance(grads, bool):
            raise TypeError(f"explain_fx(compare=..., grads=...) expects True or False, got {compare!r}, {grads!r}")
        if grads and not compare:
            raise ValueError("explain_fx(grads=True) compares gradients with the program as written: add compare=True")
        if compare and recipe is not None:
            raise NotImplementedError(_MSG_FLOAT8)

    prep = prepare(fn_or_module, example_inputs, policy, device_type, dtype, rules, overrides, float8_matmul, check)
    rules, bound, module = prep.policy.rules, prep.graph, prep.module
    events: list[Event] = []
    env: dict[torch.fx.Node, Any] = {}
    out = rewrite(bound, prep.policy, events, prep.written, env)
    events = float8_events(out.graph, events)
    rows = choose(records(events), rules, "torch")  # the size mark of float8 matmuls
    name = _policy_name(prep.policy)
    if not compare:
        return Report(rows, name, "torch")
    leaves = pytree.tree_leaves(list(example_inputs))
    with kept_buffers(module):
        low = low_dtype(prep.policy)
        compared, (errors, baselines) = _compare.compare(bound, out, env, events, list(rows), leaves, rules, low)
        grad_errors = _compare.grad_errors(module, bound, out, example_inputs) if grads else {}
    back = GradReport(errors=grad_errors, rows=(), loss_scale=1.0) if grads else None
    return Report(
        tuple(compared),
        name,
        "torch",
        compared=True,
        grads=back,
        output_error=_named(errors),
        baseline_error=_named(baselines),
    )


def _named(errors: Sequence[float | None]) -> float | dict[str, float] | None:
    """The error of the one floating output, or each floating output's by its position (``"[1]"``)."""
    if len(errors) == 1:
        return errors[0]
    return {f"[{i}]": e for i, e in enumerate(errors) if e is not None} or None
