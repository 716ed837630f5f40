"""fmp.optax.loss_scaled / skip_nonfinite / current_scaler: skipping, composition, jit behaviour."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

optax = pytest.importorskip("optax")

from _helpers.common import optax_not_strict as _optax_not_strict  # noqa: E402
from _helpers.common import tree_bits as _bits  # noqa: E402

import fmp  # noqa: E402
import fmp.optax  # noqa: E402


def loss_fn(params, x, y, poison):
    pred = jnp.tanh(x @ params["w1"]) @ params["w2"] * poison
    return jnp.mean((pred - y) ** 2)


def _problem(seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    params = {"w1": jax.random.normal(k[0], (8, 16)) * 0.3, "w2": jax.random.normal(k[1], (16, 2)) * 0.3}
    return params, jax.random.normal(k[2], (32, 8)), jax.random.normal(k[3], (32, 2))


def _make_step(opt):
    def step(params, opt_state, x, y, poison):
        scaler = fmp.optax.current_scaler(opt_state)
        grads = jax.grad(lambda p: scaler.scale(loss_fn(p, x, y, poison)))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(step, donate_argnums=(0, 1))


@_optax_not_strict
def test_skipped_step_is_bitwise_noop_and_scale_adapts():
    params, x, y = _problem()
    params = {**params, "w2": params["w2"].at[0, 0].set(-0.0)}  # signed zeros survive a skipped step too
    opt = fmp.optax.loss_scaled(optax.adam(1e-2), fmp.GradScaler(init_scale=2.0**8, growth_interval=2))
    step = _make_step(opt)
    state = opt.init(params)
    params, state = step(params, state, x, y, jnp.float32(1.0))
    before_p, before_inner = _bits(params), _bits(state.inner_state)
    params, state = step(params, state, x, y, jnp.float32(jnp.nan))
    assert _bits(params) == before_p and _bits(state.inner_state) == before_inner
    assert float(state.scaler.loss_scale) == 2.0**7
    assert (int(state.skipped_steps), int(state.consecutive_skipped)) == (1, 1)
    params, state = step(params, state, x, y, jnp.float32(jnp.inf))
    assert (int(state.skipped_steps), int(state.consecutive_skipped)) == (2, 2)
    params, state = step(params, state, x, y, jnp.float32(1.0))
    assert (int(state.skipped_steps), int(state.consecutive_skipped)) == (2, 0)
    assert int(state.inner_state[0].count) == 2  # adam's step count only counts applied steps
    assert step._cache_size() == 1


@_optax_not_strict
def test_state_stability_and_transfer_guard():
    params, x, y = _problem()
    opt = fmp.optax.loss_scaled(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)))
    step = _make_step(opt)
    s0 = opt.init(params)
    one = jnp.float32(1.0)
    p1, s1 = step(params, s0, x, y, one)
    jax.lax.cond(True, lambda: s1, lambda: opt.init(p1))
    with jax.transfer_guard("disallow"):
        p2, s2 = step(p1, s1, x, y, one)
    assert step._cache_size() == 1 and int(fmp.optax.current_scaler(s2).growth_tracker) == 2


@_optax_not_strict
def test_100_steps_equal_f32_adam_reference():
    params, x, y = _problem(1)
    poisons = np.random.default_rng(1).choice([1.0, 1.0, 1.0, np.inf, np.nan], size=100).astype(np.float32)
    opt = fmp.optax.loss_scaled(optax.adam(1e-2), fmp.GradScaler(init_scale=2.0**10, growth_interval=3))
    ref_opt = optax.adam(1e-2)
    step = _make_step(opt)

    @jax.jit
    def ref_step(p, s, one):
        u, s = ref_opt.update(jax.grad(loss_fn)(p, x, y, one), s, p)
        return optax.apply_updates(p, u), s

    state, ref, ref_state = opt.init(params), params, ref_opt.init(params)
    params = jax.tree.map(jnp.copy, params)
    for poison in poisons:
        before = _bits((params, state.inner_state))
        params, state = step(params, state, x, y, jnp.float32(poison))
        if np.isfinite(poison):
            ref, ref_state = ref_step(ref, ref_state, jnp.float32(1.0))
        else:
            assert _bits((params, state.inner_state)) == before
        # Same math; XLA contracts multiply-adds into FMAs differently in the two compiled programs
        # (adam's nu update), so allow a few ulps here (after 100 steps with jaxlib 0.12 an entry of 6.5e-4 is
        # 2.8e-7 apart). test_grad.py's SGD loop is bit-exact.
        for a, b in zip(jax.tree.leaves((params, state.inner_state)), jax.tree.leaves((ref, ref_state)), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-7)
    assert int(state.skipped_steps) == int(np.sum(~np.isfinite(poisons))) > 10


def test_current_scaler_through_chain_multisteps_inject_hyperparams():
    p = jnp.zeros(3)
    nested = [
        optax.chain(optax.identity(), fmp.optax.loss_scaled(optax.sgd(0.1))),
        optax.MultiSteps(fmp.optax.loss_scaled(optax.sgd(0.1)), every_k_schedule=2),
        optax.inject_hyperparams(lambda learning_rate: fmp.optax.loss_scaled(optax.sgd(learning_rate)))(
            learning_rate=0.1
        ),
        fmp.optax.loss_scaled(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)),
    ]
    for opt in nested:
        assert float(fmp.optax.current_scaler(opt.init(p)).loss_scale) == 65536.0
    with pytest.raises(ValueError, match="no fmp.optax.loss_scaled state"):
        fmp.optax.current_scaler(optax.sgd(0.1).init(p))
    two = optax.chain(fmp.optax.loss_scaled(optax.sgd(0.1)), fmp.optax.loss_scaled(optax.sgd(0.1)))
    with pytest.raises(ValueError, match="exactly one"):
        fmp.optax.current_scaler(two.init(p))


def test_inject_hyperparams_outside_changes_lr():
    opt = optax.inject_hyperparams(lambda learning_rate: fmp.optax.loss_scaled(optax.sgd(learning_rate)))(
        learning_rate=0.5
    )
    state = opt.init(jnp.zeros(2))
    scaler = fmp.optax.current_scaler(state)
    u, state = jax.jit(opt.update)(scaler.scale(jnp.ones(2)), state)
    np.testing.assert_array_equal(u, [-0.5, -0.5])


@_optax_not_strict
def test_multisteps_checks_at_effective_batch_granularity_but_never_recovers():
    # Scaled gradients accumulate under a constant scale; the check, the skip and the scale update
    # happen once per effective batch (torch's accumulation recipe).
    opt = optax.MultiSteps(fmp.optax.loss_scaled(optax.sgd(1.0), fmp.GradScaler(init_scale=4.0)), every_k_schedule=2)
    update = jax.jit(opt.update)
    p = jnp.zeros(2)
    state = opt.init(p)
    scale = lambda st: float(fmp.optax.current_scaler(st).loss_scale)  # noqa: E731
    u, state = update(jnp.full(2, 4.0, jnp.float32), state, p)  # mini-step 1: nothing applied, scale unchanged
    assert scale(state) == 4.0 and float(jnp.abs(u).max()) == 0.0
    u, state = update(jnp.full(2, 12.0, jnp.float32), state, p)  # mini-step 2: mean of scaled grads 8 -> 2
    np.testing.assert_array_equal(u, [-2.0, -2.0])
    u, state = update(jnp.array([jnp.inf, 1.0]), state, p)  # an inf in the first mini-step ...
    assert scale(state) == 4.0 and float(jnp.abs(u).max()) == 0.0
    u, state = update(jnp.full(2, 4.0, jnp.float32), state, p)  # ... skips the whole effective batch, one back-off
    assert scale(state) == 2.0 and float(jnp.abs(u).max()) == 0.0
    assert int(state.inner_opt_state.skipped_steps) == 1
    # MultiSteps' failure (issue 10): it resets its accumulator as `0 * acc`, and 0 * inf is NaN, so after one
    # non-finite effective batch every later one is non-finite too and the scale collapses.
    for _ in range(3):
        u, state = update(jnp.full(2, 2.0, jnp.float32), state, p)
        u, state = update(jnp.full(2, 2.0, jnp.float32), state, p)
    assert not bool(fmp.all_finite(state.acc_grads)) and scale(state) == 2.0 / 8
    assert int(state.inner_opt_state.skipped_steps) == 4
    # fmp.optax.accumulate, fed the same micro-batches, skips exactly the bad effective batch and recovers.
    acc = fmp.optax.accumulate(fmp.optax.loss_scaled(optax.sgd(1.0), fmp.GradScaler(init_scale=4.0)), 2)
    acc_update = jax.jit(acc.update)
    st = acc.init(p)
    grads = [[4.0, 4.0], [12.0, 12.0], [jnp.inf, 1.0], [4.0, 4.0]] + [[2.0, 2.0]] * 6
    out = []
    for g in grads:
        u, st = acc_update(jnp.array(g, jnp.float32), st, p)
        out.append((float(u[0]), scale(st)))
    assert out[1] == (-2.0, 4.0) and out[3] == (-0.0, 2.0)  # one skip, one back-off
    assert out[5] == out[7] == out[9] == (-2.0 / 2.0, 2.0)  # mean 2 at scale 2 -> 1: trains again
    assert int(st.inner_state.skipped_steps) == 1 and bool(fmp.all_finite(st.acc))


@_optax_not_strict
def test_extra_args_reach_the_inner_transform():
    inner = optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau(patience=0, factor=0.5, cooldown=0))
    opt = fmp.optax.loss_scaled(inner, fmp.GradScaler(init_scale=2.0))
    state = opt.init(jnp.zeros(2))
    g = jnp.full(2, 2.0)  # scaled by 2: unscaled 1
    for value in (1.0, 2.0, 3.0):
        u, state = opt.update(g, state, value=jnp.float32(value))
    assert float(u[0]) < -0.0 and float(u[0]) > -1.0  # the plateau transform saw the values and cut the lr


def test_disabled_scaler_is_plain_inner():
    opt = fmp.optax.loss_scaled(optax.sgd(1.0), fmp.GradScaler(enabled=False))
    state = opt.init(jnp.zeros(2))
    u, state = opt.update(jnp.array([1.0, jnp.nan]), state)
    assert float(u[0]) == -1.0 and bool(jnp.isnan(u[1])) and int(state.skipped_steps) == 0


@_optax_not_strict
def test_skip_nonfinite():
    opt = fmp.optax.skip_nonfinite(optax.adam(0.1))
    step = jax.jit(opt.update)
    p = jnp.ones(3)
    state = opt.init(p)
    u, state = step(jnp.ones(3), state, p)
    before = _bits(state.inner_state)
    u, state = step(jnp.array([1.0, jnp.nan, 1.0]), state, p)
    assert _bits(state.inner_state) == before and float(jnp.abs(u).max()) == 0.0
    assert (int(state.skipped_steps), int(state.consecutive_skipped)) == (1, 1)
    for _ in range(3):  # never gives up, unlike optax.apply_if_finite
        u, state = step(jnp.full(3, jnp.inf, jnp.float32), state, p)
    assert int(state.consecutive_skipped) == 4 and bool(fmp.all_finite(u))
    assert step._cache_size() == 1


def test_bf16_grads_with_f32_params():
    params = {"w": jnp.ones(4, jnp.float32)}
    opt = fmp.optax.loss_scaled(optax.sgd(1.0), fmp.GradScaler(init_scale=8.0))
    state = opt.init(params)
    u, state = jax.jit(opt.update)({"w": jnp.full(4, 8.0, jnp.bfloat16)}, state, params)
    assert u["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(u["w"], np.float32), -1.0)
