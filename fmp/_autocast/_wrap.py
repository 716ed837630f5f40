"""``fmp.autocast``: run a function under a mixed-precision policy."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr

from fmp._autocast._custom_bwd import BWD_AS_WRITTEN
from fmp._autocast._transform import REGION_SCOPE, Context, aval_of, check_overrides, check_rules, run_top
from fmp._core._rules import RuleSet
from fmp._policy import Policy, get_policy


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
        out_leaves, tree = jax.tree_util.tree_flatten(fn(*a, **k))
        out_tree.append(tree)
        return out_leaves

    closed = jax.make_jaxpr(flat_fn)(*arrays)
    return closed, arrays, out_tree[0]


def _graph_nodes(args: tuple, kwargs: dict) -> Any:
    """flax nnx objects among the arguments (mutable graph nodes), or None; never imports flax itself."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return None
    is_node = nnx.graph.is_graph_node
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_node)
    pos = [i for i, x in enumerate(leaves) if is_node(x)]
    return (nnx, leaves, treedef, pos) if pos else None


def _run_with_graph_state(fn: Callable[..., Any], args: tuple, kwargs: dict, graph: Any, ctx: Context) -> Any:
    """Runs ``fn`` with its nnx objects passed as state, and writes every state update back into them.

    nnx objects are mutable: a BatchNorm's running statistics, an ``Rngs``
    count or any ``nnx.Variable`` the function assigns change in place. The
    objects are split into a graph and a state, the state enters the traced
    program as inputs, the state after ``fn`` leaves it as outputs (in the
    dtypes ``fn`` gave it), and ``nnx.update`` writes it back, so the caller
    (``nnx.value_and_grad``, ``nnx.jit``, plain Python) sees the updates.
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
        out = fn(*a, **k)
        _, new_state = nnx.split(tuple(full[i] for i in pos))
        return out, new_state

    closed, arrays, out_tree = trace(inner, (state, others), {})
    with jax.named_scope(REGION_SCOPE):
        outs = run_top(closed, arrays, ctx)
    n_out = out_tree.children()[0].num_leaves
    # state leaves keep the dtype fn gave them (the policy's output dtype applies to fn's results only)
    outs = [
        o if i < n_out or aval_of(o).dtype == a.dtype else jax.lax.convert_element_type(o, a.dtype)
        for i, (o, a) in enumerate(zip(outs, closed.out_avals, strict=True))
    ]
    out, new_state = jax.tree_util.tree_unflatten(out_tree, outs)
    nnx.update(nodes, new_state)
    return out


def autocast(
    fn: Callable[..., Any] | None = None,
    policy: str | Policy = "mixed_bfloat16",
    *,
    rules: RuleSet | None = None,
    enabled: bool = True,
    overrides: Mapping[str, Any] | None = None,
) -> Any:
    """Runs ``fn`` under a mixed-precision policy, op by op, like ``torch.autocast``.

    ``fn`` is traced to a jaxpr and its rewrite (the program
    :func:`fmp.autocast_jaxpr` returns) is evaluated in the caller's trace, so the result composes with ``jax.jit``,
    ``jax.grad``, ``jax.vmap`` and ``lax.scan``. Matmuls and convolutions run in
    the policy's compute dtype, exponentials, logarithms, powers and sums in
    float32, multi-input elementwise ops in their widest input, except that a
    bias added to a matmul's or convolution's result is added in the compute
    dtype, as torch's ``linear`` does (the rule table ``fmp.DEFAULT_RULES``,
    ``RuleSet.jax_epilogue``); float64, integer and boolean values are never cast.

    Dtypes: array arguments are not cast (parameters stay float32 and are cast
    where an op uses them, so the gradients of float32 parameters are float32).
    Outputs that ``fn`` returns in float32 come back in the policy's
    ``output_dtype`` (float32 for the presets); all other outputs keep the dtype
    ``fn`` gives them. Non-array arguments (Python numbers, strings) are static.

    Nesting: an inner ``autocast(g, ...)`` (another policy, or
    ``enabled=False``) keeps its own choice inside an outer one.

    Args:
      fn: The function; omit it to use ``autocast(policy=...)`` as a decorator.
      policy: A policy spec (``"mixed_bfloat16"``, ``"mixed_float16"``,
        ``"float32"``, ``"p=f32,c=bf16"``) or an :class:`fmp.Policy`.
      rules: A :class:`fmp.RuleSet`; ``None`` means ``fmp.DEFAULT_RULES``.
      enabled: ``False`` runs ``fn`` exactly as written, also inside an outer autocast.
      overrides: ``{scope_substring: policy}``: ops under a ``jax.named_scope``
        (flax linen opens one per module) whose name contains the substring run
        under that policy, e.g. ``{"LayerNorm": "float32"}``. Matching is
        case-sensitive on the scopes opened inside ``fn``; the innermost wins.

    Returns:
      A function with ``fn``'s signature.

    Raises:
      TypeError: ``fn`` is not callable, or ``rules``/``overrides`` have the wrong type.
      ValueError: an unknown policy spec; a banned op under a float16 policy.

    Examples:
      >>> f = fmp.autocast(lambda x, w: x @ w)
      >>> f(jnp.ones((2, 3)), jnp.ones((3, 2))).dtype
      dtype('float32')
      >>> @fmp.autocast(policy="p=f32,c=bf16,o=bf16")
      ... def g(x):
      ...     return x @ x
      >>> g(jnp.ones((2, 2))).dtype
      dtype(bfloat16)
    """
    if fn is None:
        return functools.partial(autocast, policy=policy, rules=rules, enabled=enabled, overrides=overrides)
    if not callable(fn):
        raise TypeError(
            f"autocast(fn) expects a callable, got {type(fn).__name__}; "
            "to set the policy of a decorator write @fmp.autocast(policy=...)"
        )
    if not isinstance(enabled, bool):
        raise TypeError(f"autocast(enabled=...) expects a bool, got {type(enabled).__name__}")
    pol = get_policy(policy)
    ruleset = check_rules(rules)
    over = check_overrides(overrides)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not enabled:
            with jax.named_scope(REGION_SCOPE):
                return fn(*args, **kwargs)
        ctx = Context(pol, ruleset, over)
        graph = _graph_nodes(args, kwargs)
        if graph is not None:
            return _run_with_graph_state(fn, args, kwargs, graph, ctx)
        closed, arrays, out_tree = trace(fn, args, kwargs)
        with jax.named_scope(REGION_SCOPE):
            outs = run_top(closed, arrays, ctx)
        return jax.tree_util.tree_unflatten(out_tree, outs)

    return wrapped


def bwd_as_written(bwd: Callable[..., Any]) -> Callable[..., Any]:
    """Marks a ``jax.custom_vjp`` backward rule to run exactly as written under autocast.

    By default :func:`fmp.autocast` runs a custom_vjp's backward rule under the
    policy of its forward call, as ``torch.amp.custom_bwd`` does for a custom
    autograd Function: a matmul in the rule runs in the compute dtype, an
    ``exp`` in float32, and the cotangents it returns keep the dtypes the rule
    gives them. A rule marked with this decorator runs as written instead
    (every op in the dtypes it is given), e.g. a hand-tuned rule that manages
    its own precision.

    Args:
      bwd: The backward rule passed to ``defvjp``.

    Returns:
      ``bwd`` itself, marked.

    Examples:
      >>> @jax.custom_vjp
      ... def scale(x):
      ...     return 2.0 * x
      >>> scale.defvjp(lambda x: (2.0 * x, None), fmp.bwd_as_written(lambda _, g: (2.0 * g,)))
      >>> jax.grad(lambda x: fmp.autocast(scale)(x))(1.0)
      Array(2., dtype=float32, weak_type=True)
    """
    if not callable(bwd):
        raise TypeError(f"bwd_as_written(bwd) expects the backward rule (a callable), got {type(bwd).__name__}")
    setattr(bwd, BWD_AS_WRITTEN, True)
    return bwd
