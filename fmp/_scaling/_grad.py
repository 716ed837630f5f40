"""Loss-scaled ``value_and_grad`` / ``grad``: scale the loss, differentiate, unscale, check, update the scale.

The canonical train step (everything inside one ``jax.jit``; the scaler is carried like the params)::

    @jax.jit
    def train_step(params, scaler, x, y):
        loss, grads, finite, scaler = fmp.value_and_grad(loss_fn, scaler)(params, x, y)
        new_params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return fmp.select_tree(finite, new_params, params), scaler, loss

XLA fuses the unscale, the finite-conditional select and the parameter update into one pass over the
gradients; the finite flag costs one more read of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from fmp._arrays import check_leaf
from fmp._scaling._finite import all_finite
from fmp._scaling._scaler import GradScaler

_MSG_NO_SCALER = (
    "fmp.{name}(fun, scaler) needs scaler, an fmp.GradScaler; got {got}. Make one with scaler = "
    "fmp.GradScaler() (dynamic loss scaling, for float16) and carry it through the train step like the params: "
    "the function returns the next one. bfloat16 needs no loss scaling: pass fmp.GradScaler.static(1.0) (keeps "
    "the finite flag) or use plain jax.{name}."
)


def _check_args(name: str, fun: Any, scaler: Any, argnums: Any, has_aux: Any) -> None:
    if not callable(fun):
        raise TypeError(f"{name}(fun) expects a callable (the loss function), got {type(fun).__name__}")
    if not isinstance(scaler, GradScaler):
        got = "no scaler" if scaler is None else f"a {type(scaler).__name__}"
        raise TypeError(_MSG_NO_SCALER.format(name=name, got=got))
    nums = argnums if isinstance(argnums, tuple | list) else (argnums,)
    if not nums or any(isinstance(n, bool) or not isinstance(n, int) for n in nums):
        raise TypeError(f"argnums must be an int or a non-empty sequence of ints, got {argnums!r}")
    if not isinstance(has_aux, bool):
        raise TypeError(f"has_aux must be a bool, got {has_aux!r}")


def _check_loss(loss: Any) -> None:
    loss = jnp.asarray(loss)
    if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(
            f"fun must return a float scalar loss (or (loss, aux) with has_aux=True), got {loss.dtype}{list(loss.shape)}"
        )


def _scaled_grads(
    fun: Callable[..., Any], scaler: GradScaler, argnums: int | Sequence[int], has_aux: bool, args: Any, kwargs: Any
) -> tuple[Any, Any, Any, jax.Array, GradScaler]:
    for path, leaf in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
        check_leaf(leaf, "fmp.value_and_grad: an argument", path)

    def scaled(*a: Any, **kw: Any) -> tuple[jax.Array, tuple[Any, Any]]:
        out = fun(*a, **kw)
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError("with has_aux=True, fun must return a pair (loss, aux)")
            loss, aux = out
        else:
            loss, aux = out, None
        _check_loss(loss)
        return scaler.scale(loss), (loss, aux)

    (_, (loss, aux)), grads = jax.value_and_grad(scaled, argnums=argnums, has_aux=True)(*args, **kwargs)
    if not scaler.enabled:
        return loss, aux, grads, jnp.array(True), scaler
    # torch checks the scaled gradients (before multiplying by 1/scale): same flag, and it lets XLA
    # fuse the unscale into whatever consumes the gradients.
    # a scale of 0 (or NaN) gives finite scaled gradients whose unscale is NaN: never take that step
    finite = all_finite(grads) & scaler._usable()
    return loss, aux, scaler.unscale(grads), finite, scaler.update(finite)


def value_and_grad(
    fun: Callable[..., Any], scaler: GradScaler | None = None, argnums: int | Sequence[int] = 0, has_aux: bool = False
) -> Callable[..., tuple[Any, Any, jax.Array, GradScaler]]:
    """Like ``jax.value_and_grad``, with loss scaling: returns the loss, true gradients, a finite flag and the next scaler.

    The returned function runs ``fun``, multiplies the loss by ``scaler``'s scale (in float32),
    differentiates, checks the scaled gradients for inf/NaN, divides them by the same scale, and
    updates the scaler with torch's rule. Call it inside ``jax.jit`` with the current scaler each step.

    ``finite`` is also False when the scale itself has no finite float32 reciprocal (0 after a very long
    run of overflows, or a NaN set with ``update(new_scale=...)``): unscaling would give ``0 * inf = NaN``.

    The finite flag covers the gradients only, not ``aux``: a NaN in a logged metric says nothing about
    whether the update is safe, and must not shrink the scale (jaxamp's check does include aux).

    Args:
      fun: Returns a float scalar loss, or ``(loss, aux)`` with ``has_aux=True``.
      scaler: The current `fmp.GradScaler` (required: without one the error says how to make one;
        bfloat16 needs none, see Raises).
      argnums: Which positional argument(s) to differentiate, as in ``jax.grad``.
      has_aux: Whether ``fun`` returns ``(loss, aux)``.

    Returns:
      A function ``f(*args, **kwargs) -> (value, grads, finite, new_scaler)``: ``value`` is ``loss``
      or ``(loss, aux)`` (the unscaled loss, in ``fun``'s dtype), ``grads`` the unscaled gradients,
      ``finite`` a bool scalar (False: skip this step) and ``new_scaler`` the scaler for the next
      step. With a disabled scaler nothing is scaled and ``finite`` is always True.

    Raises:
      TypeError: ``fun`` is not callable, ``scaler`` is missing or not a GradScaler (bfloat16 needs
        no loss scaling: ``fmp.GradScaler.static(1.0)`` or plain ``jax.value_and_grad``), ``argnums``
        is not an int or a sequence of ints, ``has_aux`` is not a bool, or ``fun`` does not return a
        float scalar loss. Integer or bool arguments named in ``argnums`` get ``jax.grad``'s own TypeError.

    Examples:
      >>> def loss_fn(w, x):
      ...     return jnp.sum((w * x) ** 2)
      >>> scaler = fmp.GradScaler(init_scale=1024.0)
      >>> loss, grads, finite, scaler = fmp.value_and_grad(loss_fn, scaler)(jnp.ones(2), jnp.array([1.0, 2.0]))
      >>> loss, grads, finite
      (Array(5., dtype=float32), Array([2., 8.], dtype=float32), Array(True, dtype=bool))
    """
    _check_args("value_and_grad", fun, scaler, argnums, has_aux)

    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any, jax.Array, GradScaler]:
        loss, aux, grads, finite, new_scaler = _scaled_grads(fun, scaler, argnums, has_aux, args, kwargs)
        value = (loss, aux) if has_aux else loss
        return value, grads, finite, new_scaler

    return wrapped


def grad(
    fun: Callable[..., Any], scaler: GradScaler | None = None, argnums: int | Sequence[int] = 0, has_aux: bool = False
) -> Callable[..., tuple[Any, jax.Array, GradScaler]]:
    """Like ``jax.grad``, with loss scaling; see `fmp.value_and_grad`.

    Returns:
      A function ``f(*args, **kwargs) -> (grads, finite, new_scaler)``, or
      ``((grads, aux), finite, new_scaler)`` with ``has_aux=True``.

    Examples:
      >>> g, finite, scaler = fmp.grad(lambda w: jnp.sum(w**2), fmp.GradScaler())(jnp.array([1.0, -3.0]))
      >>> g, finite
      (Array([ 2., -6.], dtype=float32), Array(True, dtype=bool))
    """
    _check_args("grad", fun, scaler, argnums, has_aux)

    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, jax.Array, GradScaler]:
        _, aux, grads, finite, new_scaler = _scaled_grads(fun, scaler, argnums, has_aux, args, kwargs)
        return ((grads, aux) if has_aux else grads), finite, new_scaler

    return wrapped
