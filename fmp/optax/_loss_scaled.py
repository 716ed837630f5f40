"""optax transformations that unscale gradients, skip non-finite steps and adapt the loss scale."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fmp._scaling._finite import all_finite, select_tree
from fmp._scaling._scaler import GradScaler
from fmp.optax._checks import check_inner, check_state, check_updates

MSG_NO_SCALER = (
    "no fmp.optax.loss_scaled state found in opt_state. Build the optimizer with "
    "fmp.optax.loss_scaled(inner) (it may be nested in optax.chain, fmp.optax.accumulate, MultiSteps or inject_hyperparams) "
    "and pass the state returned by its init/update."
)


class LossScaledState(NamedTuple):
    """State of `loss_scaled`.

    Attributes:
      scaler: The `fmp.GradScaler` to scale the next loss with.
      inner_state: The wrapped optimizer's state (untouched on skipped steps).
      skipped_steps: int32, total skipped (non-finite) steps; saturates.
      consecutive_skipped: int32, non-finite steps in a row; 0 after a finite step. The scaler counts
        the same run (``scaler.consecutive_overflows``), and ``scaler.overflow_alarm`` (a bool array,
        readable inside ``jit``) turns True once it reaches the scaler's ``max_consecutive_overflows``;
        outside ``jit``, ``fmp.check_scaler_health(state)`` warns then.

    Examples:
      >>> import optax, fmp.optax
      >>> state = fmp.optax.loss_scaled(optax.sgd(0.1)).init({"w": jnp.zeros(3)})
      >>> type(state).__name__, float(state.scaler.loss_scale), int(state.skipped_steps)
      ('LossScaledState', 65536.0, 0)
    """

    scaler: GradScaler
    inner_state: optax.OptState
    skipped_steps: jax.Array
    consecutive_skipped: jax.Array


class SkipNonfiniteState(NamedTuple):
    """State of `skip_nonfinite` (the counters mean what they mean in `LossScaledState`).

    Examples:
      >>> import optax, fmp.optax
      >>> opt = fmp.optax.skip_nonfinite(optax.sgd(0.1))
      >>> params = {"w": jnp.zeros(3)}
      >>> _, state = opt.update({"w": jnp.array([1.0, jnp.inf, 0.0])}, opt.init(params), params)
      >>> type(state).__name__, int(state.skipped_steps), int(state.consecutive_skipped)
      ('SkipNonfiniteState', 1, 1)
    """

    inner_state: optax.OptState
    skipped_steps: jax.Array
    consecutive_skipped: jax.Array


def _counters(skipped: jax.Array, consecutive: jax.Array, finite: jax.Array) -> tuple[jax.Array, jax.Array]:
    bad = jnp.logical_not(finite)
    skipped = jnp.where(bad, optax.safe_increment(skipped), skipped)
    consecutive = jnp.where(bad, optax.safe_increment(consecutive), jnp.zeros_like(consecutive))
    return skipped, consecutive


def neg_zeros(tree: Any) -> Any:
    # -0.0 is the exact identity of IEEE addition (p + -0.0 == p bit for bit, signed zeros included),
    # so a skipped step leaves params untouched even through optax.apply_updates.
    def leaf(u):
        if jnp.issubdtype(u.dtype, jnp.floating):
            return jnp.full(u.shape, -0.0, u.dtype)
        return jnp.zeros(u.shape, u.dtype)

    return jax.tree.map(leaf, tree)


def _guarded_update(inner, updates, inner_state, params, finite, extra_args, prepare=lambda g: g):
    """``inner.update`` on finite steps; ``-0.0`` updates and the old state, bit for bit, otherwise.

    Two equivalent forms, picked statically by what is cheaper for XLA:
    * stateless or tiny-state optimizers (SGD): compute, then ``select``; the select fuses into
      ``optax.apply_updates``, so the step stays one pass over the gradients;
    * optimizers with tree-sized state (Adam): ``lax.cond``; a select over ``mu``/``nu`` would make XLA
      copy the donated state buffers every step, and the cond also skips the inner math on skipped steps.
    """
    state_size = sum(x.size for x in jax.tree.leaves(inner_state) if hasattr(x, "size"))
    update_size = sum(x.size for x in jax.tree.leaves(updates))
    if state_size < update_size:
        new_updates, new_inner = inner.update(prepare(updates), inner_state, params, **extra_args)
        new_updates = select_tree(finite, new_updates, neg_zeros(new_updates))
        new_inner = select_tree(finite, new_inner, inner_state)
        return new_updates, new_inner

    def apply(updates, inner_state, params):
        # `prepare` (the unscale) runs inside the branch, so XLA fuses it instead of materialising
        # the unscaled gradients as an operand of the cond
        return inner.update(prepare(updates), inner_state, params, **extra_args)

    def skip(updates, inner_state, params):
        shapes, _ = jax.eval_shape(apply, updates, inner_state, params)
        return neg_zeros(shapes), inner_state

    return jax.lax.cond(finite, apply, skip, updates, inner_state, params)


def loss_scaled(
    inner: optax.GradientTransformation, scaler: GradScaler | None = None, *, axis_name: Any = None
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` for loss-scaled gradients: unscale, check, apply ``inner`` only if finite, adapt the scale.

    ``update`` takes the gradients of the *scaled* loss (scale it with
    `current_scaler` of the state), checks them for inf/NaN with one reduction, unscales
    them (torch's float32 reciprocal) and runs ``inner``. On a non-finite step it returns zero updates
    (``-0.0``, the exact identity of ``p + u``) and keeps ``inner``'s state bit for bit, step counts
    included. Then it updates the scaler with torch's rule. Everything is branch-free and jit-safe.
    A scale with no finite float32 reciprocal (0, NaN) skips the step too: its unscale would be NaN.

    Composition: put clipping and everything that keeps state *inside* ``inner``
    (``loss_scaled(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)))``), so it sees
    unscaled gradients and is skipped with the step. To accumulate gradients use
    ``fmp.optax.accumulate(loss_scaled(inner), k)``: it checks, skips and updates the scale once per
    effective batch, like torch's accumulation recipe, and recovers after a non-finite micro-batch
    (``optax.MultiSteps`` does not: its ``0 * acc`` reset keeps a NaN forever). ``inject_hyperparams`` works outside or
    inside it; `current_scaler` finds the scaler through all of them.

    Args:
      inner: The optimizer to guard.
      scaler: The initial scaler (default ``fmp.GradScaler()``). A disabled scaler makes this
        ``inner`` with a pass-through state.
      axis_name: Inside ``shard_map``/``pmap`` with per-device gradients, the axis to all-reduce the
        finite flag over so every device skips together. Not needed under ``jit`` with sharded arrays.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a `LossScaledState`.

    Raises:
      TypeError: ``inner`` is not a GradientTransformation or ``scaler`` is not a GradScaler; from
        ``update``: integer/bool gradients, or a state that is not a `LossScaledState`.
      ValueError: from ``update``: gradients shaped unlike ``params`` (tree or leaf shapes).

    Examples:
      >>> import optax
      >>> opt = fmp.optax.loss_scaled(optax.sgd(0.1), fmp.GradScaler(init_scale=8.0))
      >>> params = jnp.ones(2)
      >>> state = opt.init(params)
      >>> scaler = fmp.optax.current_scaler(state)
      >>> grads = jax.grad(lambda p: scaler.scale(jnp.sum(p**2)))(params)
      >>> updates, state = opt.update(grads, state, params)
      >>> updates, fmp.optax.current_scaler(state).loss_scale
      (Array([-0.2, -0.2], dtype=float32), Array(8., dtype=float32))
      >>> updates, state = opt.update(grads * jnp.inf, state, params)
      >>> updates, fmp.optax.current_scaler(state).loss_scale, state.skipped_steps
      (Array([-0., -0.], dtype=float32), Array(4., dtype=float32), Array(1, dtype=int32))
    """
    check_inner(inner, "loss_scaled")
    if scaler is None:
        scaler = GradScaler()
    if not isinstance(scaler, GradScaler):
        raise TypeError(f"scaler must be an fmp.GradScaler or None, got {type(scaler).__name__}")
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: optax.Params) -> LossScaledState:
        # fresh, distinct arrays (no zero shared between leaves, no buffer shared with an earlier
        # init), so the state can be donated
        fresh = jax.tree.map(jnp.copy, scaler)
        return LossScaledState(fresh, inner.init(params), jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32))

    def update_fn(updates, state: LossScaledState, params=None, **extra_args):
        check_state(state, LossScaledState, "loss_scaled.update")
        updates = check_updates(updates, params, "loss_scaled.update")
        sc = state.scaler
        if not sc.enabled:
            new_updates, new_inner = inner.update(updates, state.inner_state, params, **extra_args)
            return new_updates, state._replace(inner_state=new_inner)
        # a scale of 0 (or NaN) gives finite scaled gradients whose unscale is NaN: never take that step
        finite = all_finite(updates, axis_name) & sc._usable()
        new_updates, new_inner = _guarded_update(
            inner, updates, state.inner_state, params, finite, extra_args, prepare=sc.unscale
        )
        skipped, consecutive = _counters(state.skipped_steps, state.consecutive_skipped, finite)
        return new_updates, LossScaledState(sc.update(finite), new_inner, skipped, consecutive)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def skip_nonfinite(
    inner: optax.GradientTransformation, *, axis_name: Any = None
) -> optax.GradientTransformationExtraArgs:
    """Applies ``inner`` only on steps whose gradients are all finite (no loss scaling).

    For bfloat16 runs, which need no scaling but must not take a NaN step. A skipped step returns
    ``-0.0`` updates and leaves ``inner``'s state bit for bit. Unlike ``optax.apply_if_finite`` it
    never gives up and applies a non-finite update.

    Args:
      inner: The optimizer to guard.
      axis_name: As in `loss_scaled`.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      `SkipNonfiniteState`.

    Raises:
      TypeError, ValueError: as for `loss_scaled`.

    Examples:
      >>> import optax
      >>> opt = fmp.optax.skip_nonfinite(optax.sgd(1.0))
      >>> state = opt.init(jnp.zeros(2))
      >>> updates, state = opt.update(jnp.array([1.0, jnp.nan]), state)
      >>> updates, state.skipped_steps
      (Array([-0., -0.], dtype=float32), Array(1, dtype=int32))
    """
    check_inner(inner, "skip_nonfinite")
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: optax.Params) -> SkipNonfiniteState:
        return SkipNonfiniteState(inner.init(params), jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32))

    def update_fn(updates, state: SkipNonfiniteState, params=None, **extra_args):
        check_state(state, SkipNonfiniteState, "skip_nonfinite.update")
        updates = check_updates(updates, params, "skip_nonfinite.update")
        finite = all_finite(updates, axis_name)
        new_updates, new_inner = _guarded_update(inner, updates, state.inner_state, params, finite, extra_args)
        skipped, consecutive = _counters(state.skipped_steps, state.consecutive_skipped, finite)
        return new_updates, SkipNonfiniteState(new_inner, skipped, consecutive)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def find_states(opt_state: Any) -> list[LossScaledState]:
    is_state = lambda x: isinstance(x, LossScaledState)  # noqa: E731
    return [x for x in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(x)]


def current_scaler(opt_state: optax.OptState) -> GradScaler:
    """Finds the `fmp.GradScaler` inside an optimizer state built with `loss_scaled`.

    Looks through any nesting (``optax.chain``, ``MultiSteps``, ``inject_hyperparams``, your own
    NamedTuples). Scale the next loss with the result.

    Raises:
      ValueError: there is no ``loss_scaled`` state, or more than one.

    Examples:
      >>> import optax
      >>> opt = optax.MultiSteps(fmp.optax.loss_scaled(optax.sgd(0.1)), every_k_schedule=2)
      >>> fmp.optax.current_scaler(opt.init(jnp.zeros(3))).loss_scale
      Array(65536., dtype=float32)
    """
    found = find_states(opt_state)
    if not found:
        raise ValueError(MSG_NO_SCALER)
    if len(found) > 1:
        raise ValueError(f"opt_state holds {len(found)} loss_scaled states; expected exactly one")
    return found[0].scaler
