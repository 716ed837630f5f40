"""Name scopes for flax nnx modules (``head``, ``blocks/0/attn``), as flax linen opens one per module.

nnx modules call JAX ops without a name stack, so ``overrides``, ``explain`` and float8 site names would see
no scope. While autocast traces a function, every nnx ``Module`` reachable from its arguments runs its
``__call__`` under a ``jax.named_scope`` named by its path in the argument's graph (the path nnx itself
gives its state). The class defining that ``__call__`` is patched only while some trace is running; the patch
finds the module by identity, in this thread's trace only, so a module built inside the function, one not
among the arguments or one called by another thread runs as written. A submodule called from its parent
pushes only its own part of the path (so the stack reads ``blocks/0/attn``, not ``blocks/0/blocks/0/attn``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.extend import source_info_util

# the scope wrapper is not the user's code: explain's source column keeps pointing at the module's caller
source_info_util.register_exclusion(__file__)

_LOCK = threading.Lock()
_PATCHED: dict[type, tuple[Callable[..., Any], int]] = {}  # defining class -> (original __call__, users)
_LOCAL = threading.local()  # .maps: [{id(module): path}] (one per trace), .active: [path] (modules running)


def _stack(name: str) -> list[Any]:
    if not hasattr(_LOCAL, name):
        setattr(_LOCAL, name, [])
    return getattr(_LOCAL, name)


def _modules(args: Any) -> dict[int, tuple[Any, tuple[str, ...]]]:
    """``id(module) -> (module, path)`` for the nnx modules below the graph nodes among ``args``."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return {}
    is_node = nnx.graph.is_graph_node
    out: dict[int, tuple[Any, tuple[str, ...]]] = {}
    for leaf in jax.tree_util.tree_leaves(args, is_leaf=is_node):
        if not is_node(leaf):
            continue
        for path, node in nnx.graph.iter_graph(leaf):
            if path and isinstance(node, nnx.Module):
                out.setdefault(id(node), (node, tuple(str(p) for p in path)))
    return out


def _scoped(call: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(call)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        found = next((m[id(self)] for m in reversed(_stack("maps")) if id(self) in m), None)
        if found is None or found[0] is not self:
            return call(self, *args, **kwargs)
        path = found[1]
        active = _stack("active")
        parent = active[-1] if active else ()
        own = path[len(parent) :] if path[: len(parent)] == parent else path
        active.append(path)
        try:
            if not own:
                return call(self, *args, **kwargs)
            with jax.named_scope("/".join(own)):
                return call(self, *args, **kwargs)
        finally:
            active.pop()

    return __call__


def _defining_class(cls: type) -> type | None:
    owner = next((c for c in cls.__mro__ if "__call__" in c.__dict__), None)
    return owner if owner is not None and inspect.isfunction(owner.__dict__["__call__"]) else None


@contextlib.contextmanager
def module_scopes(args: Any) -> Iterator[None]:
    """While the block runs, the nnx modules among ``args`` call under their path's name scope."""
    modules = _modules(args)
    if not modules:
        yield
        return
    owners = {c for c in (_defining_class(type(m)) for m, _ in modules.values()) if c is not None}
    with _LOCK:
        for cls in owners:
            call, users = _PATCHED.get(cls, (cls.__dict__["__call__"], 0))
            if not users:
                cls.__call__ = _scoped(call)
            _PATCHED[cls] = (call, users + 1)
    maps = _stack("maps")
    maps.append(modules)
    try:
        yield
    finally:
        maps.pop()
        with _LOCK:
            for cls in owners:
                call, users = _PATCHED.pop(cls)
                if users > 1:
                    _PATCHED[cls] = (call, users - 1)
                else:
                    cls.__call__ = call
