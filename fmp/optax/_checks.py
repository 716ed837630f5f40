"""Trace-time checks shared by fmp's optax transformations (static properties only: no cost under jit)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def check_inner(inner: Any, where: str) -> None:
    """``inner`` must look like an optax GradientTransformation (callable ``init`` and ``update``)."""
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        raise TypeError(
            f"{where}(inner) expects an optax GradientTransformation (e.g. optax.sgd(0.1)), got {type(inner).__name__}"
        )


def check_state(state: Any, cls: type, where: str) -> None:
    if not isinstance(state, cls):
        raise TypeError(
            f"{where}: state must be the {cls.__name__} returned by init/update, got {type(state).__name__}"
        )


def check_updates(updates: Any, params: Any, where: str) -> Any:
    """Gradients must be float (or complex) and, when params are given, shaped like them.

    Returns ``updates`` with every leaf a JAX array (NumPy float64 becomes float32 without x64, as in
    ``jnp.asarray``; JAX arrays and tracers come back as they are).

    Integer and bool gradients are rejected (no gradient of a loss is an integer; casting one would
    silently make a step out of a count or a mask).
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(updates)
    for path, g in flat:
        dtype = getattr(g, "dtype", None)
        if dtype is None and isinstance(g, int) or dtype is not None and not jnp.issubdtype(dtype, jnp.inexact):
            got = dtype if dtype is not None else type(g).__name__
            raise TypeError(
                f"{where}: updates must be float gradients, got {got} at {jax.tree_util.keystr(path) or 'the root'}"
            )
    if params is None:
        return jax.tree.map(jnp.asarray, updates)
    ptree = jax.tree.structure(params)
    if ptree != treedef:
        raise ValueError(f"{where}: updates and params must have the same tree structure, got {treedef} and {ptree}")
    for (path, g), p in zip(flat, jax.tree.leaves(params), strict=True):
        if jnp.shape(g) != jnp.shape(p):
            raise ValueError(
                f"{where}: updates and params must have the same shapes, got {jnp.shape(g)} and {jnp.shape(p)} "
                f"at {jax.tree_util.keystr(path)}"
            )
    return jax.tree.map(jnp.asarray, updates)
