"""optax side of delayed float8 scaling: one call applies the parameter update and the new amax history."""

from __future__ import annotations

from typing import Any

import optax

from fmp._core._renamed import NOT_GIVEN, renamed_argument
from fmp._float8._state import Float8State


def float8_step(
    optimizer: optax.GradientTransformation,
    grads: tuple[Any, Float8State],
    opt_state: optax.OptState,
    params: Any,
    float8_state: Float8State | None = None,
    *,
    fp8_state: Any = NOT_GIVEN,
) -> tuple[Any, optax.OptState, Float8State]:
    """Applies ``optimizer`` to the parameters and takes the next ``fmp.Float8State``.

    ``grads`` is ``jax.grad(loss, argnums=(0, 1))(params, float8_state, ...)``: the
    parameter gradients and the gradient with respect to the state, which
    carries the new amax histories (see ``fmp.Float8State``). The state's
    gradient never reaches the optimizer.

    Returns:
      ``(new_params, new_opt_state, new_float8_state)``.

    Examples:
      >>> import optax, fmp.optax
      >>> f = lambda w, x: x @ w
      >>> w, x = jnp.ones((4, 2)), jnp.ones((3, 4))
      >>> pol = "p=f32,c=bf16,o=f32,float8=delayed"
      >>> st = fmp.float8_state(f, pol)(w, x)
      >>> loss = lambda w, st: fmp.autocast(f, pol, float8_state=st)(w, x).sum()
      >>> opt = optax.sgd(0.1)
      >>> w, opt_state, st = fmp.optax.float8_step(opt, jax.grad(loss, (0, 1))(w, st), opt.init(w), w, st)
      >>> st.amax_history[0, :, 0]
      Array([1., 1., 1.], dtype=float32)
    """
    float8_state = renamed_argument(float8_state, fp8_state, "float8_step(fp8_state=...)", "float8_step(float8_state=...)")
    if not isinstance(float8_state, Float8State):
        raise TypeError(f"float8_step(float8_state=...) expects an fmp.Float8State, got {type(float8_state).__name__}")
    if not isinstance(grads, tuple) or len(grads) != 2 or not isinstance(grads[1], Float8State):
        raise TypeError(
            "float8_step(grads=...) expects (param_grads, state_grad) from jax.grad(loss, argnums=(0, 1)) "
            "with the Float8State as the loss's second argument"
        )
    param_grads, state_grad = grads
    updates, opt_state = optimizer.update(param_grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, float8_state.update(state_grad)
