"""Float8 never hides an overflow: an inf or NaN in an operand or an output gradient gives a non-finite result
(forward and backward, every recipe, eager and jit), so a loss scaler sees it; finite values still saturate."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fmp

F32 = jnp.float32
DN = (((1,), (0,)), ((), ()))
RECIPES = ["tensorwise", "rowwise", "blockwise", "delayed"]


def _xw(seed=0, m=8, k=16, n=4):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    return jax.random.normal(kx, (m, k), F32), jax.random.normal(kw, (k, n), F32)


def _matmul(scaling, state=None):
    """``x @ w`` autocast to float8; delayed scaling with a history that has seen amax 4 (scales from it)."""
    pol = f"p=f32,c=f32,o=f32,float8={scaling}"
    if scaling != "delayed":
        return fmp.autocast(lambda x, w: x @ w, pol)
    st = fmp.float8_state(lambda x, w: x @ w, pol)(*_xw())
    st = st.update(type(st)(jnp.full_like(st.amax_history, 4.0), st.sites, st.recipe))
    return fmp.autocast(lambda x, w: x @ w, pol, float8_state=st)


def _forward_and_vjp(f):
    def run(x, w, g):
        out, vjp = jax.vjp(f, x, w)
        return (out, *vjp(g))

    return run


@pytest.mark.parametrize("scaling", RECIPES)
def test_non_finite_operand_or_gradient_gives_non_finite_results(scaling):
    x, w = _xw()
    g = jnp.ones((8, 4), F32)
    run = _forward_and_vjp(_matmul(scaling))
    cases = [  # (x, w, g), which of (out, dx, dw) must hold a non-finite value
        ((x.at[1, 2].set(np.inf), w, g), (True, False, True)),
        ((x, w.at[3, 1].set(-np.inf), g), (True, True, False)),
        ((x.at[5, 0].set(np.nan), w, g), (True, False, True)),
        ((x, w.at[0, 2].set(np.nan), g), (True, True, False)),
        ((x, w, g.at[3, 1].set(np.inf)), (False, True, True)),
        ((x, w, g.at[6, 0].set(np.nan)), (False, True, True)),
    ]
    jitted = jax.jit(run)
    for args, bad in cases:
        got = jitted(*args)
        assert tuple(not np.all(np.isfinite(np.asarray(r))) for r in got) == bad
    # eager equals jit (NaN where jit has NaN)
    for r_eager, r_jit in zip(run(*cases[0][0]), jitted(*cases[0][0]), strict=True):
        np.testing.assert_array_equal(np.asarray(r_eager), np.asarray(r_jit))


@pytest.mark.parametrize("scaling", RECIPES)
def test_finite_values_beyond_the_range_still_saturate(scaling):
    # delayed scales from a history of amax 4: a finite 1e6 operand saturates to 448 / scale
    x, w = _xw()
    x = x.at[0, 0].set(1e6)
    f = _matmul(scaling)
    out = f(x, w)
    dx, dw = jax.grad(lambda x, w: jnp.sum(f(x, w)), argnums=(0, 1))(x, w)
    assert np.all(np.isfinite(np.asarray(out))) and np.all(np.isfinite(np.asarray(dx)))
    assert np.all(np.isfinite(np.asarray(dw)))
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(x, w)), np.asarray(out))


def test_convolution_sees_non_finite_operand():
    x = jnp.ones((1, 1, 6, 6), F32).at[0, 0, 2, 2].set(np.inf)
    w = jnp.ones((2, 1, 3, 3), F32)

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "VALID")

    assert not np.all(np.isfinite(np.asarray(fmp.autocast(conv, "mixed_float8")(x, w))))


def test_loss_scaler_sees_an_overflow_float8_would_saturate():
    """float16 compute and a huge loss scale: the scaled gradient overflows float16; the step must be skipped."""
    kx, k1, k2 = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, (16, 32), F32)
    p = {"w1": jax.random.normal(k1, (32, 64), F32) / 6, "w2": jax.random.normal(k2, (64, 8), F32) / 8}

    def loss(p, x):
        y = fmp.autocast(lambda p, x: jax.nn.relu(x @ p["w1"]) @ p["w2"], "p=f32,c=f16,o=f32,float8=tensorwise")(p, x)
        return jnp.mean(y**2)

    step = jax.jit(lambda scaler, p, x: fmp.value_and_grad(loss, scaler)(p, x))
    _, _, finite, new = step(fmp.GradScaler(init_scale=2.0**24), p, x)
    assert not bool(finite) and float(new.loss_scale) < 2.0**24
    # with a scale that does not overflow float16 the step is taken and the gradients are finite
    _, grads, finite, _ = step(fmp.GradScaler(init_scale=2.0**4), p, x)
    assert bool(finite) and all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_non_finite_results_where_torchao_has_them(scaling):
    """torchao's Float8Linear (its named recipes, emulated on CPU): the same entries of the output, dx and dW
    are non-finite for an inf or NaN in the input, the weight or the output gradient."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchao")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from fmp._float8._dot import float8_dot_general

    rng = np.random.default_rng(0)
    x0, w0 = rng.standard_normal((8, 16)).astype(np.float32), rng.standard_normal((16, 4)).astype(np.float32)
    recipe = fmp.Float8Recipe(scaling, pow2_scales=scaling == "rowwise")  # torchao's scales in each recipe

    def ours(x, w, g):
        out, vjp = jax.vjp(lambda x, w: float8_dot_general(x, w, DN, recipe, F32), jnp.asarray(x), jnp.asarray(w))
        return [np.isfinite(np.asarray(r)) for r in (out, *vjp(jnp.asarray(g)))]

    def theirs(x, w, g):
        lin = torch.nn.Linear(16, 4, bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(w.T.copy()))
        model = convert_to_float8_training(
            torch.nn.Sequential(lin), config=Float8LinearConfig.from_recipe_name(scaling)
        )
        xt = torch.from_numpy(x).requires_grad_(True)
        out = model(xt)
        out.backward(torch.from_numpy(g))
        return [np.isfinite(r.detach().numpy()) for r in (out, xt.grad, lin.weight.grad.T)]

    for which, bad in [(0, np.inf), (0, np.nan), (1, -np.inf), (2, np.inf), (2, np.nan)]:
        args = [x0.copy(), w0.copy(), np.ones((8, 4), np.float32)]
        args[which][1, 2 if which < 2 else 1] = bad
        for a, b in zip(ours(*args), theirs(*args), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"operand {which} = {bad}")
