"""fmp.optax.master_weights: float32 master copies of low-precision params inside the optimizer state."""

from __future__ import annotations

import runpy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

optax = pytest.importorskip("optax")

from _helpers.common import ROOT  # noqa: E402

import fmp.optax  # noqa: E402

LOW = [jnp.bfloat16, jnp.float16]


def _params(dtype, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "w": jax.random.normal(k1, (4, 3), jnp.float32).astype(dtype),
        "b": jax.random.normal(k2, (3,), jnp.float32).astype(dtype),
    }


def _grads(params, seed):
    keys = jax.random.split(jax.random.key(seed), len(params))
    return {
        name: (1e-2 * jax.random.normal(k, p.shape, jnp.float32)).astype(p.dtype)
        for (name, p), k in zip(sorted(params.items()), keys, strict=True)
    }


@pytest.mark.parametrize("dtype", LOW)
def test_state_layout_and_dtypes(dtype):
    params = {**_params(dtype), "f32": jnp.ones(2, jnp.float32), "step": jnp.zeros((), jnp.int32)}
    opt = fmp.optax.master_weights(optax.sgd(0.1, momentum=0.9))
    state = opt.init(params)
    assert isinstance(state, fmp.optax.MasterWeightsState)
    assert state.master["w"].dtype == jnp.float32 and state.master["b"].dtype == jnp.float32
    assert state.master["f32"] is None and state.master["step"] is None  # no copy of float32 / int leaves
    np.testing.assert_array_equal(state.master["w"], params["w"].astype(jnp.float32))
    # the inner optimizer's state is float32 (built from the masters)
    trace = state.inner_state[0].trace
    assert trace["w"].dtype == jnp.float32 and trace["f32"].dtype == jnp.float32


@pytest.mark.parametrize("dtype", LOW)
def test_updates_land_exactly_on_cast_master_under_jit(dtype):
    params = {**_params(dtype), "f32": jnp.linspace(-1.0, 1.0, 3, dtype=jnp.float32)}  # no master for f32
    opt = fmp.optax.master_weights(optax.sgd(1e-2, momentum=0.9))
    state = opt.init(params)
    traces = []

    @jax.jit
    def step(params, state, grads):
        traces.append(1)
        updates, new_state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), new_state, updates

    for i in range(20):
        new_params, new_state, updates = step(params, state, _grads(params, i))
        assert jax.tree.map(lambda u: u.dtype, updates) == jax.tree.map(lambda p: p.dtype, params)
        assert jax.tree.map(lambda p: p.dtype, new_params) == jax.tree.map(lambda p: p.dtype, params)
        assert new_state.master["f32"] is None
        for name in ("w", "b"):
            np.testing.assert_array_equal(new_params[name], new_state.master[name].astype(dtype))
        jax.lax.cond(True, lambda s=state: s, lambda s=new_state: s)  # state structure and dtypes are stable
        params, state = new_params, new_state
    assert len(traces) == 1  # no recompile after the first call


@pytest.mark.parametrize("dtype", LOW)
def test_tiny_updates_accumulate_in_the_master(dtype):
    params = {"w": jnp.ones(4, dtype)}
    opt = fmp.optax.master_weights(optax.sgd(1e-4))
    state = opt.init(params)
    plain_opt = optax.sgd(1e-4)
    plain_params, plain_state = params, plain_opt.init(params)
    g = {"w": jnp.ones(4, dtype)}
    for _ in range(100):
        updates, state = opt.update(g, state, params)
        params = optax.apply_updates(params, updates)
        plain_updates, plain_state = plain_opt.update(g, plain_state, plain_params)
        plain_params = optax.apply_updates(plain_params, plain_updates)
    np.testing.assert_allclose(state.master["w"], 0.99, rtol=1e-5)  # float32 accumulation of 100 steps
    np.testing.assert_array_equal(params["w"], state.master["w"].astype(dtype))
    assert float(params["w"][0]) < 1.0
    np.testing.assert_array_equal(plain_params["w"], jnp.ones(4, dtype))  # every step rounded away


def test_float32_params_pass_through_bitwise():
    params = _params(jnp.float32)
    inner = optax.sgd(0.05, momentum=0.9)
    opt = fmp.optax.master_weights(inner)
    s1, s2 = opt.init(params), inner.init(params)
    p1 = p2 = params
    for i in range(5):
        g = _grads(params, i)
        u1, s1 = opt.update(g, s1, p1)
        u2, s2 = inner.update(g, s2, p2)
        assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), u1, u2))
        p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), p1, p2))


def test_masters_match_a_float32_run_of_the_same_gradients():
    # Fed the same float32 gradients, the masters follow a float32 optimizer exactly.
    params = _params(jnp.bfloat16)
    f32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    inner = optax.sgd(3e-3, momentum=0.9)
    opt = fmp.optax.master_weights(inner)
    state, ref_state = opt.init(params), inner.init(f32)
    for i in range(20):
        g = _grads(f32, i)
        updates, state = opt.update(g, state, params)
        params = optax.apply_updates(params, updates)
        ref_updates, ref_state = inner.update(g, ref_state, f32)
        f32 = optax.apply_updates(f32, ref_updates)
    for name in f32:
        np.testing.assert_array_equal(state.master[name], f32[name])


def test_large_jump_misses_by_one_rounding_and_is_retargeted():
    # 1.0 -> 1e-5 in one step: the difference is not representable in bfloat16, so p + u cannot land
    # on cast(master) (the documented exception); master_params is exact. A step that does not move the
    # master (zero gradient, a skipped step) leaves the param alone, bit for bit; the next step that moves
    # the master re-targets it.
    params = {"w": jnp.ones(1, jnp.bfloat16)}
    opt = fmp.optax.master_weights(optax.sgd(1.0))
    state = opt.init(params)
    updates, state = opt.update({"w": jnp.full(1, 1.0 - 1e-5, jnp.float32)}, state, params)
    target = state.master["w"].astype(jnp.bfloat16)
    params = optax.apply_updates(params, updates)
    assert not bool(jnp.array_equal(params["w"], target))
    np.testing.assert_array_equal(fmp.optax.master_params(state, params)["w"], target)
    missed = params["w"]
    updates, state = opt.update({"w": jnp.zeros(1, jnp.bfloat16)}, state, params)
    params = optax.apply_updates(params, updates)
    assert params["w"].tobytes() == missed.tobytes()
    updates, state = opt.update({"w": jnp.full(1, 1e-6, jnp.bfloat16)}, state, params)
    params = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(params["w"], state.master["w"].astype(jnp.bfloat16))


@pytest.mark.parametrize("dtype", LOW)
def test_sterbenz_steps_are_exact(dtype):
    # Any new value within a factor of two of the old (same sign) is reached exactly by apply_updates.
    rng = np.random.default_rng(0)
    old = jnp.asarray(rng.uniform(-4, 4, 4096).astype(np.float32)).astype(dtype)
    ratio = jnp.asarray(rng.uniform(0.5, 2.0, 4096).astype(np.float32))
    params = {"w": old}
    opt = fmp.optax.master_weights(optax.sgd(1.0))
    state = opt.init(params)
    grad = {"w": old.astype(jnp.float32) * (1 - ratio)}  # new master = old * ratio
    updates, state = opt.update(grad, state, params)
    new = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(new["w"], state.master["w"].astype(dtype))


def test_composes_with_chain_and_skipping_transforms():
    params = {"w": jnp.ones(3, jnp.float16)}
    # outer clipping on the low-precision grads, inner skipping on the float32 grads
    opt = optax.chain(
        optax.clip(10.0), fmp.optax.master_weights(optax.apply_if_finite(optax.sgd(0.5), max_consecutive_errors=5))
    )
    state = opt.init(params)
    bad = {"w": jnp.array([1.0, jnp.nan, 1.0], jnp.float16)}  # clip keeps NaN (it would clip an inf)
    updates, state = opt.update(bad, state, params)
    new = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(new["w"], params["w"])  # skipped: params and master unchanged
    np.testing.assert_array_equal(fmp.optax.master_params(state, params)["w"], params["w"])
    good = {"w": jnp.array([1.0, 2.0, 20.0], jnp.float16)}
    updates, state = opt.update(good, state, new)
    new = optax.apply_updates(new, updates)
    np.testing.assert_array_equal(new["w"], jnp.array([0.5, 0.0, -4.0], jnp.float16))


def test_extra_args_are_forwarded():
    seen = {}

    def update_fn(updates, state, params=None, *, value=None, **extra):
        seen["value"] = value
        seen["params_dtype"] = jax.tree.leaves(params)[0].dtype
        return updates, state

    inner = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update_fn)
    opt = fmp.optax.master_weights(inner)
    params = {"w": jnp.ones(2, jnp.bfloat16)}
    opt.update({"w": jnp.ones(2, jnp.bfloat16)}, opt.init(params), params, value=jnp.float32(3.0))
    assert float(seen["value"]) == 3.0 and seen["params_dtype"] == jnp.float32


def test_errors():
    opt = fmp.optax.master_weights(optax.sgd(0.1))
    params = {"w": jnp.ones(2, jnp.bfloat16)}
    with pytest.raises(ValueError, match="needs the current params"):
        opt.update(params, opt.init(params))
    with pytest.raises(TypeError, match="master_dtype must be a floating dtype"):
        fmp.optax.master_weights(optax.sgd(0.1), master_dtype=jnp.int32)
    with pytest.raises(TypeError, match="master_dtype must be a floating dtype"):
        fmp.optax.master_weights(optax.sgd(0.1), master_dtype="not a dtype")
    with pytest.raises(ValueError, match="needs 64-bit JAX"):
        fmp.optax.master_weights(optax.sgd(0.1), master_dtype=jnp.float64)
    with pytest.raises(ValueError, match="found 0"):
        fmp.optax.master_params(optax.sgd(0.1).init(params), params)


# ---------------------------------------------------------------- the 200-step curves (docs/guides/master_weights.md)


@pytest.fixture(scope="module")
def curves():
    module = runpy.run_path(str(ROOT / "examples" / "master_weights_curves.py"))
    result = module["run_experiment"](steps=200)
    return result, module["summary"](result)


@pytest.mark.xdist_group("master_weights_curves")  # the 200-step curves once (tests/conftest.py)
def test_master_weights_track_float32_over_200_steps(curves):
    result, s = curves
    f32, mw = result["float32"], result["bfloat16 + master_weights"]
    assert mw["params"].dtype == jnp.bfloat16 and mw["master"].dtype == np.float32
    # documented tolerance: the loss curves never differ by more than 3% of the initial loss,
    # and the final losses agree within 5%
    assert np.max(np.abs(mw["loss"] - f32["loss"])) <= 0.03 * result["init_loss"]
    assert abs(s["final loss bf16 + master_weights"] / s["final loss float32"] - 1) <= 0.05
    # the float32 masters stay within one bfloat16 spacing at 1.0 (2**-7) of the float32 params
    assert s["max |master - float32 params| (any step)"] <= 2.0**-7
    assert s["final loss float32"] < 0.05 * s["initial loss"]  # and the problem was actually learned
    assert s["steps where bf16 params == cast(master)"] >= 195


@pytest.mark.xdist_group("master_weights_curves")  # the 200-step curves once (tests/conftest.py)
def test_plain_bfloat16_visibly_stalls(curves):
    result, s = curves
    assert s["final loss bf16"] > 0.5 * s["initial loss"]
    assert s["final loss bf16"] > 10 * s["final loss float32"]
    assert s["plain bf16: weights that ever moved"] <= s["weights"] / 2  # most updates rounded away


def test_outermost_master_weights_unscales_in_float32():
    # Why master_weights goes outside loss scaling: the scaled float16 grads are cast to float32 first,
    # so unscaling keeps grads that float16 cannot hold (1e-8 is below float16's smallest subnormal).
    params = {"w": jnp.zeros(2, jnp.float16)}
    scale = 2.0**20
    scaled_grads = {"w": jnp.full(2, 1e-8 * scale, jnp.float32).astype(jnp.float16)}
    outer = fmp.optax.master_weights(optax.chain(optax.scale(1 / scale), optax.sgd(1.0)))
    inner = optax.chain(optax.scale(1 / scale), fmp.optax.master_weights(optax.sgd(1.0)))
    _, s_outer = outer.update(scaled_grads, outer.init(params), params)
    _, s_inner = inner.update(scaled_grads, inner.init(params), params)
    assert float(s_outer.master["w"][0]) == pytest.approx(-1e-8, rel=1e-3)
    assert float(s_inner[1].master["w"][0]) == 0.0  # the unscaled grad flushed to zero in float16
