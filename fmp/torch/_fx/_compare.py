"""``explain_fx(compare=True)``: the autocast graph against the graph as written, op by op, and gradients.

Two interpreters run side by side on the same inputs: one the traced graph as written (float32, no
autocast: the reference), one the rewritten graph (the policy). The rewrite maps every node of the
traced graph to the node that holds its value in the new graph, so each op's policy output meets its
reference output as soon as both exist; the statistics are kept and both values are freed after their
last use (no run keeps every intermediate). An op's own error runs the new graph's piece that computes
it (the op and the casts its rule inserted, or a decomposition) on the reference inputs rounded as they
reached it, against the op as written on the same rounded inputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx

from fmp._core._rules import RuleSet
from fmp._report._compare import FAR, suggestion, unit_roundoff
from fmp._report._grads import GradError
from fmp._report._records import LOW, OpRecord
from fmp.torch._fx._common import TO_COPY, Event, ambient_autocast
from fmp.torch._fx._compare_stats import grad_error, output_stats, round_as
from fmp.torch._fx._nested import ENTER_AUTOCAST, EXIT_AUTOCAST

_SKIP = (torch._C._set_grad_enabled,)  # grad mode switches: the forward comparison runs without autograd
_WALK = 16  # how many ops upstream a discrete op's flips are traced to low-precision producers
_MSG_RANDOM = (
    "explain_fx(compare=True) runs the program twice and needs the same random numbers in both runs, but "
    "node {node!r} ({op}) draws its own: call model.eval() (dropout off) or compare a program without it."
)
_MSG_LOSS = (
    "explain_fx(grads=True) differentiates the program's output, which must be one floating scalar (the "
    "loss); got {got}. Wrap the model in a module whose forward returns the loss (a Hugging Face model: "
    "model(input_ids, labels=labels, use_cache=False).loss)."
)


class _Runner:
    """Runs one graph node by node on real tensors; a value is freed one step after its last use."""

    def __init__(self, gm: torch.fx.GraphModule, leaves: Sequence[Any], regions: bool) -> None:
        self.interp = torch.fx.Interpreter(gm, garbage_collect_values=False)
        self.interp.args_iter = iter(leaves)
        self.env: dict[torch.fx.Node, Any] = self.interp.env
        self.nodes = iter(gm.graph.nodes)
        self.regions: list[dict[str, tuple[bool, torch.dtype]]] | None = [] if regions else None
        self.dead: list[torch.fx.Node] = []
        self.overwritten: dict[torch.fx.Node, Any] = {}  # inputs of the last in-place op, as they were before it
        self.last: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        seen: set[torch.fx.Node] = set()
        for node in reversed(gm.graph.nodes):
            for inp in node.all_input_nodes:
                if inp not in seen:
                    seen.add(inp)
                    self.last.setdefault(node, []).append(inp)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The autocast state the graph's own regions (``with torch.autocast(...)``) have opened."""
        return ambient_autocast(self.regions[-1]) if self.regions else contextlib.nullcontext()

    def until(self, target: torch.fx.Node) -> bool:
        """Runs up to and including ``target``; False when it ran before (its value may be gone)."""
        if target in self.env:
            return True
        for node in self.nodes:
            for old in self.dead:
                self.env.pop(old, None)
            self.dead = self.last.get(node, [])
            self.env[node] = self._run(node)
            if node is target:
                return True
        return False

    def _run(self, node: torch.fx.Node) -> Any:
        if node.op == "output":
            return None
        if node.op == "call_function" and node.target in _SKIP:
            return None
        if self.regions is not None and node.target is ENTER_AUTOCAST:
            device, dtype, enabled = node.args[0], node.args[1], node.args[2]
            state = dict(self.regions[-1]) if self.regions else {}
            state[device] = (bool(enabled), dtype if dtype is not None else torch.get_autocast_dtype(device))
            self.regions.append(state)
            return None
        if self.regions is not None and node.target is EXIT_AUTOCAST:
            if self.regions:
                self.regions.pop()
            return None
        self.overwritten = {}
        if isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable:
            written = [
                a.name for a in node.target._schema.arguments if a.alias_info is not None and a.alias_info.is_write
            ]
            named = dict(zip([a.name for a in node.target._schema.arguments], node.args, strict=False))
            named.update(node.kwargs)
            for name in written:
                if isinstance(named.get(name), torch.fx.Node) and named[name] in self.env:
                    self.overwritten[named[name]] = _clone(self.env[named[name]])
        with self.autocast():
            return self.interp.run_node(node)

    def before(self, node: torch.fx.Node) -> Any:
        """The value of ``node`` before the op just run wrote over it in place."""
        return self.overwritten[node] if node in self.overwritten else self.env[node]


def check_random(graph: torch.fx.Graph) -> None:
    """Refuses a graph that draws random numbers (dropout in training mode, ``torch.rand``)."""
    for node in graph.nodes:
        op = node.target
        if not (isinstance(op, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in op.tags):
            continue
        schema = op._schema.arguments
        named = {a.name: a.default_value for a in schema if a.has_default_value()}
        named.update(zip([a.name for a in schema], node.args, strict=False))
        named.update(node.kwargs)
        p = named.get("p", named.get("dropout_p"))
        if (p is not None and p == 0) or named.get("train") is False:
            continue  # dropout with p=0 or in eval mode: no draw
        raise ValueError(_MSG_RANDOM.format(node=node.name, op=op._schema.name))


@contextlib.contextmanager
def kept_buffers(module: torch.nn.Module | None) -> Iterator[None]:
    """Restores the module's buffers (BatchNorm running statistics) after the comparison's runs."""
    saved = {n: b.detach().clone() for n, b in module.named_buffers()} if module is not None else {}
    try:
        yield
    finally:
        if module is not None:
            with torch.no_grad():
                for n, b in module.named_buffers():
                    if n in saved:
                        b.copy_(saved[n])


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else n


def _clone(x: Any) -> Any:
    return torch.fx.node.map_aggregate(x, lambda v: v.clone() if isinstance(v, torch.Tensor) else v)


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
                args = _clone(args)
            memo[n] = n.target(*args[0], **args[1])
        else:
            raise LookupError(n.name)
        return memo[n]

    try:
        return value(node)
    except LookupError:
        return None


def compare(
    bound: torch.fx.GraphModule,
    new: torch.fx.GraphModule,
    env: dict[torch.fx.Node, Any],
    events: list[Event],
    rows: list[OpRecord],
    leaves: Sequence[Any],
    rules: RuleSet,
) -> list[OpRecord]:
    """``rows`` (one per event) with each compared op's errors and suggestion."""
    check_random(bound.graph)
    row_of = {ev.node: i for i, ev in enumerate(events) if ev.category != "cast"}
    casts = {ev.node for ev in events if ev.category == "cast"}
    rows = list(rows)
    ref = _Runner(bound, [_clone(x) for x in leaves], regions=True)
    pol = _Runner(new, [_clone(x) for x in leaves], regions=False)
    done: set[torch.fx.Node] = set()
    with torch.no_grad():
        for b in bound.graph.nodes:
            n = env.get(b)
            if not isinstance(n, torch.fx.Node) or n not in row_of or n in done:
                continue
            if not (ref.until(b) and pol.until(n)) or b not in ref.env or n not in pol.env:
                continue
            done.add(n)
            ins = [a for a in b.all_input_nodes if isinstance(env.get(a), torch.fx.Node)]
            r_in = {a: ref.before(a) for a in ins if a in ref.env}
            arrived = {env[a]: round_as(r_in[a], _val(env[a]), back=False) for a in r_in}
            alone = _alone(new, n, arrived, pol.interp)
            if all(arrived[env[a]] is r_in[a] for a in r_in):
                baseline = ref.env[b]
            else:
                with ref.autocast():
                    back = {a: round_as(r_in[a], _val(env[a])) for a in r_in}
                    baseline = _alone(bound, b, back, ref.interp)
            i = row_of[n]
            down = any(
                a in casts and a.target is TO_COPY and str(a.kwargs.get("dtype")).removeprefix("torch.") in LOW
                for a in n.all_input_nodes
            )
            rows[i] = _attach(rows[i], pol.env[n], ref.env[b], alone, baseline, rules)
            if rows[i].flips or _may_magnify(rows[i]):  # then the fix is where its inputs lost their precision
                made = [] if down else _low_producers(b, env, row_of, rows)
                fix = suggestion(rows[i], rules, made, framework="torch")
                if rows[i].flips or fix:
                    rows[i] = dataclasses.replace(rows[i], suggestion=fix)
    return rows


def _may_magnify(row: OpRecord) -> bool:
    """No fix of its own, but an error far above its dtype's roundoff: an op that may magnify its inputs'
    error (``amplified``, decided with the rows that made them)."""
    return row.suggestion is None and (row.error or 0.0) > FAR * unit_roundoff(row)


def _low_producers(
    b: torch.fx.Node, env: dict[torch.fx.Node, Any], row_of: dict[torch.fx.Node, int], rows: list[OpRecord]
) -> list[OpRecord]:
    """The nearest rows upstream of ``b`` whose outputs are low precision (through float32 ops such as a
    softmax between a router's bfloat16 logits and its ``topk``, and through ops that round nothing, such as
    a slice of rotary angles): where a discrete output's flips start."""
    found: dict[int, OpRecord] = {}
    seen: set[torch.fx.Node] = set()
    frontier = list(b.all_input_nodes)
    for _ in range(_WALK):
        upstream = []
        for a in frontier:
            if a in seen:
                continue
            seen.add(a)
            i = row_of.get(env.get(a)) if isinstance(env.get(a), torch.fx.Node) else None
            if i is not None and rows[i].flips:
                return []  # flips inherited from a discrete op upstream: fixed where that one's start
            if i is not None and any(n in LOW for n in rows[i].out_after) and not _passes_on(rows[i]):
                found[i] = rows[i]
            else:
                upstream += a.all_input_nodes
        frontier = upstream
    return [found[i] for i in sorted(found)]


def _passes_on(row: OpRecord) -> bool:
    """The op rounded nothing: it moved (sliced, viewed) or exactly computed values already in its dtypes, so
    whatever rounded them lies upstream."""
    return row.added_error == 0.0 and set(row.out_after) <= set(row.in_after)


def _attach(row: OpRecord, out: Any, ref: Any, alone: Any, baseline: Any, rules: RuleSet) -> OpRecord:
    err, sqnr, max_abs, nonfinite, flips = output_stats(out, ref)
    added = output_stats(alone, baseline)[0] if alone is not None and baseline is not None else None
    row = dataclasses.replace(
        row, error=err, added_error=added, sqnr_db=sqnr, max_abs_error=max_abs, nonfinite=nonfinite, flips=flips
    )
    fix = suggestion(row, rules, framework="torch")
    return dataclasses.replace(row, suggestion=fix) if fix else row


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
            loss = gm(*_clone(list(inputs)))
            if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.dtype.is_floating_point):
                got = f"a {type(loss).__name__}" if not isinstance(loss, torch.Tensor) else f"shape {tuple(loss.shape)}"
                raise ValueError(_MSG_LOSS.format(got=got))
            grads.append(torch.autograd.grad(loss.float().sum(), list(params.values()), allow_unused=True))
    out = {}
    for name, r, p in zip(params, *grads, strict=True):
        if r is not None and p is not None:
            out[name] = grad_error(p, r)
    return out
