"""Gradient accumulation that recovers from a non-finite micro-batch (torch's accumulation recipe for optax).

``optax.MultiSteps`` resets its accumulator as ``0 * acc``; after one inf/NaN micro-batch that is ``0 * inf =
NaN``, so every later effective batch is non-finite too. `accumulate` resets with a select, so
a bad micro-batch costs exactly its own effective batch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fmp.optax._loss_scaled import neg_zeros

_MSG_EVERY_K = "every_k must be an int >= 1 (micro-batches per effective batch), got {!r}"


class AccumulateState(NamedTuple):
    """State of `accumulate`.

    Attributes:
      mini_step: int32, micro-batches accumulated so far in the current effective batch (0 .. every_k - 1).
      acc: The running sum of this effective batch's gradients (float32 for narrower float leaves).
      inner_state: The wrapped transformation's state; it changes only at the end of an effective batch.

    Examples:
      >>> import optax, fmp.optax
      >>> opt = fmp.optax.accumulate(optax.sgd(0.1), every_k=2)
      >>> params = {"w": jnp.zeros(2)}
      >>> _, state = opt.update({"w": jnp.ones(2)}, opt.init(params), params)
      >>> type(state).__name__, int(state.mini_step), state.acc["w"].tolist()
      ('AccumulateState', 1, [1.0, 1.0])
    """

    mini_step: jax.Array
    acc: Any
    inner_state: optax.OptState


def _acc_dtype(x: Any) -> Any:
    dtype = jnp.result_type(x)
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
        return jnp.float32
    return dtype


def accumulate(
    inner: optax.GradientTransformation, every_k: int, *, use_grad_mean: bool = True
) -> optax.GradientTransformationExtraArgs:
    """Accumulates ``every_k`` micro-batches of gradients, then runs ``inner`` once on their sum (or mean).

    The way to accumulate with loss scaling: ``accumulate(fmp.optax.loss_scaled(inner), k)``. It follows
    torch's accumulation recipe: the gradients stay *scaled* and the scale stays constant within an
    effective batch (the ``loss_scaled`` state, scale included, only changes when ``inner`` runs); the
    inf/NaN check, the skip and the scale update happen once per effective batch, on the accumulated
    gradients. A non-finite micro-batch therefore skips exactly its effective batch, the scale backs off
    once, and the accumulator is reset with a select (never ``0 * acc``, which is NaN after an inf), so the
    next effective batch trains normally. ``optax.MultiSteps`` gets this last part wrong.

    Micro-steps return ``-0.0`` updates (the exact identity of ``p + u``); the last micro-step of each
    effective batch returns ``inner``'s updates. Gradients narrower than float32 are summed in float32 and
    cast back to their dtype before ``inner`` sees them (as ``MultiSteps`` does).
    `current_scaler`
    finds the scaler inside; with master weights put `master_weights` outermost:
    ``master_weights(accumulate(loss_scaled(inner), k))``. Extra arguments (``value=...``) reach ``inner``
    from the last micro-step of each effective batch.

    Args:
      inner: The transformation to run once per effective batch (typically ``loss_scaled(...)``).
      every_k: Micro-batches per effective batch, an int >= 1.
      use_grad_mean: True (the default, like ``MultiSteps``) divides the accumulated sum by ``every_k``;
        False passes the sum, for losses already divided by ``every_k`` (torch's recipe).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is an `AccumulateState`.

    Raises:
      TypeError: ``every_k`` is not an int, or ``use_grad_mean`` not a bool.
      ValueError: ``every_k`` < 1.

    Examples:
      >>> import optax
      >>> opt = fmp.optax.accumulate(fmp.optax.loss_scaled(optax.sgd(1.0), fmp.GradScaler(init_scale=4.0)), 2)
      >>> p = jnp.zeros(2)
      >>> state = opt.init(p)
      >>> for g in ([jnp.inf, 4.0], [4.0, 4.0], [4.0, 4.0], [12.0, 12.0]):  # scaled micro-batch gradients
      ...     u, state = opt.update(jnp.array(g), state, p)
      >>> u, fmp.optax.current_scaler(state).loss_scale  # batch 1 skipped (scale 4 -> 2), batch 2 trains
      (Array([-4., -4.], dtype=float32), Array(2., dtype=float32))
    """
    if isinstance(every_k, bool) or not isinstance(every_k, int):
        raise TypeError(_MSG_EVERY_K.format(every_k))
    if every_k < 1:
        raise ValueError(_MSG_EVERY_K.format(every_k))
    if not isinstance(use_grad_mean, bool):
        raise TypeError(f"use_grad_mean must be a bool, got {use_grad_mean!r}")
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: optax.Params) -> AccumulateState:
        acc = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), _acc_dtype(p)), params)
        return AccumulateState(jnp.zeros([], jnp.int32), acc, inner.init(params))

    def update_fn(updates, state: AccumulateState, params=None, **extra_args):
        summed = jax.tree.map(lambda a, g: a + jnp.asarray(g).astype(a.dtype), state.acc, updates)
        emit = state.mini_step == every_k - 1

        def finish(summed, inner_state, params):
            def cast_back(a, g):
                if use_grad_mean and every_k > 1 and jnp.issubdtype(a.dtype, jnp.inexact):  # complex too
                    a = a / jnp.asarray(every_k, a.dtype)
                return a.astype(jnp.result_type(g))

            grads = jax.tree.map(cast_back, summed, updates)
            return inner.update(grads, inner_state, params, **extra_args)

        def wait(summed, inner_state, params):
            shapes, _ = jax.eval_shape(finish, summed, inner_state, params)
            return neg_zeros(shapes), inner_state

        new_updates, new_inner = jax.lax.cond(emit, finish, wait, summed, state.inner_state, params)
        # reset by selecting zeros: `0 * acc` would keep a NaN forever after an inf micro-batch
        acc = jax.tree.map(lambda a: jnp.where(emit, jnp.zeros_like(a), a), summed)
        mini_step = jnp.where(emit, jnp.zeros_like(state.mini_step), state.mini_step + 1)
        return new_updates, AccumulateState(mini_step, acc, new_inner)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
