"""A custom_vjp backward rule runs under its forward's policy (like torch.amp.custom_bwd); fmp.bwd_as_written opts out."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fmp

BF16 = jnp.bfloat16


def _layer(bwd, define: str = "defvjp"):
    """``tanh(x @ w)`` with a custom vjp: ``bwd`` registered by ``define`` (defvjp, defvjp_with_logs, ...)."""

    @jax.custom_vjp
    def layer(x, w):
        return jnp.tanh(x @ w)

    def fwd(x, w):
        y = jnp.tanh(x @ w)
        return y, (x, w, y)

    getattr(layer, define)(fwd, bwd)
    return layer


def _gz(res, g):
    x, w, y = res
    return x, w, g * (1 - y**2)


def _make(bwd_wrap=lambda b: b):
    def bwd(res, g):
        x, w, gz = _gz(res, g)
        return gz @ w.T, x.T @ gz

    return _layer(bwd_wrap(bwd))


def _inputs():
    x = jax.random.normal(jax.random.key(0), (4, 3))
    w = jax.random.normal(jax.random.key(1), (3, 5))
    return x, w


def _hand_grads(x, w, bwd_dtype):
    """The forward cast by hand (bfloat16 matmul; residuals in float32, as the rule was written), and the
    backward's two matmuls in ``bwd_dtype``."""
    y = jnp.tanh(x.astype(BF16) @ w.astype(BF16)).astype(jnp.float32)
    gz = jnp.ones_like(y) * (1 - y**2)

    def mm(a, b):
        return (a.astype(bwd_dtype) @ b.astype(bwd_dtype)).astype(jnp.float32)

    return mm(gz, w.T), mm(x.T, gz)


def _grads(layer, x, w):
    return jax.grad(lambda x, w: jnp.sum(fmp.autocast(layer)(x, w)), argnums=(0, 1))(x, w)


def test_bwd_runs_under_the_forward_policy() -> None:
    x, w = _inputs()
    layer = _make()
    gx, gw = _grads(layer, x, w)
    hx, hw = _hand_grads(x, w, BF16)
    assert gx.dtype == gw.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(gx), np.asarray(hx))
    np.testing.assert_array_equal(np.asarray(gw), np.asarray(hw))
    # the backward's matmuls are in the compute dtype in the program itself
    jaxpr = jax.make_jaxpr(lambda x, w: jax.grad(lambda w: jnp.sum(fmp.autocast(layer)(x, w)))(w))(x, w)
    dots = [e.invars[0].aval.dtype for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots == [jnp.dtype(BF16)] * 3  # forward + two in the backward
    # against float32: one bfloat16 rounding per matmul operand (2**-8 relative) through tanh'
    gx32, gw32 = jax.grad(lambda x, w: jnp.sum(layer(x, w)), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(np.asarray(gw), np.asarray(gw32), atol=5e-2 * float(jnp.max(jnp.abs(gw32))))


def test_bwd_as_written_opts_out() -> None:
    x, w = _inputs()
    layer = _make(fmp.bwd_as_written)
    gx, gw = _grads(layer, x, w)
    hx, hw = _hand_grads(x, w, jnp.float32)
    np.testing.assert_array_equal(np.asarray(gx), np.asarray(hx))
    np.testing.assert_array_equal(np.asarray(gw), np.asarray(hw))
    with pytest.raises(TypeError, match="backward rule"):
        fmp.bwd_as_written(3)


def test_bwd_under_jit_and_with_none_cotangent() -> None:
    @jax.custom_vjp
    def f(x, w):
        return x @ w

    f.defvjp(lambda x, w: (x @ w, x), lambda x, g: (None, x.T @ g))  # no cotangent for x
    x, w = _inputs()
    loss = lambda w: jnp.sum(fmp.autocast(f)(x, w) ** 2)  # noqa: E731
    eager = jax.grad(loss)(w)
    jitted = jax.jit(jax.grad(loss))(w)
    assert eager.dtype == jnp.float32
    ref = jax.grad(lambda w: jnp.sum(f(x, w) ** 2))(w)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), atol=3e-2 * float(jnp.max(jnp.abs(ref))))
    np.testing.assert_allclose(np.asarray(eager), np.asarray(ref), atol=3e-2 * float(jnp.max(jnp.abs(ref))))


def test_bwd_follows_an_override_policy() -> None:
    """Under ``overrides`` the forward runs in float32, and so does its backward."""
    x, w = _inputs()
    layer = _make()

    def model(x, w):
        with jax.named_scope("exact"):
            return layer(x, w)

    gw = jax.grad(lambda w: jnp.sum(fmp.autocast(model, overrides={"exact": "float32"})(x, w)))(w)
    np.testing.assert_array_equal(np.asarray(gw), np.asarray(jax.grad(lambda w: jnp.sum(layer(x, w)))(w)))


def _with_logs():
    def bwd(res, g):
        x, w, gz = _gz(res, g)
        return (gz @ w.T, x.T @ gz), {"gz_sq": jnp.sum(gz**2)}

    return _layer(bwd, "defvjp_with_logs")


@pytest.mark.skipif(not hasattr(jax.custom_vjp, "defvjp_with_logs"), reason="backward-pass logs: jax 0.11 and later")
def test_bwd_with_logs_runs_under_the_policy_and_returns_its_logs() -> None:
    """jax 0.11+'s bwd returns (cotangents, logs): the cotangents as under defvjp, the logs come out."""
    x, w = _inputs()
    layer = _with_logs()
    out, f_vjp = jax.vjp(fmp.autocast(layer), x, w)
    (gx, gw), logs = f_vjp.with_logs(jnp.ones_like(out))
    hx, hw = _hand_grads(x, w, BF16)
    np.testing.assert_array_equal(np.asarray(gx), np.asarray(hx))
    np.testing.assert_array_equal(np.asarray(gw), np.asarray(hw))
    y = jnp.tanh(x.astype(BF16) @ w.astype(BF16)).astype(jnp.float32)
    assert logs["gz_sq"].dtype == jnp.float32
    np.testing.assert_allclose(float(logs["gz_sq"]), float(jnp.sum((1 - y**2) ** 2)), rtol=1e-6)
    gw_plain = jax.grad(lambda w: jnp.sum(fmp.autocast(layer)(x, w)))(w)  # logs dropped, as JAX does
    np.testing.assert_array_equal(np.asarray(gw_plain), np.asarray(hw))


@pytest.mark.skipif(not hasattr(jax.custom_vjp, "defvjp_with_accums"), reason="accumulators: jax 0.12 and later")
@pytest.mark.parametrize("as_written", [False, True])
def test_bwd_with_accumulators(as_written: bool) -> None:
    """jax 0.12's bwd may push into accumulators; it runs under the policy, or as written when so marked."""

    def bwd(res, g, x_acc, w_acc):
        x, w, gz = _gz(res, g)
        x_acc.accum(gz @ w.T)
        w_acc.accum(x.T @ gz)

    layer = _layer(fmp.bwd_as_written(bwd) if as_written else bwd, "defvjp_with_accums")
    x, w = _inputs()
    gx, gw = _grads(layer, x, w)
    hx, hw = _hand_grads(x, w, jnp.float32 if as_written else BF16)
    np.testing.assert_array_equal(np.asarray(gx), np.asarray(hx))
    np.testing.assert_array_equal(np.asarray(gw), np.asarray(hw))
