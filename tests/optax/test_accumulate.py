"""fmp.optax.accumulate: torch's accumulation semantics, recovery after a bad micro-batch, composition, jit."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

optax = pytest.importorskip("optax")

from _helpers.common import optax_not_strict as _standard_promotion  # noqa: E402
from _helpers.common import tree_bits as _bits  # noqa: E402

import fmp  # noqa: E402
import fmp.optax  # noqa: E402


def _scale(state):
    return float(fmp.optax.current_scaler(state).loss_scale)


def _micro_grads(n, seed=0):
    keys = jax.random.split(jax.random.key(seed), n)
    return [{"w": jax.random.normal(k, (3, 4)) * 100.0, "b": jax.random.normal(k, (4,))} for k in keys]


@pytest.mark.parametrize("use_grad_mean", [True, False])
@_standard_promotion
def test_equals_loss_scaled_on_the_accumulated_gradient_bitwise(use_grad_mean):
    # Clean run: k micro-batches through accumulate == one loss_scaled step on their float32 sum (/ k).
    k = 3
    inner = fmp.optax.loss_scaled(optax.adam(1e-2), fmp.GradScaler(init_scale=8.0, growth_interval=2))
    acc_opt = fmp.optax.accumulate(inner, k, use_grad_mean=use_grad_mean)
    params = {"w": jnp.ones((3, 4)), "b": jnp.zeros(4)}
    acc_state, ref_state = acc_opt.init(params), inner.init(params)
    acc_params, ref_params = params, params
    acc_step, ref_step = jax.jit(acc_opt.update), jax.jit(inner.update)
    grads = _micro_grads(4 * k)
    for e in range(4):
        window = grads[e * k : (e + 1) * k]
        for i, g in enumerate(window):
            before = _bits(acc_params)
            u, acc_state = acc_step(g, acc_state, acc_params)
            acc_params = optax.apply_updates(acc_params, u)
            if i < k - 1:  # micro-steps change nothing and keep the scale constant
                assert _bits(acc_params) == before
                assert _scale(acc_state) == _scale(ref_state)
        total = functools.reduce(lambda a, b: jax.tree.map(jnp.add, a, b), window)
        if use_grad_mean:
            total = jax.tree.map(lambda x: x / jnp.float32(k), total)
        u, ref_state = ref_step(total, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, u)
        assert _bits(acc_params) == _bits(ref_params)
        assert _bits(acc_state.inner_state) == _bits(ref_state)
    assert _scale(ref_state) == 32.0  # grew twice: the scale schedule runs once per effective batch
    assert acc_step._cache_size() == 1


@pytest.mark.parametrize(("bad", "position"), [(jnp.inf, 0), (-jnp.inf, 1), (jnp.nan, 2)])
def test_a_bad_micro_batch_skips_exactly_its_effective_batch(bad, position):
    k = 3
    opt = fmp.optax.accumulate(fmp.optax.loss_scaled(optax.sgd(1.0), fmp.GradScaler(init_scale=16.0)), k)
    update = jax.jit(opt.update)
    p = jnp.zeros(2)
    state = opt.init(p)
    clean = jnp.full(2, 16.0, jnp.float32)
    outs = []
    for e in range(3):
        for i in range(k):
            g = clean.at[1].set(bad) if (e == 1 and i == position) else clean
            u, state = update(g, state, p)
            if i < k - 1:
                assert _bits(u) == _bits(jnp.full(2, -0.0, jnp.float32))
        outs.append((u, _scale(state), int(state.inner_state.skipped_steps)))
    np.testing.assert_array_equal(outs[0][0], [-1.0, -1.0])  # mean 16 at scale 16
    assert (outs[0][1], outs[0][2]) == (16.0, 0)
    assert _bits(outs[1][0]) == _bits(jnp.full(2, -0.0, jnp.float32)) and outs[1][1:] == (8.0, 1)
    np.testing.assert_array_equal(outs[2][0], [-2.0, -2.0])  # recovered: mean 16 at scale 8
    assert outs[2][1:] == (8.0, 1) and bool(fmp.all_finite(state.acc))


def test_state_stable_under_jit_and_cond():
    opt = fmp.optax.accumulate(fmp.optax.loss_scaled(optax.sgd(0.1)), 4)
    p = {"w": jnp.ones(3, jnp.bfloat16)}
    state = opt.init(p)
    assert state.acc["w"].dtype == jnp.float32 and state.mini_step.dtype == jnp.int32
    u, new = jax.jit(opt.update)({"w": jnp.ones(3, jnp.bfloat16)}, state, p)
    assert u["w"].dtype == jnp.bfloat16
    jax.lax.cond(True, lambda: state, lambda: new)
    for _ in range(3):
        u, new = jax.jit(opt.update)({"w": jnp.ones(3, jnp.bfloat16)}, new, p)
    assert int(new.mini_step) == 0 and float(jnp.abs(u["w"]).max()) > 0


@_standard_promotion
def test_composes_with_master_weights_outermost_and_float16_params():
    k = 2
    opt = fmp.optax.master_weights(
        fmp.optax.accumulate(fmp.optax.loss_scaled(optax.adam(1e-3), fmp.GradScaler(init_scale=2.0**10)), k)
    )
    params = {"w": jnp.full((4,), 1.0, jnp.float16)}
    state = opt.init(params)
    step = jax.jit(opt.update)
    scale = fmp.optax.current_scaler(state)
    assert float(scale.loss_scale) == 1024.0
    g = {"w": jnp.full((4,), 1024.0 * 1e-3, jnp.float16)}
    bad = {"w": g["w"].at[0].set(jnp.inf)}
    history = []
    for micro in [g, g, bad, g, g, g]:
        before_master = _bits(state.master)
        u, state = step(micro, state, params)
        params = optax.apply_updates(params, u)
        history.append((_scale(state), _bits(state.master) == before_master))
    # micro-steps and the skipped batch leave the master alone; the others move it
    assert [moved is False for _, moved in history] == [False, True, False, False, False, True]
    assert [s for s, _ in history] == [1024.0, 1024.0, 1024.0, 512.0, 512.0, 512.0]
    assert _bits(params) == _bits(fmp.optax.master_params(state, params))


def test_composes_with_skip_nonfinite():
    opt = fmp.optax.accumulate(fmp.optax.skip_nonfinite(optax.sgd(1.0)), 2)
    p = jnp.zeros(2)
    state = opt.init(p)
    outs = []
    for g in ([1.0, jnp.nan], [1.0, 1.0], [1.0, 1.0], [3.0, 3.0]):
        u, state = opt.update(jnp.array(g, jnp.float32), state, p)
        outs.append(float(u[0]))
    assert outs == [-0.0, -0.0, -0.0, -2.0] and int(state.inner_state.skipped_steps) == 1


def test_every_k_one_is_the_inner_transformation():
    inner = fmp.optax.loss_scaled(optax.sgd(1.0), fmp.GradScaler(init_scale=2.0))
    opt = fmp.optax.accumulate(inner, 1)
    p = jnp.zeros(2)
    s1, s2 = opt.init(p), inner.init(p)
    for g in ([2.0, 4.0], [jnp.inf, 1.0], [2.0, 2.0]):
        u1, s1 = opt.update(jnp.array(g, jnp.float32), s1, p)
        u2, s2 = inner.update(jnp.array(g, jnp.float32), s2, p)
        assert _bits(u1) == _bits(u2) and _bits(s1.inner_state) == _bits(s2)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"every_k": 0}, ValueError, "every_k must be an int >= 1.*got 0"),
        ({"every_k": 2.0}, TypeError, "every_k must be an int >= 1.*got 2.0"),
        ({"every_k": True}, TypeError, "every_k must be an int"),
        ({"every_k": 2, "use_grad_mean": 1}, TypeError, "use_grad_mean must be a bool"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        fmp.optax.accumulate(optax.sgd(1.0), **kwargs)


def test_use_grad_mean_averages_complex_leaves_too():
    # the mean applies to every inexact leaf: a complex gradient is divided by every_k like a real one
    params = {"r": jnp.zeros(2, jnp.float32), "c": jnp.zeros(2, jnp.complex64)}
    opt = fmp.optax.accumulate(optax.sgd(1.0), 2, use_grad_mean=True)
    state = opt.init(params)
    grads = {"r": jnp.full(2, 2.0, jnp.float32), "c": jnp.full(2, 2.0 + 2.0j, jnp.complex64)}
    _, state = opt.update(grads, state, params)
    updates, state = opt.update(grads, state, params)
    np.testing.assert_array_equal(updates["r"], np.full(2, -2.0, np.float32))
    np.testing.assert_array_equal(updates["c"], np.full(2, -2.0 - 2.0j, np.complex64))
