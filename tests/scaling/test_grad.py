"""fmp.value_and_grad / fmp.grad: true gradients, the finite flag, jit behaviour, a 100-step loop vs f32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers.common import tree_bits as _bits

import fmp


def loss_fn(params, x, y, poison=None):
    pred = jnp.tanh(x @ params["w1"]) @ params["w2"] + params["b"]
    if poison is not None:
        pred = pred * poison
    return jnp.mean((pred - y) ** 2)


def _problem(seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    params = {
        "w1": jax.random.normal(k[0], (8, 16)) * 0.3,
        "w2": jax.random.normal(k[1], (16, 2)) * 0.3,
        "b": jnp.zeros(2),
    }
    return params, jax.random.normal(k[2], (32, 8)), jax.random.normal(k[3], (32, 2))


def test_value_and_grad_equals_jax_for_power_of_two_scale():
    params, x, y = _problem()
    scaler = fmp.GradScaler(init_scale=2.0**12)
    loss, grads, finite, new = jax.jit(lambda p: fmp.value_and_grad(loss_fn, scaler)(p, x, y))(params)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_fn))(params, x, y)
    assert bool(finite)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-9), grads, ref_grads)
    assert int(new.growth_tracker) == 1 and float(new.loss_scale) == 2.0**12


def test_has_aux_argnums_kwargs_and_grad():
    scaler = fmp.GradScaler(init_scale=64.0)

    def f(a, b, *, c):
        return jnp.sum(a * b * c), {"metric": jnp.nan}  # a NaN metric does not count as non-finite

    (loss, aux), grads, finite, _ = fmp.value_and_grad(f, scaler, argnums=(0, 1), has_aux=True)(
        jnp.float32(2.0), jnp.float32(3.0), c=jnp.float32(5.0)
    )
    assert float(loss) == 30.0 and bool(jnp.isnan(aux["metric"])) and bool(finite)
    assert (float(grads[0]), float(grads[1])) == (15.0, 10.0)
    (g, aux), finite, _ = fmp.grad(f, scaler, has_aux=True)(jnp.float32(2.0), jnp.float32(3.0), c=jnp.float32(5.0))
    assert float(g) == 15.0 and "metric" in aux
    g, finite, _ = fmp.grad(lambda w: jnp.sum(w**2), scaler)(jnp.ones(2))
    np.testing.assert_array_equal(g, [2.0, 2.0])


def test_errors():
    with pytest.raises(TypeError, match="scaler"):
        fmp.value_and_grad(loss_fn, 2.0**16)
    with pytest.raises(TypeError, match="float scalar loss"):
        fmp.value_and_grad(lambda w: w * 2, fmp.GradScaler())(jnp.ones(2))
    with pytest.raises(TypeError, match="pair"):
        fmp.value_and_grad(lambda w: jnp.sum(w), fmp.GradScaler(), has_aux=True)(jnp.ones(2))


def test_float16_gradients_that_underflow_without_scaling_survive():
    # d/dw of 1e-4 * w**2 at w=1e-4 is 2e-8: below float16's smallest subnormal (6e-8), so it flushes to
    # zero without scaling; with a scale of 2**16 it is representable and unscales to the true value.
    # float32 master weights, float16 compute (what autocast produces).
    w = jnp.full((4,), 1e-4, jnp.float32)
    f = lambda w: jnp.sum(jnp.float16(1e-4) * w.astype(jnp.float16) ** 2)  # noqa: E731
    plain = jax.grad(f)(w)
    assert float(jnp.max(jnp.abs(plain))) == 0.0
    # 2**16 itself is not a float16: the cotangent of a float16 loss overflows, the step is flagged
    # and the scale backs off, exactly as torch's GradScaler does on its first float16 steps.
    scaler = fmp.GradScaler(init_scale=2.0**16)
    g, finite, scaler = fmp.grad(f, scaler)(w)
    assert not bool(finite) and float(scaler.loss_scale) == 2.0**15
    g, finite, scaler = fmp.grad(f, scaler)(w)
    assert bool(finite) and g.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(g), 2e-8, rtol=0.01)


def test_overflow_backs_off_and_flags():
    params, x, y = _problem()
    scaler = fmp.GradScaler(init_scale=1024.0)
    _, grads, finite, new = fmp.value_and_grad(loss_fn, scaler)(params, x, y, jnp.float32(jnp.inf))
    assert not bool(finite) and float(new.loss_scale) == 512.0 and int(new.growth_tracker) == 0
    assert fmp.nonfinite_leaves(grads)


def test_disabled_scaler_is_plain_value_and_grad():
    params, x, y = _problem()
    scaler = fmp.GradScaler(enabled=False)
    loss, grads, finite, new = fmp.value_and_grad(loss_fn, scaler)(params, x, y, jnp.float32(jnp.nan))
    ref_loss, ref_grads = jax.value_and_grad(loss_fn)(params, x, y, jnp.float32(jnp.nan))
    assert bool(finite) and new is scaler  # nothing is checked, nothing skipped: like torch's disabled scaler
    assert _bits(grads) == _bits(ref_grads) and _bits(loss) == _bits(ref_loss)


def _make_step(lr=0.05):
    def step(params, scaler, x, y, poison):
        loss, grads, finite, scaler = fmp.value_and_grad(loss_fn, scaler)(params, x, y, poison)
        new = jax.tree.map(lambda p, g: p - lr * g, params, grads)
        return fmp.select_tree(finite, new, params), scaler, loss, finite

    return jax.jit(step, donate_argnums=(0,))


def test_train_step_no_recompile_and_cond_stability():
    params, x, y = _problem()
    step = _make_step()
    scaler = fmp.GradScaler(init_scale=256.0, growth_interval=2)
    one = jnp.float32(1.0)
    p1, s1, _, _ = step(params, scaler, x, y, one)
    p2, s2, _, _ = step(p1, s1, x, y, one)
    assert step._cache_size() == 1
    jax.lax.cond(True, lambda: s1, lambda: s2)
    jax.lax.cond(True, lambda: (p2, s2), lambda: step(p2, s2, x, y, one)[:2])


def test_train_step_under_transfer_guard():
    params, x, y = _problem()
    step = _make_step()
    scaler = fmp.GradScaler(init_scale=256.0)
    poison = jnp.float32(1.0)
    params, scaler, loss, finite = step(params, scaler, x, y, poison)  # compile outside the guard
    with jax.transfer_guard("disallow"):
        params, scaler, loss, finite = step(params, scaler, x, y, poison)
        params, scaler, loss, finite = step(params, scaler, x, y, poison)
    assert bool(finite) and int(scaler.growth_tracker) == 3


def test_100_steps_with_injected_infs_equal_f32_reference():
    params, x, y = _problem(1)
    rng = np.random.default_rng(0)
    poisons = rng.choice([1.0, 1.0, 1.0, 1.0, np.inf, np.nan, -np.inf], size=100).astype(np.float32)
    step = _make_step()
    # the reference: the same model, plain float32 gradients, no scaler; it just skips the same steps
    ref_step = jax.jit(lambda p, one: jax.tree.map(lambda a, g: a - 0.05 * g, p, jax.grad(loss_fn)(p, x, y, one)))
    scaler = fmp.GradScaler(init_scale=2.0**10, growth_interval=4)
    ref = params
    params = jax.tree.map(jnp.copy, params)
    skipped, scales = 0, set()
    for poison in poisons:
        before = _bits(params)
        params, scaler, _, finite = step(params, scaler, x, y, jnp.float32(poison))
        scales.add(float(scaler.loss_scale))
        assert bool(finite) == bool(np.isfinite(poison))
        if not finite:
            skipped += 1
            assert _bits(params) == before  # a skipped step leaves params bit-identical
        else:
            ref = ref_step(ref, jnp.float32(1.0))
        # power-of-two scales commute with float32 rounding: same bits as the unscaled f32 loop
        assert _bits(params) == _bits(ref)
    assert skipped > 10 and len(scales) > 3
