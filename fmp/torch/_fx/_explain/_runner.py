"""Running an FX graph node by node on real tensors, as ``explain_fx(compare=True)`` needs it: a value freed one
step after its last use, the inputs of an in-place op kept as they were, the graph's own autocast regions
opened around their ops; and what two runs of one program need to be comparable (no random draws, the
module's buffers as they were)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx

from fmp.torch._fx._common import ambient_autocast
from fmp.torch._fx._nested import ENTER_AUTOCAST, EXIT_AUTOCAST

_SKIP = (torch._C._set_grad_enabled,)  # grad mode switches: the forward comparison runs without autograd
_MSG_RANDOM = (
    "explain_fx(compare=True) runs the program twice and needs the same random numbers in both runs, but "
    "node {node!r} ({op}) draws its own: call model.eval() (dropout off) or compare a program without it."
)


class Runner:
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
                    self.overwritten[named[name]] = clone(self.env[named[name]])
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


def clone(x: Any) -> Any:
    return torch.fx.node.map_aggregate(x, lambda v: v.clone() if isinstance(v, torch.Tensor) else v)
