"""Tracing a module or function to a pre-dispatch ATen graph over the module's own state.

``trace`` records the graph under the autocast mode the rewrite will emulate, with the module's parameters
and buffers as its first placeholders; ``bind_state`` turns those placeholders back into the module's own
tensors, so the rewritten graph trains the same parameters.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from fmp.torch._fx._casts import GRAD_LEAF, is_grad_leaf
from fmp.torch._fx._common import ambient_autocast
from fmp.torch._fx._trace_errors import check_outputs, raise_trace_failure


def trace(
    fn_or_module: Callable | torch.nn.Module, example_inputs: Any, device_type: str, dtype: torch.dtype
) -> tuple[torch.fx.GraphModule, list[str], Any]:
    """Traces a pre-dispatch ATen graph whose first placeholders are a module's params and buffers.

    Returns the graph module (calling convention: flat ``*state, *input_leaves``),
    the qualified names of the state placeholders, and the codegen that gives the
    caller's calling convention once the state placeholders are gone.
    """
    if isinstance(example_inputs, torch.Tensor) or not isinstance(example_inputs, Sequence):
        raise TypeError(
            f"example_inputs must be a tuple of positional arguments, e.g. (x,), got {type(example_inputs).__name__}"
        )
    if isinstance(fn_or_module, torch.nn.Module):
        module = fn_or_module
        state = dict(module.named_parameters())
        state.update(module.named_buffers())
    elif callable(fn_or_module):
        module, state = None, {}
    else:
        raise TypeError(f"fn_or_module must be a callable or a torch.nn.Module, got {type(fn_or_module).__name__}")
    names = list(state)
    in_leaves, in_spec = pytree.tree_flatten(list(example_inputs))
    out_spec: list[pytree.TreeSpec] = []

    def flat(*leaves: Any) -> list[Any]:
        args = pytree.tree_unflatten(list(leaves[len(names) :]), in_spec)
        if module is not None:
            out = torch.func.functional_call(module, dict(zip(names, leaves[: len(names)], strict=True)), tuple(args))
        else:
            out = fn_or_module(*args)
        check_outputs(out)
        out_leaves, spec = pytree.tree_flatten(out)
        out_spec.append(spec)
        return out_leaves

    if module is not None:  # make_fx records each node's module path (nn_module_stack) from this root
        flat._orig_mod = module  # type: ignore[attr-defined]

    # Traced with torch's autocast state on, as the eager program runs: Python code that asks
    # torch.is_autocast_enabled() (MultiheadAttention's fast path, user branches) takes the same path,
    # and ops that only run once autocast cast their inputs (linalg on bfloat16) trace. The nodes are
    # still the raw pre-dispatch ops (pre-dispatch tracing sits above the Autocast key); only their
    # recorded values show autocast's dtypes. Fake tensors first (no compute); ops without a fake
    # kernel need a real trace. Tensors a function closes over become constants of the graph.
    errors: list[BaseException] = []
    for mode in ("fake", "real"):
        out_spec.clear()
        ctx = ambient_autocast({device_type: (True, dtype)})
        leaves = [*state.values(), *in_leaves]
        if mode == "real":  # a real trace runs the program: keep BatchNorm stats etc. of the caller intact
            leaves = [_copy_leaf(x) for x in leaves]
        try:
            with ctx:
                gm = make_fx(
                    flat,
                    pre_dispatch=True,
                    tracing_mode=mode,
                    _allow_non_fake_inputs=True,
                    record_stack_traces=True,
                    record_module_stack=True,
                )(*leaves)
            break
        except (RuntimeError, NotImplementedError, Warning) as err:  # Warning: when warnings are errors
            errors.append(err)
    else:
        raise_trace_failure(*errors)
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"][len(names) :]
    for node, leaf in zip(inputs, in_leaves, strict=True):  # torch's cast cache keeps casts of these
        node.meta[GRAD_LEAF] = is_grad_leaf(leaf)
    target = fn_or_module.forward if module is not None else fn_or_module
    codegen = torch.fx.graph._PyTreeCodeGen(
        torch.fx.graph._PyTreeInfo(_arg_names(target, len(example_inputs)), in_spec, out_spec[0])
    )
    return gm, names, codegen


def _copy_leaf(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    return x.detach().clone().requires_grad_(x.requires_grad)


def _arg_names(fn: Callable, n: int) -> list[str]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    plain = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return plain[:n] if len(plain) >= n else [f"arg{i}" for i in range(n)]


def _get(obj: Any, target: str) -> Any:
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def bind_state(
    gm: torch.fx.GraphModule, module: torch.nn.Module | None, names: list[str], codegen: Any
) -> torch.fx.GraphModule:
    """Replaces the state placeholders by get_attr nodes of the module's own params and buffers.

    The result is called like the user's function (``codegen``) and holds the very
    ``Parameter`` and buffer objects of ``module``, under their qualified names.
    """
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    root: dict[str, Any] = {}
    state = iter(names)
    for node in gm.graph.nodes:
        name = next(state, None) if node.op == "placeholder" else None
        if name is not None:
            env[node] = graph.get_attr(name)
            env[node].meta.update(node.meta)
            root[name] = _get(module, name)
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
            if node.op == "get_attr":
                root[node.target] = _get(gm, node.target)
    graph._codegen = codegen
    graph.lint()
    name = type(module).__name__ if module is not None else "Function"
    return torch.fx.GraphModule(root, graph, class_name=f"Autocast{name}")
