"""Which cast node a use of a tensor gets: torch's autocast cast cache, as a rule of the graph.

Eager autocast casts an argument once per use, with one exception: a float32
leaf tensor that requires grad (a ``Parameter``; not a view) cast to the
autocast dtype is cast once and the cast reused until the outermost autocast
region exits (``at::autocast::cached_cast``). The difference is visible only in
the backward pass: uses of one shared cast sum their gradients in the low
dtype before the cast's backward widens the sum, while per-use casts widen each
gradient and sum in float32. So the rewritten graph shares a cast exactly where
torch's cache would, and gives every other use its own ``_to_copy`` node.

Graph inputs are tensors of the caller's, which may or may not be leaves that
require grad; `fmp.torch.autocast_fx` records that of each example input
on its placeholder (``meta["fmp_grad_leaf"]``), and the rewrite follows it. Like
the rest of a trace, the decision is fixed when the graph is built: a parameter
frozen then (``requires_grad=False``) and unfrozen later keeps its casts per use.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
import torch.fx

GRAD_LEAF = "fmp_grad_leaf"  # placeholder meta: the example input was a leaf that requires grad


def is_grad_leaf(t: Any) -> bool:
    """Whether torch's cast cache would hold a cast of ``t`` (its dtype aside): a leaf, not a view, requiring grad."""
    return isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf and not t._is_view()


def shared_cast_key(
    src: torch.fx.Node, val: Any, dtype: torch.dtype, compute: torch.dtype | None, attrs: dict[str, Any]
) -> Hashable | None:
    """The key under which a cast of ``src`` to ``dtype`` is shared, or None for a cast per use.

    ``compute`` is the autocast dtype of the device the op runs on, ``attrs``
    the objects behind the graph's ``get_attr`` nodes. Tied weights (one
    ``Parameter`` behind several names) share one cast, as the cache keys on
    the tensor.
    """
    if dtype != compute or not isinstance(val, torch.Tensor) or val.dtype != torch.float32:
        return None
    if src.op == "get_attr":
        obj = attrs.get(src.target)
        return ("attr", id(obj)) if is_grad_leaf(obj) else None
    if src.op == "placeholder" and src.meta.get(GRAD_LEAF, False):
        return ("input", src)
    return None


class CastCache:
    """The shared casts of one graph: torch's cast cache, keyed by ``shared_cast_key``."""

    def __init__(self, attrs: dict[str, Any]) -> None:
        self.attrs = attrs
        self._memo: dict[tuple[Hashable, torch.dtype], torch.fx.Node] = {}

    def key(self, src: torch.fx.Node, val: Any, dtype: torch.dtype, compute: torch.dtype | None) -> Hashable | None:
        """The key a cast of ``src`` is shared under (None: a cast per use)."""
        return shared_cast_key(src, val, dtype, compute, self.attrs)

    def get(self, key: Hashable, dtype: torch.dtype) -> torch.fx.Node | None:
        return self._memo.get((key, dtype))

    def put(self, key: Hashable, dtype: torch.dtype, node: torch.fx.Node) -> None:
        self._memo[(key, dtype)] = node

    def clear(self) -> None:
        """Forgets every cast (grad mode changed: a cast made without grad must not feed a use that needs one)."""
        self._memo.clear()

    def invalidate(self, op: Any, args: tuple, kwargs: dict) -> None:
        """Drops the casts of a tensor an in-place op writes to (they would be stale)."""
        if not isinstance(op, torch._ops.OpOverload) or not op._schema.is_mutable:
            return
        written: list[torch.fx.Node] = []
        for i, arg in enumerate(op._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = kwargs.get(arg.name, args[i] if i < len(args) and not arg.kwarg_only else None)
                torch.fx.node.map_arg(value, written.append)
        stale = {("attr", id(self.attrs.get(n.target))) if n.op == "get_attr" else ("input", n) for n in written}
        for key in [k for k in self._memo if k[0] in stale]:
            del self._memo[key]
