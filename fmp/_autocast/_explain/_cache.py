"""What a repeated ``fmp.explain(..., grads=True)`` call reuses: the compiled gradients and the traced backward.

One ``Traces`` lives as long as the function ``explain`` returns. A call whose arguments have the same
structure, shapes, dtypes and non-array values as an earlier one gets that call's ``jax.jit`` functions back
(``compiled``: their compilations are reused, as a training loop's are) and its jaxpr of the policy's
gradient (``jaxpr``: not traced again), so the same arrays come out. Arguments the cache cannot key
soundly (array keyword arguments, which the gradients hold as constants; unhashable non-array leaves) are
traced and compiled afresh, as every call did before.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import numpy as np

_ARRAYS = (jax.Array, np.ndarray)  # traced by the gradients; every other leaf is fixed (keyed by value)


def signature(args: Sequence[Any], kwargs: dict[str, Any]) -> Hashable | None:
    """A key for calls that trace and compile alike: the argument tree, each array leaf's shape and dtype,
    each other leaf's type and value; ``None`` where that is not a sound key."""
    leaves, tree = jax.tree_util.tree_flatten(tuple(args))
    k_leaves, k_tree = jax.tree_util.tree_flatten(kwargs)
    if any(isinstance(x, _ARRAYS) for x in k_leaves):
        return None  # held as constants by the gradients: their values would have to be the key
    parts: list[Any] = [tree, k_tree]
    for x in (*leaves, *k_leaves):
        if isinstance(x, _ARRAYS):
            parts.append(type_key(x))
        else:
            parts.append((type(x), x))
    key = tuple(parts)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def type_key(x: Any) -> Hashable:
    """What JAX compiles an array argument for: its shape, dtype (a key type too) and weak type."""
    return np.shape(x), str(x.dtype), bool(getattr(x, "weak_type", False))


class Traces:
    """Per-signature jitted gradients and traced jaxprs of one ``explain`` function."""

    def __init__(self) -> None:
        self._store: dict[Hashable, Any] = {}

    def get(self, what: str, key: Hashable | None, make: Callable[[], Any]) -> Any:
        """``make()`` once per ``(what, key)``; every call when ``key`` is ``None``."""
        if key is None:
            return make()
        if (what, key) not in self._store:
            self._store[what, key] = make()
        return self._store[what, key]


def jitted(f: Callable[..., Any], args: Sequence[Any]) -> Callable[[Sequence[Any]], Any]:
    """``f`` under ``jax.jit`` with the array leaves of ``args`` traced and the other leaves fixed: a function
    of the arguments' array leaves."""
    leaves, tree = jax.tree_util.tree_flatten(tuple(args))
    dyn = [i for i, x in enumerate(leaves) if isinstance(x, _ARRAYS)]

    def g(*xs: Any) -> Any:
        full = list(leaves)
        for i, x in zip(dyn, xs, strict=True):
            full[i] = x
        return f(*jax.tree_util.tree_unflatten(tree, full))

    compiled = jax.jit(g)

    def call(args: Sequence[Any]) -> Any:
        flat = jax.tree_util.tree_leaves(tuple(args))
        return compiled(*(flat[i] for i in dyn))

    return call
