"""The new graph under construction and its values, as fake tensors of one fake mode.

``GraphBuilder`` is the part of the FX rewrite that knows nothing of autocast:
it emits nodes, computes their values with fake tensors (no compute) and names
the attributes of the new root module. ``_rewrite.Rewriter`` builds on it.

`plain` and `inputs_before` give the explain report's "before" column: each node's value with autocast
off. A traced graph's recorded values may already show autocast's dtypes (tracing runs with torch's
autocast state on), so the report recomputes them with fake tensors from the program's own ops (a float8
matmul's value is the replaced matmul's). Besides `fmp.torch.explain_fx` and `fmp.torch.explain_graph`, the
rewrite reads them for one thing: an op a float32 override runs as written gets its inputs in these dtypes.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree

from fmp.torch._fx._common import RUN, float_names, is_tensor
from fmp.torch._fx._float8 import FLOAT8


class GraphBuilder:
    """Emits nodes into ``self.graph``; ``self.vals`` maps each new node to its fake value."""

    def __init__(self, fake_mode: FakeTensorMode, attrs: dict[str, Any]) -> None:
        self.fake_mode = fake_mode
        self.attrs = attrs  # get_attr target -> object, for the new GraphModule's root
        self.graph = torch.fx.Graph()
        self.vals: dict[torch.fx.Node, Any] = {}  # new node -> fake value

    def fake(self, v: Any) -> Any:
        """``v`` (a value or a structure) with every tensor a fake tensor of ``self.fake_mode``."""

        def leaf(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            if isinstance(t, FakeTensor):
                if t.fake_mode is self.fake_mode:
                    return t
                with self.fake_mode:  # recorded by another mode (real-mode traces make one per node)
                    return torch.empty_strided(
                        t.shape, t.stride(), dtype=t.dtype, device=t.device, requires_grad=t.requires_grad
                    )
            return self.fake_mode.from_tensor(t)

        return pytree.tree_map(leaf, v)

    def value_of(self, a: Any) -> Any:
        """The fake value of a new-graph argument (a node, a constant or a nested structure)."""
        return torch.fx.node.map_aggregate(a, lambda x: self.vals.get(x) if isinstance(x, torch.fx.Node) else x)

    def run_fake(self, target: Callable, args: Any, kwargs: Any) -> Any:
        with self.fake_mode:
            return target(*self.value_of(args), **self.value_of(kwargs))

    def emit(
        self,
        target: Callable,
        args: tuple,
        kwargs: dict,
        like: torch.fx.Node | None,
        val: Any = RUN,
        name: str | None = None,
    ):
        value = self.run_fake(target, args, kwargs) if val is RUN else val
        if name is None and like is not None:
            name = like.name
        node = self.graph.create_node("call_function", target, args, kwargs, name=name)
        if like is not None:
            for key in ("stack_trace", "nn_module_stack", "source_fn_stack", "seq_nr"):
                if key in like.meta:
                    node.meta[key] = like.meta[key]
        self.vals[node] = value
        if self.vals[node] is not None:
            node.meta["val"] = self.vals[node]
        return node

    def retype(self, val: Any, dtype: torch.dtype | None) -> Any:
        """``val`` with its floating tensors in ``dtype`` (for an op with no fake kernel)."""

        def leaf(v: Any) -> Any:
            if dtype is not None and is_tensor(v) and v.dtype.is_floating_point:
                with self.fake_mode:
                    return self.fake(v).to(dtype)
            return v

        if val is None:
            raise RuntimeError("no value recorded for the node")
        return pytree.tree_map(leaf, val)

    def fresh_attr(self, base: str) -> str:
        """An attribute name of the new root module not taken yet."""
        i = 0
        while f"{base}_fmp{i}" in self.attrs:
            i += 1
        return f"{base}_fmp{i}"


def plain(rw: Any, node: torch.fx.Node) -> Any:
    """The value ``node`` has without any autocast, memoized in ``rw.before``."""
    if node in rw.before:
        return rw.before[node]
    val = node.meta.get("val")
    if FLOAT8 in node.meta:  # as written, the matmul it replaced: in its activation operand's dtype
        x = plain(rw, node.args[0])
        val = rw.retype(val, x.dtype) if is_tensor(x) and x.dtype.is_floating_point else val
    elif node.op == "call_function" and (
        isinstance(node.target, torch._ops.OpOverload) or node.target is operator.getitem
    ):
        args = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: plain(rw, n))
        quiet = logging.getLogger("torch._subclasses.fake_tensor")
        level = quiet.level
        quiet.setLevel(logging.CRITICAL)  # a failing meta kernel logs a traceback before raising
        try:
            with rw.fake_mode:
                val = node.target(*rw.fake(args[0]), **rw.fake(args[1]))
        except Exception:  # noqa: BLE001  (an op that only runs under autocast: keep the traced value)
            val = node.meta.get("val")
        finally:
            quiet.setLevel(level)
    rw.before[node] = val
    return val


def inputs_before(rw: Any, node: torch.fx.Node) -> tuple[str, ...]:
    """The floating dtypes of ``node``'s inputs without autocast."""
    return float_names(list(torch.fx.node.map_arg((node.args, node.kwargs), lambda n: plain(rw, n))))
