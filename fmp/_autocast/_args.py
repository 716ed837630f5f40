"""How a user function's arguments enter the traced program autocast rewrites.

Array leaves become jaxpr inputs and every other leaf is static (``trace``). flax nnx objects are mutable
graph nodes: they enter as their state and leave as the state after the function, which is written back
(``graph_nodes`` / ``trace_with_graph_state``); nnx modules trace under their path's name scope
(``_nnx_scopes``), so BatchNorm statistics, RNG counts and any ``nnx.Variable``
the function assigns are updated as without autocast. A node the function could not assign in the caller's
trace (its Variables belong to another trace level) enters as a pytree, as under ``jax.jit``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr

from fmp._autocast._engine import _jax_internals
from fmp._autocast._engine._context import aval_of
from fmp._autocast._nnx_scopes import module_scopes


def _is_dynamic(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array | np.ndarray | np.generic)


def trace(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[ClosedJaxpr, list[Any], Any]:
    """Traces ``fn(*args, **kwargs)``: array leaves become jaxpr inputs, other leaves are static.

    Returns the closed jaxpr, the array leaves, and the output tree structure.
    """
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dynamic = [_is_dynamic(x) for x in leaves]
    arrays = [x for x, d in zip(leaves, dynamic, strict=True) if d]
    out_tree: list[Any] = []

    def flat_fn(*xs: Any) -> list[Any]:
        it = iter(xs)
        full = [next(it) if d else x for x, d in zip(leaves, dynamic, strict=True)]
        a, k = jax.tree_util.tree_unflatten(treedef, full)
        # jnp's helpers stay calls (the rewrite decides which to inline); nnx modules open their name scopes
        with _jax_internals.keep_inline_calls(), module_scopes((a, k)):
            out = fn(*a, **k)
        out_leaves, tree = jax.tree_util.tree_flatten(out)
        out_tree.append(tree)
        return out_leaves

    closed = jax.make_jaxpr(flat_fn)(*arrays)
    return closed, arrays, out_tree[0]


def _mutable_here(nnx: Any, node: Any) -> bool:
    """Whether ``fn`` could assign every ``nnx.Variable`` of ``node`` in the caller's trace (flax's own test).

    A Variable made at another trace level (one that ``jax.grad`` rebuilt from a ``State`` argument) cannot be
    assigned where ``fn`` is called: ``fn`` itself would raise, and ``jax.jit(fn)`` keeps its updates inside,
    where ``fn`` returns them. Such a node enters as an ordinary pytree, as under ``jit``.
    """
    variables = (v for _, v in nnx.graph.iter_graph(node) if isinstance(v, nnx.Variable))
    return all(getattr(v, "_can_update", True) for v in variables)


def graph_nodes(args: tuple, kwargs: dict) -> Any:
    """flax nnx objects among the arguments that ``fn`` can mutate in place (mutable graph nodes), or None.

    Never imports flax itself.
    """
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return None
    is_node = nnx.graph.is_graph_node
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_node)
    pos = [i for i, x in enumerate(leaves) if is_node(x) and _mutable_here(nnx, x)]
    return (nnx, leaves, treedef, pos) if pos else None


def trace_with_graph_state(
    fn: Callable[..., Any], args: tuple, kwargs: dict, graph: Any
) -> tuple[ClosedJaxpr, list[Any], Callable[[list[Any]], Any]]:
    """``trace`` for a function with nnx objects among its arguments: they enter as state and leave updated.

    nnx objects are mutable: a BatchNorm's running statistics, an ``Rngs``
    count or any ``nnx.Variable`` the function assigns change in place. The
    objects are split into a graph and a state, the state enters the traced
    program as inputs, the state after ``fn`` leaves it as outputs (in the
    dtypes ``fn`` gave it). Returns the closed jaxpr, its array inputs and ``finish``, which takes the
    program's outputs, writes the state back with ``nnx.update`` (so the caller: ``nnx.value_and_grad``,
    ``nnx.jit``, plain Python, sees the updates) and returns ``fn``'s result.
    """
    nnx, leaves, treedef, pos = graph
    nodes = tuple(leaves[i] for i in pos)
    graphdef, state = nnx.split(nodes)
    others = [x for i, x in enumerate(leaves) if i not in set(pos)]

    def inner(state: Any, others: list[Any]) -> Any:
        merged = iter(nnx.merge(graphdef, state))
        rest = iter(others)
        full = [next(merged) if i in pos else next(rest) for i in range(len(leaves))]
        a, k = jax.tree_util.tree_unflatten(treedef, full)
        with module_scopes((a, k)):
            out = fn(*a, **k)
        _, new_state = nnx.split(tuple(full[i] for i in pos))
        return out, new_state

    closed, arrays, out_tree = trace(inner, (state, others), {})

    def finish(outs: list[Any]) -> Any:
        n_out = out_tree.children()[0].num_leaves
        # state leaves keep the dtype fn gave them (the policy's output dtype applies to fn's results only)
        outs = [
            o if i < n_out or aval_of(o).dtype == a.dtype else jax.lax.convert_element_type(o, a.dtype)
            for i, (o, a) in enumerate(zip(outs, closed.out_avals, strict=True))
        ]
        out, new_state = jax.tree_util.tree_unflatten(out_tree, outs)
        nnx.update(nodes, new_state)
        return out

    return closed, arrays, finish
