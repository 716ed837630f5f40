"""Low-precision params without a float32 master copy: stochastic rounding and Kahan-compensated updates.

Both go last in a chain, ``optax.chain(optax.adam(1e-3), fmp.optax.stochastic_round())``, and return updates in
each param's dtype, chosen so that ``optax.apply_updates(params, updates)`` lands every bfloat16/float16 param
on the value the repair picked (`fmp._rounding.update_to`). Other leaves pass through.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fmp._rounding import is_rounded, landed, round_stochastic, update_to
from fmp.optax._checks import check_state, check_updates

_MSG_NO_PARAMS = (
    "{} needs the current params: call update(updates, state, params). It returns the update that lands each "
    "bfloat16/float16 param on its new value, which depends on the param."
)
_MSG_SEED = "seed must be an int (the PRNG seed of the rounding), got {!r}"


class StochasticRoundState(NamedTuple):
    """State of `stochastic_round`.

    Attributes:
      key: The raw PRNG key (uint32, shape ``(2,)``) of the next step's random bits; it advances on every
        update, so the same seed replays the same run.

    Examples:
      >>> import optax, fmp.optax
      >>> state = fmp.optax.stochastic_round(seed=0).init({"w": jnp.zeros(2, jnp.bfloat16)})
      >>> type(state).__name__, state.key.dtype, state.key.shape
      ('StochasticRoundState', dtype('uint32'), (2,))
    """

    key: jax.Array


class KahanState(NamedTuple):
    """State of `kahan`.

    Attributes:
      compensation: A tree shaped like the params: for every bfloat16/float16 leaf, what rounding the last
        update dropped (in the param's dtype), added to the next update; None for every other leaf.

    Examples:
      >>> import optax, fmp.optax
      >>> params = {"w": jnp.zeros(2, jnp.bfloat16), "b": jnp.zeros(2, jnp.float32)}
      >>> state = fmp.optax.kahan().init(params)
      >>> type(state).__name__, state.compensation["w"].dtype, state.compensation["b"]
      ('KahanState', dtype(bfloat16), None)
    """

    compensation: Any


def _is_none(x: Any) -> bool:
    return x is None


def _checked(name: str, updates: Any, state: Any, cls: type, params: Any) -> Any:
    check_state(state, cls, f"{name}.update")
    if params is None:
        raise ValueError(_MSG_NO_PARAMS.format(name))
    return check_updates(updates, params, f"{name}.update")


def _leaf_keys(key: jax.Array, n: int) -> list[jax.Array]:
    return [jax.random.fold_in(key, i) for i in range(n)]


def stochastic_round(seed: int = 0) -> optax.GradientTransformationExtraArgs:
    """Lands every bfloat16/float16 param on ``param + update`` rounded stochastically: no master copy needed.

    Put it last in the chain. Each update computes ``x = param + update`` in float32 and rounds it to the
    param's dtype up or down at random, with probabilities that make the expected result exactly ``x``
    (unbiased); it returns the update that makes ``optax.apply_updates`` land on that value. An update far
    below the param's spacing therefore still moves the param on average, where round-to-nearest drops it
    every time. float32 (and other) leaves pass through unchanged.

    The random bits come from a key in the state that advances on every update: the same seed replays the same
    run. Under ``jit`` with sharded params each shard draws its own bits (no gather). Inside
    ``fmp.optax.loss_scaled(optax.chain(inner, stochastic_round()))`` or ``fmp.optax.accumulate``, a skipped
    step (or an accumulation micro-step) rounds nothing and leaves the key where it was. Outside them, a
    skipped step's zero updates leave every param bit for bit (an exact value rounds to itself) but the key
    still advances.

    Exactness: the param lands exactly on the rounded value whenever the difference is representable in the
    param's dtype, which holds for every step that keeps the sign and stays within a factor of two. A step
    that crosses zero to a much smaller value, or jumps many binades, lands one rounding of the difference
    away (within a spacing of the difference).

    Args:
      seed: The PRNG seed, an int.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a `StochasticRoundState`.

    Raises:
      TypeError: ``seed`` is not an int; from ``update``: integer/bool updates or a wrong state.
      ValueError: from ``update``: no ``params``, or updates shaped unlike them.

    Examples:
      >>> import optax
      >>> import fmp.optax
      >>> params = {"w": jnp.ones(1000, jnp.bfloat16)}
      >>> opt = optax.chain(optax.sgd(1e-3), fmp.optax.stochastic_round(seed=0))
      >>> state = opt.init(params)
      >>> for _ in range(10):  # each step is far below bfloat16's spacing at 1.0 (2**-7)
      ...     updates, state = opt.update({"w": jnp.ones(1000, jnp.bfloat16)}, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> round(float(params["w"].astype(jnp.float32).mean()), 2)  # round-to-nearest would stay at 1.0
      0.99
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(_MSG_SEED.format(seed))

    def init_fn(params: optax.Params) -> StochasticRoundState:
        del params
        return StochasticRoundState(jax.random.PRNGKey(seed))

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        updates = _checked("stochastic_round", updates, state, StochasticRoundState, params)
        key, sub = jax.random.split(state.key)
        flat_u, treedef = jax.tree.flatten(updates)
        flat_p = jax.tree.leaves(params)
        out = []
        for k, u, p in zip(_leaf_keys(sub, len(flat_u)), flat_u, flat_p, strict=True):
            p = jnp.asarray(p)
            if not is_rounded(p):
                out.append(u)
                continue
            bits = jax.random.bits(k, p.shape, jnp.uint32)
            target = round_stochastic(p.astype(jnp.float32) + u.astype(jnp.float32), p.dtype, bits)
            out.append(update_to(target, p))
        return jax.tree.unflatten(treedef, out), StochasticRoundState(key)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def kahan() -> optax.GradientTransformationExtraArgs:
    """Kahan-compensated updates for bfloat16/float16 params: what rounding drops is carried to the next step.

    Put it last in the chain. The state keeps one compensation buffer per bfloat16/float16 param, in the
    param's dtype (2 bytes per element, half a float32 master copy). Each update computes
    ``x = param + update + compensation`` in float32, lands the param on ``x`` rounded to nearest, and keeps
    ``x - new_param`` (rounded to the param's dtype) as the next compensation. Updates far below the param's
    spacing accumulate in the buffer until they move the param. float32 (and other) leaves pass through.

    Deterministic (no random bits). Inside ``fmp.optax.loss_scaled`` / ``accumulate`` a skipped step leaves
    the buffers bit for bit.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a `KahanState`.

    Raises:
      TypeError, ValueError: from ``update``, as for `stochastic_round`.

    Examples:
      >>> import optax
      >>> import fmp.optax
      >>> params = jnp.ones(2, jnp.bfloat16)
      >>> opt = optax.chain(optax.sgd(1.0), fmp.optax.kahan())
      >>> state = opt.init(params)
      >>> for _ in range(500):  # 500 steps of 1e-4, each far below bfloat16's spacing at 1.0 (2**-7)
      ...     updates, state = opt.update(jnp.full(2, -1e-4, jnp.bfloat16), state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> params  # round-to-nearest would stay at 1.0; 1.05 lies between 1.04688 and 1.05469
      Array([1.05469, 1.05469], dtype=bfloat16)
    """

    def init_fn(params: optax.Params) -> KahanState:
        return KahanState(
            jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.result_type(p)) if is_rounded(p) else None, params)
        )

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        updates = _checked("kahan", updates, state, KahanState, params)
        flat_u, treedef = jax.tree.flatten(updates)
        flat_c = jax.tree.leaves(state.compensation, is_leaf=_is_none)
        new_u, new_c = [], []
        for c, u, p in zip(flat_c, flat_u, jax.tree.leaves(params), strict=True):
            if c is None:
                new_u.append(u)
                new_c.append(None)
                continue
            p = jnp.asarray(p)
            x = p.astype(jnp.float32) + u.astype(jnp.float32) + c.astype(jnp.float32)
            new_u.append(update_to(x.astype(p.dtype), p))
            new_c.append((x - landed(p, new_u[-1]).astype(jnp.float32)).astype(c.dtype))
        new_updates = jax.tree.unflatten(treedef, new_u)
        comp = jax.tree.unflatten(treedef, new_c)
        return new_updates, KahanState(comp)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
