"""Telling JAX values from other frameworks' arrays, for the errors that name them."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

_MSG_FOREIGN_LEAF = (
    "{where}: {what} is a {kind}, not a JAX array: fmp.GradScaler and its helpers compute with JAX; for torch "
    "tensors use fmp.torch.GradScaler (torch.amp.GradScaler's API), or convert the leaves first "
    "(jnp.asarray(x), or jax.dlpack.from_dlpack(x) to share memory)."
)


def foreign_kind(x: Any) -> str | None:
    """``"torch.Tensor"`` for an array of another framework (it has a dtype, ``__array__`` or ``__dlpack__``
    but is neither a JAX nor a NumPy value); None for anything JAX takes as it is."""
    if isinstance(x, jax.Array | np.ndarray | np.generic) or hasattr(x, "__jax_array__"):
        return None
    if hasattr(x, "dtype") or hasattr(x, "__array__") or hasattr(x, "__dlpack__"):
        t = type(x)
        return f"{t.__module__}.{t.__qualname__}"
    return None


def check_leaf(x: Any, where: str, path: Any) -> None:
    """Raises TypeError naming the leaf if ``x`` is another framework's array."""
    kind = foreign_kind(x)
    if kind is not None:
        what = f"the leaf at {jax.tree_util.keystr(path) or 'the root'}"
        raise TypeError(_MSG_FOREIGN_LEAF.format(where=where, what=what, kind=kind))


def check_value(x: Any, where: str, name: str) -> None:
    """Raises TypeError naming the argument ``name`` if ``x`` is another framework's array."""
    kind = foreign_kind(x)
    if kind is not None:
        raise TypeError(_MSG_FOREIGN_LEAF.format(where=where, what=name, kind=kind))
