"""NVFP4 stochastic rounding with a caller's key inside scan, jit, cond and checkpoint bodies.

A body's block-scaled sites take a key handed to the body as an input (a scan body: one per iteration), so a
new key gives new rounding and a rewritten body never keeps an earlier call's key; bodies that have no input
for a key (while_loop, custom derivative rules) refuse it at trace time.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fmp

F32 = jnp.float32
D = 32
DN = (((1,), (0,)), ((), ()))
WS = jax.random.normal(jax.random.key(3), (2, D, D), F32) / np.sqrt(D)
X = jax.random.normal(jax.random.key(2), (16, D), F32)


def _layer(h, w):
    return jnp.tanh(jax.lax.dot_general(h, w, DN))


def _scan_loss(ws, x):
    h, _ = jax.lax.scan(lambda h, w: (_layer(h, w), None), x, ws)
    return jnp.sum(h**2)


_jit_layer = jax.jit(_layer)


def _jit_loss(ws, x):
    return jnp.sum(_jit_layer(jnp.sin(x), ws[0]) ** 2)


def _cond_loss(ws, x):
    return jnp.sum(jax.lax.cond(jnp.sum(x) > -1e9, _layer, lambda h, w: h, x, ws[0]) ** 2)


def _remat_loss(ws, x):
    return jnp.sum(jax.checkpoint(_layer)(x, ws[0]) ** 2)


def _grad(loss, key):
    return jax.grad(fmp.autocast(loss, "mixed_nvfp4", key=key))(WS, X)


@pytest.mark.parametrize("loss", [_scan_loss, _jit_loss], ids=lambda f: f.__name__)
def test_a_body_rounds_with_the_key_of_each_call(loss):
    k1, k2 = jax.random.key(1), jax.random.key(2)
    a1, a2 = _grad(loss, k1), _grad(loss, k2)
    assert not np.array_equal(a1, a2)  # a new key gives new rounding (the body does not keep the first key)
    np.testing.assert_array_equal(jax.jit(lambda k: _grad(loss, k))(k1), a1)  # the same key replays, jitted


@pytest.mark.slow
@pytest.mark.parametrize("loss", [_scan_loss, _jit_loss, _cond_loss, _remat_loss], ids=lambda f: f.__name__)
def test_a_body_keeps_no_key_across_calls_and_traces(loss):
    k1, k2 = jax.random.key(1), jax.random.key(2)
    a1, a2, b1 = _grad(loss, k1), _grad(loss, k2), _grad(loss, k1)  # the second k1 call reuses no k2 body
    assert not np.array_equal(a1, a2)
    np.testing.assert_array_equal(a1, b1)
    step = jax.jit(lambda k: _grad(loss, k))
    np.testing.assert_array_equal(step(k2), a2)  # eager equals jit, bit for bit
    np.testing.assert_array_equal(step(k1), a1)
    np.testing.assert_array_equal(jax.jit(lambda k: _grad(loss, k))(k1), a1)  # a second traced step as well
    np.testing.assert_array_equal(_grad(loss, k2), a2)  # and an eager call after the traces
    nearest = jax.grad(fmp.autocast(loss, "mixed_nvfp4"))(WS, X)  # without a key: round to nearest
    assert not np.array_equal(nearest, a1)


def test_scan_iterations_do_not_share_rounding_noise():
    w = jax.random.normal(jax.random.key(5), (D, D), F32) / np.sqrt(D)
    ws = jnp.stack([w, w])  # two identical layers on the same input: only their keys tell them apart

    def loss(ws, x):
        _, ys = jax.lax.scan(lambda c, w: (c, jax.lax.dot_general(x, w, DN)), 0.0, ws)
        return jnp.sum(ys**2)

    g = jax.grad(fmp.autocast(loss, "mixed_nvfp4", key=jax.random.key(0)))(ws, X)
    nearest = jax.grad(fmp.autocast(loss, "mixed_nvfp4"))(ws, X)
    np.testing.assert_array_equal(nearest[0], nearest[1])
    assert not np.array_equal(g[0], g[1])


def test_a_while_loop_body_refuses_the_key():
    def loss(ws, x):
        h = jax.lax.while_loop(lambda c: c[1] < 2, lambda c: (_layer(c[0], ws[0]), c[1] + 1), (x, 0))[0]
        return jnp.sum(h**2)

    with pytest.raises(ValueError, match=r"key=.*while_loop.*without key="):
        fmp.autocast(loss, "mixed_nvfp4", key=jax.random.key(0))(WS, X)
    with pytest.raises(ValueError, match="without key="):
        jax.jit(lambda k: fmp.autocast(loss, "mixed_nvfp4", key=k)(WS, X))(jax.random.key(0))
    assert np.isfinite(fmp.autocast(loss, "mixed_nvfp4")(WS, X))  # without a key it runs
