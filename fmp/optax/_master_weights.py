"""Master weights for optax: low-precision params for the forward pass, a float32 copy in the optimizer state.

The JAX counterpart of apex's ``FP16_Optimizer`` master params. The inner transformation sees float32
gradients and float32 params; the master copy accumulates its updates, so updates far smaller than a
bfloat16/float16 parameter's spacing are not rounded away.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fmp.optax._checks import check_inner, check_updates

_MSG_NO_PARAMS = (
    "master_weights needs the current params: call update(grads, state, params). The returned updates are "
    "cast(new_master) - params, so params must be the values the previous updates were applied to."
)
_MSG_MASTER_DTYPE = "master_dtype must be a floating dtype such as jnp.float32, got {!r}"
_MSG_FIND = (
    "master_params: expected exactly one MasterWeightsState inside opt_state (from fmp.optax.master_weights), found {}."
)


class MasterWeightsState(NamedTuple):
    """State of `master_weights`.

    Attributes:
      master: A tree shaped like the params: the ``master_dtype`` copy of every floating leaf narrower than
        ``master_dtype``, and None for every other leaf (a float32 param is its own master: no copy).
      inner_state: The inner transformation's state, built from the master params.

    Examples:
      >>> import optax, fmp.optax
      >>> params = {"w": jnp.zeros(2, jnp.bfloat16), "b": jnp.zeros(2, jnp.float32)}
      >>> state = fmp.optax.master_weights(optax.sgd(0.1)).init(params)
      >>> type(state).__name__, state.master["w"].dtype, state.master["b"]
      ('MasterWeightsState', dtype('float32'), None)
    """

    master: Any
    inner_state: optax.OptState


def _needs_master(x: Any, master_dtype: np.dtype) -> bool:
    if x is None:
        return False
    dtype = jnp.result_type(x)
    return bool(jnp.issubdtype(dtype, jnp.floating)) and jnp.finfo(dtype).bits < jnp.finfo(master_dtype).bits


def _is_none(x: Any) -> bool:
    return x is None


def _param_update(m: Any, new_m: Any, u: Any, p: Any) -> Any:
    """``cast(new_m) - p`` where the master moved, ``-0.0`` (the exact identity of ``p + u``) where it did not.

    A param can sit one rounding away from ``cast(master)`` after a large step; re-targeting it on a step that
    did not move its master (a skipped step, an accumulation micro-step) would change params on a step that must
    leave them bit for bit. It is re-targeted by the next step that moves its master instead.
    """
    if m is None:
        return u
    p = jnp.asarray(p)
    return jnp.where(new_m == m, jnp.full(p.shape, -0.0, p.dtype), new_m.astype(p.dtype) - p)


def master_weights(
    inner: optax.GradientTransformation, *, master_dtype: jax.typing.DTypeLike = jnp.float32
) -> optax.GradientTransformationExtraArgs:
    """Runs ``inner`` on a float32 master copy of low-precision params.

    For every floating param leaf narrower than ``master_dtype`` (float16, bfloat16), the state holds a
    ``master_dtype`` copy. Each update casts the gradients up, runs ``inner`` on the master params, applies
    its updates to the masters, and returns ``cast(new_master, param.dtype) - param``, computed in the
    param's dtype. Leaves already in ``master_dtype`` (or wider, or not floating) pass through: ``inner``
    sees them as they are and its updates are returned unchanged.

    Exactness: ``optax.apply_updates(params, updates)`` then lands **exactly** on ``cast(new_master)`` for a
    leaf whenever ``cast(new_master) - param`` is representable in the param's dtype. That always holds when
    the new value is within a factor of two of the old one with the same sign (Sterbenz's lemma), which covers
    every ordinary step. A leaf that jumps further (e.g. crossing zero) can land one rounding of the difference
    away; the master is unaffected and the next update re-targets ``cast(master)``, so the error does not
    accumulate. A step that leaves a master element unchanged (a skipped step) leaves its param unchanged too,
    bit for bit. `master_params` gives ``cast(master)`` exactly, whatever happened.

    Composes with ``optax.chain`` and with other wrappers. With loss scaling, put ``master_weights``
    outermost, ``master_weights(loss_scaled(inner))``: the scaled float16 gradients are cast to float32
    before they are unscaled (as apex did), and a skipped step returns zero updates, leaving both master and
    params unchanged.

    Args:
      inner: The optimizer to run on the master params (any ``GradientTransformation``; extra args are
        forwarded).
      master_dtype: dtype of the master copy (float32 by default).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      `MasterWeightsState`.

    Raises:
      TypeError: ``inner`` is not a GradientTransformation, ``master_dtype`` is not a floating dtype,
        or ``update`` gets integer/bool gradients.
      ValueError: ``master_dtype`` is 64-bit while ``jax_enable_x64`` is off, or ``update`` is called
        without ``params`` or with gradients shaped unlike them.

    Examples:
      >>> import optax
      >>> import fmp.optax
      >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
      >>> opt = fmp.optax.master_weights(optax.sgd(1e-3))
      >>> state = opt.init(params)
      >>> for _ in range(10):  # each step is far below bfloat16's spacing at 1.0 (2**-7)
      ...     updates, state = opt.update({"w": jnp.ones(3, jnp.bfloat16)}, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> state.master["w"]
      Array([0.9900001, 0.9900001, 0.9900001], dtype=float32)
      >>> params["w"]
      Array([0.988281, 0.988281, 0.988281], dtype=bfloat16)
    """
    check_inner(inner, "master_weights")
    if master_dtype is None:  # np.dtype(None) is float64
        raise TypeError(_MSG_MASTER_DTYPE.format(master_dtype))
    try:
        mdtype = np.dtype(master_dtype)
    except TypeError:
        raise TypeError(_MSG_MASTER_DTYPE.format(master_dtype)) from None
    if not jnp.issubdtype(mdtype, jnp.floating):
        raise TypeError(_MSG_MASTER_DTYPE.format(master_dtype))
    if mdtype.itemsize > 4 and not jax.config.jax_enable_x64:
        raise ValueError(
            f"master_dtype={mdtype.name} needs 64-bit JAX (jax.config.update('jax_enable_x64', True)); "
            "without it JAX would silently keep float32 masters"
        )
    inner = optax.with_extra_args_support(inner)

    def full_master(master: Any, params: Any) -> Any:
        return jax.tree.map(lambda m, p: p if m is None else m, master, params, is_leaf=_is_none)

    def init_fn(params: optax.Params) -> MasterWeightsState:
        master = jax.tree.map(
            lambda p: jnp.asarray(p).astype(mdtype) if _needs_master(p, mdtype) else None, params, is_leaf=_is_none
        )
        return MasterWeightsState(master=master, inner_state=inner.init(full_master(master, params)))

    def update_fn(
        updates: optax.Updates, state: MasterWeightsState, params: optax.Params | None = None, **extra_args: Any
    ) -> tuple[optax.Updates, MasterWeightsState]:
        if params is None:
            raise ValueError(_MSG_NO_PARAMS)
        updates = check_updates(updates, params, "master_weights.update")
        grads = jax.tree.map(
            lambda m, g: g if m is None or g is None else jnp.asarray(g).astype(m.dtype),
            state.master,
            updates,
            is_leaf=_is_none,
        )
        inner_updates, inner_state = inner.update(
            grads, state.inner_state, full_master(state.master, params), **extra_args
        )
        new_master = jax.tree.map(
            lambda m, u: None if m is None else (m + jnp.asarray(u).astype(m.dtype)).astype(m.dtype),
            state.master,
            inner_updates,
            is_leaf=_is_none,
        )
        out = jax.tree.map(_param_update, state.master, new_master, inner_updates, params, is_leaf=_is_none)
        return out, MasterWeightsState(master=new_master, inner_state=inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def master_params(opt_state: optax.OptState, params: optax.Params) -> optax.Params:
    """``cast(master, param.dtype)`` for every leaf with a master copy, ``params`` elsewhere.

    Finds the one `MasterWeightsState` anywhere inside ``opt_state`` (a chain, a
    wrapper's state).
    Use it to resynchronise params with their masters bit for bit, e.g. after restoring a checkpoint that
    saved only the optimizer state.

    Args:
      opt_state: An optimizer state containing exactly one `MasterWeightsState`.
      params: The current params (for the structure, dtypes and the leaves without a master).

    Returns:
      A tree like ``params``.

    Raises:
      ValueError: ``opt_state`` holds no or several `MasterWeightsState`.

    Examples:
      >>> import optax
      >>> import fmp.optax
      >>> params = {"w": jnp.ones(2, jnp.float16), "b": jnp.zeros(2, jnp.float32)}
      >>> opt = optax.chain(optax.clip(1.0), fmp.optax.master_weights(optax.sgd(0.5)))
      >>> state = opt.init(params)
      >>> _, state = opt.update(jax.tree.map(jnp.ones_like, params), state, params)
      >>> fmp.optax.master_params(state, params)["w"]
      Array([0.5, 0.5], dtype=float16)
    """
    found = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, MasterWeightsState))
        if isinstance(s, MasterWeightsState)
    ]
    if len(found) != 1:
        raise ValueError(_MSG_FIND.format(len(found)))
    return jax.tree.map(
        lambda m, p: p if m is None else m.astype(jnp.result_type(p)), found[0].master, params, is_leaf=_is_none
    )
