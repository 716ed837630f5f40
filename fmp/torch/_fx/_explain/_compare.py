"""``explain_fx(compare=True)``: the autocast graph against the graph as written, op by op, and gradients.

Two interpreters run side by side on the same inputs: one the traced graph as written (float32, no
autocast: the reference), one the rewritten graph (the policy). The rewrite maps every node of the
traced graph to the node that holds its value in the new graph, so each op's policy output meets its
reference output as soon as both exist; the statistics are kept and both values are freed after their
last use (no run keeps every intermediate; the runs are ``_runner``'s). An op's own error runs the new graph's piece that computes
it (the op and the casts its rule inserted, or a decomposition) on the reference inputs rounded as they
reached it, against the op as written on the same rounded inputs. The statistics, the rounding, the blame
and the fixes are the comparison core's (``fmp._report``), the JAX side's own, on ``TORCH_OPS``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from fmp._core._dtypes import LOW_PRECISION
from fmp._core._rules import RuleSet
from fmp._report import _compare as core
from fmp._report._blame import Job, fill_rows
from fmp._report._grads import GradError, grad_error
from fmp._report._records import OpRecord
from fmp.torch._fx._common import TO_COPY, Event, float_names
from fmp.torch._fx._explain._runner import Runner, check_random, clone

_MSG_LOSS = (
    "explain_fx(grads=True) differentiates the program's output, which must be one floating scalar (the "
    "loss); got {got}. Wrap the model in a module whose forward returns the loss (a Hugging Face model: "
    "model(input_ids, labels=labels, use_cache=False).loss)."
)


class TorchCompareOps:
    """The comparison core's adapter (``fmp._report._compare.CompareOps``) for torch tensors."""

    @staticmethod
    def dtype_name(x: Any) -> str:
        return str(x.dtype).removeprefix("torch.") if isinstance(x, torch.Tensor) else ""

    @staticmethod
    def astype(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return x.to(like.dtype)

    @staticmethod
    def parts(p: torch.Tensor, r: torch.Tensor) -> core.Parts:
        """On the tensors' own device, in ``wide_dtype``, as the JAX side's compiled statistics."""
        wide = getattr(torch, core.wide_dtype(TorchCompareOps.dtype_name(p), TorchCompareOps.dtype_name(r)))
        with torch.no_grad():
            return core.array_parts(torch, p.detach().to(wide), r.detach().to(wide), _top)

    @staticmethod
    def changed(p: Any, r: torch.Tensor) -> int:
        return int(torch.count_nonzero(p != r)) if isinstance(p, torch.Tensor) and p.shape == r.shape else 0


TORCH_OPS = TorchCompareOps()


def _top(x: torch.Tensor) -> torch.Tensor:
    return x.max() if x.numel() else x.new_zeros(())


def output_stats(outs: Any, refs: Any) -> core.Stats:
    """The ``Stats`` of the tensors in ``outs`` against ``refs`` (the structures flattened alike): the
    comparison core's ``output_stats`` on ``TORCH_OPS``."""
    return core.output_stats(TORCH_OPS, pytree.tree_leaves(outs), pytree.tree_leaves(refs))


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else n


def _inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    return node.all_input_nodes


def _alone(
    new_gm: torch.fx.GraphModule, node: torch.fx.Node, arrived: dict[torch.fx.Node, Any], interp: torch.fx.Interpreter
) -> Any:
    """``node`` of the new graph computed from ``arrived`` (values of its frontier): the casts and pieces
    between them evaluated on the way. ``None`` when the piece reaches a value that did not arrive."""
    memo = dict(arrived)

    def value(n: torch.fx.Node) -> Any:
        if n in memo:
            return memo[n]
        if n.op == "get_attr":
            memo[n] = interp.fetch_attr(n.target)
        elif n.op == "call_function":
            args = torch.fx.node.map_arg((n.args, n.kwargs), value)
            if isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable:
                args = clone(args)
            memo[n] = n.target(*args[0], **args[1])
        else:
            raise LookupError(n.name)
        return memo[n]

    try:
        return value(node)
    except LookupError:
        return None


def _as_ran(row: OpRecord, node: torch.fx.Node, env: dict[torch.fx.Node, Any]) -> OpRecord:
    """``row`` with the floating dtypes of the values the policy run gave ``node`` and its inputs."""
    ins = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: env.get(a))
    return dataclasses.replace(row, in_after=float_names(ins), out_after=float_names(env.get(node)))


def compare(
    bound: torch.fx.GraphModule,
    new: torch.fx.GraphModule,
    env: dict[torch.fx.Node, Any],
    events: list[Event],
    rows: list[OpRecord],
    leaves: Sequence[Any],
    rules: RuleSet,
    dtype: torch.dtype,
) -> tuple[list[OpRecord], tuple[list[Any], list[Any]]]:
    """``rows`` (one per event) with each compared op's errors and suggestion, and per output the relative
    error of the policy run and of the baseline at ``dtype``, the compute dtype (``_ends``)."""
    check_random(bound.graph)
    row_of = {ev.node: i for i, ev in enumerate(events) if ev.category != "cast"}
    casts = {ev.node for ev in events if ev.category == "cast"}
    rows = list(rows)
    jobs: list[Job[core.Stats]] = []
    ref = Runner(bound, [clone(x) for x in leaves], regions=True)
    pol = Runner(new, [clone(x) for x in leaves], regions=False)
    done: set[torch.fx.Node] = set()

    def row_at(node: torch.fx.Node) -> OpRecord | None:  # the compared row of a node of ``bound``
        made = env.get(node)
        return rows[row_of[made]] if isinstance(made, torch.fx.Node) and made in row_of else None

    with torch.no_grad():
        for b in bound.graph.nodes:
            n = env.get(b)
            if not isinstance(n, torch.fx.Node) or n not in row_of or n in done:
                continue
            if not (ref.until(b) and pol.until(n)) or b not in ref.env or n not in pol.env:
                continue
            done.add(n)
            ins = [a for a in b.all_input_nodes if isinstance(env.get(a), torch.fx.Node) and a in ref.env]
            arrived, back = core.as_arrived(TORCH_OPS, [ref.before(a) for a in ins], [_val(env[a]) for a in ins])
            alone = _alone(new, n, dict(zip([env[a] for a in ins], arrived, strict=True)), pol.interp)
            if back is None:
                baseline = ref.env[b]
            else:
                with ref.autocast():
                    baseline = _alone(bound, b, dict(zip(ins, back, strict=True)), ref.interp)
            down = any(
                a in casts
                and a.target is TO_COPY
                and str(a.kwargs.get("dtype")).removeprefix("torch.") in LOW_PRECISION
                for a in n.all_input_nodes
            )
            rows[row_of[n]] = _as_ran(rows[row_of[n]], n, pol.env)  # its dtypes: the values that ran
            added = output_stats(alone, baseline) if alone is not None and baseline is not None else None
            jobs.append(Job(row_of[n], output_stats(pol.env[n], ref.env[b]), added, down, b))
        fill_rows(rows, jobs, rules, _inputs, row_at, "torch")
        ends = _ends(bound, new, ref, pol, leaves, dtype)
    return rows, ends


def _output(gm: torch.fx.GraphModule, runner: Runner) -> list[Any]:
    """The tensors a graph returns, from a run of it (run to the end here)."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    runner.until(out)
    return pytree.tree_leaves(torch.fx.node.map_arg(out.args[0], lambda n: runner.env.get(n)))


def _rounded(x: Any, dtype: torch.dtype) -> Any:
    """A floating tensor wider than ``dtype`` rounded to it and back; anything else as it is."""
    if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.element_size() > dtype.itemsize):
        return x
    return x.detach().to(dtype).to(x.dtype)


def _ends(
    bound: torch.fx.GraphModule, new: torch.fx.GraphModule, ref: Runner, pol: Runner, leaves: Sequence[Any], dtype
) -> tuple[list[Any], list[Any]]:
    """Per output: the relative error of the policy run's value, and of the baseline's (the graph as written
    on its floating inputs and parameters rounded to ``dtype``), against the reference's."""
    refs, outs = _output(bound, ref), _output(new, pol)
    base = Runner(bound, [_rounded(clone(x), dtype) for x in leaves], regions=True)
    fetch = base.interp.fetch_attr
    base.interp.fetch_attr = lambda target: _rounded(fetch(target), dtype)  # parameters and buffers
    lows = _output(bound, base)
    errors = [output_stats(p, r).error for p, r in zip(outs, refs, strict=True)]
    return errors, [output_stats(b, r).error for b, r in zip(lows, refs, strict=True)]


def grad_errors(
    module: torch.nn.Module | None, bound: torch.fx.GraphModule, new: torch.fx.GraphModule, inputs: Sequence[Any]
) -> dict[str, GradError]:
    """Each parameter's gradient of the policy's loss against that of the program as written."""
    if module is None:
        raise TypeError("explain_fx(grads=True) compares parameter gradients: pass a torch.nn.Module")
    params = {k: p for k, p in module.named_parameters() if p.requires_grad}
    grads = []
    for gm in (bound, new):
        with torch.enable_grad():
            loss = gm(*clone(list(inputs)))
            if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.dtype.is_floating_point):
                got = f"a {type(loss).__name__}" if not isinstance(loss, torch.Tensor) else f"shape {tuple(loss.shape)}"
                raise ValueError(_MSG_LOSS.format(got=got))
            grads.append(torch.autograd.grad(loss.float().sum(), list(params.values()), allow_unused=True))
    out = {}
    for name, r, p in zip(params, *grads, strict=True):
        if r is not None and p is not None:
            with torch.no_grad():
                out[name] = grad_error(*(t.detach().to(torch.float64).cpu().numpy() for t in (p, r)))
    return out
