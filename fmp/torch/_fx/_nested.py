"""Graphs inside a node: decompositions of composite ops, higher-order ops, one-op autocast regions.

Eager autocast sees inside an unlisted ``CompositeImplicitAutograd`` op (its
decomposition dispatches through the Autocast key again), so ``decompose``
inlines such an op's decomposition when a rewrite of it changes anything
(``einsum``, ``tensordot`` on CPU). ``hop`` handles the higher-order ops a
traced program may hold: ``wrap_with_autocast`` regions switch the per-device
autocast state for the ops inside them, ``wrap_with_set_grad_enabled`` bodies
are rewritten into a submodule of their own. ``in_region`` keeps an op whose
kernel eager autocast reaches into (``RuleSet.torch_cpu_autocast_inside``) inside a
one-op autocast region. They take the running
``Rewriter`` and build nested ones with
``type(rw)(...)``, so this module does not import the rewriter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from fmp.torch._fx._common import MSG_HOP, ambient_autocast, is_tensor

UNTRACEABLE = object()  # decompose(): the decomposition cannot be traced with fake tensors
ENTER_AUTOCAST = torch.amp.autocast_mode._enter_autocast
EXIT_AUTOCAST = torch.amp.autocast_mode._exit_autocast


def decompose(rw: Any, node: torch.fx.Node, op: torch._ops.OpOverload, args: tuple, kwargs: dict, depth: int) -> Any:
    """Inlines ``op``'s decomposition, rewritten, when autocast changes something inside it; else None.

    Returns ``UNTRACEABLE`` when fake tensors cannot trace the decomposition: the
    caller then keeps the op in a one-op autocast region (``in_region``), where
    its decomposition meets autocast at run time as in eager.
    """
    flat, spec = pytree.tree_flatten((args, kwargs))
    flat_vals = [rw.vals.get(a) if isinstance(a, torch.fx.Node) else a for a in flat]
    sig = tuple(
        (v.dtype, v.device.type, tuple(v.shape), tuple(v.stride())) if is_tensor(v) else repr(v) for v in flat_vals
    )
    cache_key = (op, sig, tuple(sorted(rw.state.items())))
    if rw.probe_cache.get(cache_key) is False:
        return None
    if rw.probe_cache.get(cache_key) is UNTRACEABLE:
        return UNTRACEABLE

    def call(*leaves):
        a, k = pytree.tree_unflatten(list(leaves), spec)
        return op(*a, **k)

    # a decomposition may make tensor constants of its own (cov's scalar divisor): let them meet fake ones
    allow = rw.fake_mode.allow_non_fake_inputs
    try:
        rw.fake_mode.allow_non_fake_inputs = True
        with ambient_autocast(rw.state):  # values as eager autocast computes them
            sub = make_fx(call, pre_dispatch=True, decomposition_table={op: op.decompose})(*flat_vals)
    except Exception:  # noqa: BLE001  (data-dependent code: cov's decomposition compares tensors)
        rw.probe_cache[cache_key] = UNTRACEABLE
        return UNTRACEABLE
    finally:
        rw.fake_mode.allow_non_fake_inputs = allow
    probe = type(rw)(rw.rules, rw.state, rw.fake_mode, {}, None)
    probe.probe_cache = rw.probe_cache
    probe.run(sub.graph, {}, depth + 1)
    rw.probe_cache[cache_key] = probe.changed
    if not probe.changed:
        return None
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    env: dict[torch.fx.Node, Any] = dict(zip(placeholders, flat, strict=True))
    for n in sub.graph.nodes:  # a decomposition exists only under autocast: its values are "before"
        rw.before[n] = n.meta.get("val")
    for n in sub.graph.nodes:  # the decomposition's nodes report the user's source line
        if n.op == "call_function":
            for key in ("stack_trace", "nn_module_stack"):
                if key in node.meta:
                    n.meta[key] = node.meta[key]
    out = rw.run(sub.graph, env, depth + 1, owner=sub)  # owner: tensor constants the decomposition made
    if isinstance(sub.graph._codegen, torch.fx.graph._PyTreeCodeGen):
        out = pytree.tree_unflatten(list(out), sub.graph._codegen.pytree_info.out_spec)
    rw.changed = True
    return out


def hop(rw: Any, node: torch.fx.Node, args: tuple, kwargs: dict, depth: int) -> Any:
    """Rewrites a higher-order op node; raises for the ones whose bodies it cannot see into."""
    name = node.target.name()
    if name == "wrap_with_autocast":
        device, dtype, enabled = node.args[:3]
        sub = rw.attrs[args[4].target]
        saved = dict(rw.state)
        rw.state[device] = (bool(enabled), dtype if dtype is not None else torch.get_autocast_dtype(device))
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        env = dict(zip(placeholders, args[5:], strict=True))
        out = rw.run(sub.graph, env, depth, owner=sub)
        rw.state = saved
        rw.changed = True
        return tuple(out) if isinstance(out, list) else out
    if name == "wrap_with_set_grad_enabled":
        enabled = node.args[0]
        sub = rw.attrs[args[1].target]
        inner = type(rw)(rw.rules, rw.state, rw.fake_mode, dict(rw.attrs), rw.events)
        inner.probe_cache = rw.probe_cache
        env = {}
        for p, a in zip([n for n in sub.graph.nodes if n.op == "placeholder"], args[2:], strict=True):
            env[p] = inner.graph.placeholder(p.target)
            env[p].meta.update(p.meta)
            inner.vals[env[p]] = rw.vals.get(a) if isinstance(a, torch.fx.Node) else a
        inner.graph.output(inner.run(sub.graph, env, depth, owner=sub))
        rw.changed |= inner.changed
        name = rw.fresh_attr(args[1].target)
        rw.attrs[name] = torch.fx.GraphModule(inner.attrs, inner.graph)
        getter = rw.graph.get_attr(name)
        return rw.emit(node.target, (enabled, getter, *args[2:]), kwargs, node)
    raise NotImplementedError(MSG_HOP.format(op=name, node=node.name))


def in_region(rw: Any, node: torch.fx.Node, op: Any, device: str, compute: torch.dtype, args: tuple, kwargs: dict):
    """Emits ``op`` inside a one-op autocast region: its kernel calls listed ops through the dispatcher.

    Eager autocast reaches inside such a kernel (``_trilinear``'s ``bmm`` calls), and no
    cast at the op's boundary reproduces what it does inside, so the region is kept.
    """
    enter = rw.graph.create_node(
        "call_function", ENTER_AUTOCAST, (device, compute, True, False), {}, name=f"{node.name}_autocast"
    )
    try:
        with ambient_autocast({device: (True, compute)}), rw.fake_mode:
            val = op(*rw.value_of(args), **rw.value_of(kwargs))
    except Exception:  # noqa: BLE001  (data-dependent: the trace ran it under autocast, so its value holds)
        val = rw.fake(node.meta.get("val"))
    new = rw.emit(op, args, kwargs, node, val=val)
    new.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")})
    rw.graph.create_node("call_function", EXIT_AUTOCAST, (enter,), {})
    rw.changed = True
    return new
