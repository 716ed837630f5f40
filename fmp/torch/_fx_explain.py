"""The precision report of the FX autocast rewrite: the same ``Report`` as ``fmp.explain`` for JAX."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

import fmp
from fmp._core._report import OpRecord, Report, short_source
from fmp._core._rules import RuleSet
from fmp.torch import _fx
from fmp.torch._fx_common import Event, _float_names
from fmp.torch._fx_float8 import apply_float8, check_kernel, float8_events
from fmp.torch._fx_policy import float8_recipe

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, fmp))
_MATMUL = {"aten::mm", "aten::bmm", "aten::matmul", "aten::linear", "aten::addmm", "aten::baddbmm", "aten::addbmm"}
_MATMUL |= {"aten::_addmm_activation", "aten::linalg_vecdot", "fmp::float8_linear"}


def _source(node: torch.fx.Node | None) -> str:
    """``/path/to/file.py:12 (fn)`` of the innermost user frame of a node's stack trace, or ``""``."""
    trace = node.meta.get("stack_trace", "") if node is not None else ""
    frames = _FRAME.findall(trace or "")
    for path, line, fn in reversed(frames):
        if not path.startswith(_LIBRARY_DIRS):
            return f"{path}:{line} ({fn})"
    return ""


def _scope(node: torch.fx.Node | None) -> str:
    stack = node.meta.get("nn_module_stack") if node is not None else None
    if not stack:
        return ""
    path, _cls = list(stack.values())[-1]
    return str(path)


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


def _cast_scope(node: torch.fx.Node, origin: torch.fx.Node) -> str:
    """What an inserted cast casts: a parameter's qualified name, a graph input, or the consumer's activation."""
    operand = node.args[0] if node.args else None
    if isinstance(operand, torch.fx.Node) and operand.op == "get_attr":
        return str(operand.target)
    if isinstance(operand, torch.fx.Node) and operand.op == "placeholder":
        return f"input {operand.target}"
    name = f"{operand.name} (activation)" if isinstance(operand, torch.fx.Node) else "activation"
    scope = _scope(origin)
    return f"{scope}: {name}" if scope else name


def records(events: list[Event]) -> tuple[OpRecord, ...]:
    rows = []
    for i, ev in enumerate(events):
        node = ev.node
        origin = ev.origin if ev.origin is not None else node
        full = _source(origin)
        rows.append(
            OpRecord(
                index=i,
                op=ev.op,
                source=short_source(full),
                source_full=full,
                scope=_cast_scope(node, origin) if ev.category == "cast" else _scope(origin),
                category=ev.category,
                in_before=ev.in_before,
                in_after=ev.in_after,
                out_before=ev.out_before,
                out_after=_float_names(node.meta.get("val")),
                flops=_flops(ev.op, node),
                detail=ev.detail,
            )
        )
    return tuple(rows)


def _policy_name(device_type: str, dtype: torch.dtype) -> str:
    return f"autocast(device_type={device_type!r}, dtype={str(dtype).removeprefix('torch.')})"


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
    device_type, dtype, rules = _fx.resolve_policy(policy, device_type, dtype, rules)
    events: list[Event] = []
    _fx.rewrite(graph_module, device_type, dtype, rules, events)
    return Report(records(events), _policy_name(device_type, dtype), "torch")


def explain_fx(
    fn_or_module: Callable | torch.nn.Module,
    example_inputs: Sequence[Any],
    policy: Any = None,
    *,
    device_type: str | None = None,
    dtype: Any = None,
    rules: RuleSet | None = None,
    float8_matmul: str = "auto",
) -> Report:
    """The precision report of `autocast_fx`: which op runs in which dtype, and why.

    Takes the arguments of `autocast_fx`. Each row gives the op
    (``aten::linear``), the user's source line, the rule (``lower_precision``,
    ``float32``, ``promote``, ``unlisted``, ``cast`` for an inserted cast,
    ``user_cast`` for one the program makes, ``float8`` for a float8 matmul, whose
    ``detail`` names its scaling, its kernel and the op it replaced: ``"rowwise, scaled_mm (aten::linear)"``), and the floating dtypes of its
    inputs and outputs before and after the rewrite. ``str(report)`` is a table.

    Returns:
      An ``fmp`` ``Report`` with ``framework="torch"``, comparable row for row with
      the JAX ``fmp.explain``.

    Examples:
      >>> import torch
      >>> lin = torch.nn.Linear(4, 3)
      >>> report = fmp.torch.explain_fx(lin, (torch.ones(2, 4),), ("cpu", torch.bfloat16))
      >>> [(r.op, r.category, r.out_after) for r in report.records]  # doctest: +NORMALIZE_WHITESPACE
      [('aten::_to_copy', 'cast', ('bfloat16',)), ('aten::_to_copy', 'cast', ('bfloat16',)),
       ('aten::_to_copy', 'cast', ('bfloat16',)), ('aten::linear', 'lower_precision', ('bfloat16',))]
    """
    device_type, dtype, rules = _fx.resolve_policy(policy, device_type, dtype, rules, float8=True)
    recipe = float8_recipe(policy)
    kernel = check_kernel(float8_matmul, recipe, policy)
    gm, names, codegen = _fx.trace(fn_or_module, example_inputs, device_type, dtype)
    module = fn_or_module if isinstance(fn_or_module, torch.nn.Module) else None
    bound = _fx.bind_state(gm, module, names, codegen)
    if recipe is not None:
        apply_float8(bound, recipe, (), device_type, dtype, _fx._fake_mode_of(bound.graph), kernel)
    events: list[Event] = []
    out = _fx.rewrite(bound, device_type, dtype, rules, events)
    return Report(records(float8_events(out.graph, events)), _policy_name(device_type, dtype), "torch")
