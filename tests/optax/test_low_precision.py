"""Low-precision params without master weights: stochastic_round, kahan (fmp.optax) and the rounding math."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

optax = pytest.importorskip("optax")
from _helpers.common import optax_not_strict, run_with_devices  # noqa: E402
from _helpers.common import tree_bits as bits  # noqa: E402

import fmp.optax  # noqa: E402
from fmp._rounding import round_stochastic, update_to  # noqa: E402

LOW = [jnp.bfloat16, jnp.float16]


def _neighbours(x: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """The two values of ``dtype`` around float32 ``x`` (equal when ``x`` is representable)."""
    near = x.astype(dtype)
    near64 = near.astype(np.float64)
    x64 = x.astype(np.float64)
    other = np.nextafter(near, np.where(x64 > near64, np.inf, -np.inf).astype(dtype)).astype(np.float64)
    other = np.where(x64 == near64, near64, other)
    return np.minimum(near64, other), np.maximum(near64, other)


def _cases(dtype, n=4000, seed=0):
    """Params and float32 updates across magnitudes: tiny steps, sign changes, large exponents, exact zeros."""
    rng = np.random.default_rng(seed)
    top = 4 if dtype == jnp.float16 else 30
    p = (rng.choice([-1, 1], n) * 2.0 ** rng.uniform(-20, top, n)).astype(np.float32)
    rel = rng.choice([1e-5, 1e-3, 0.3, 1.0, 2.5, 100.0], n)  # 1.0 and more: many cross zero
    u = (-np.sign(p) * np.abs(p) * rel * rng.uniform(0.5, 1.5, n)).astype(np.float32)
    u[::7] = 0.0
    u[1::7] = -0.0
    u[2::7] = -u[2::7]  # growing steps
    return jnp.asarray(p).astype(dtype), jnp.asarray(u)


@pytest.mark.parametrize("dtype", LOW)
def test_lands_exactly_on_the_rounded_value(dtype):
    p, u = _cases(dtype)
    x = p.astype(jnp.float32) + u
    target = round_stochastic(x, dtype, jax.random.bits(jax.random.PRNGKey(1), x.shape, jnp.uint32))
    lo, hi = _neighbours(np.asarray(x), dtype)
    t64 = np.asarray(target.astype(jnp.float32), np.float64)
    assert np.all((t64 == lo) | (t64 == hi))
    landed = np.asarray(optax.apply_updates(p, update_to(target, p)))
    assert landed.dtype == np.dtype(dtype)
    diff = t64 - np.asarray(p.astype(jnp.float32), np.float64)
    exact = diff == diff.astype(dtype).astype(np.float64)  # the difference fits the param's dtype
    assert exact.mean() > 0.6 and (~exact).sum() > 0  # the sample holds both kinds
    small = np.abs(np.asarray(u, np.float64)) <= 0.5 * np.abs(np.asarray(p.astype(jnp.float32), np.float64))
    assert np.all(exact[small])  # every step that moves a param by at most half of itself is exact
    # the value exactly (a rounded tiny negative is -0.0, which no addition reaches from +0.0)
    np.testing.assert_array_equal(landed[exact].astype(np.float64), t64[exact])
    # the others (steps larger than the param: crossing zero, jumping binades) land within a spacing of the
    # difference, 2**-7 of it in bfloat16 and 2**-10 in float16
    err = np.abs(landed.astype(np.float64) - t64)[~exact]
    assert np.all(err <= np.abs(diff[~exact]) * 2.0 ** -(jnp.finfo(dtype).nmant))
    # a zero update leaves the param bit for bit, signed zeros included
    zero = np.asarray(u) == 0
    pz = np.asarray(p).copy()
    pz[:4] = [0.0, -0.0, 0.0, -0.0]
    pz = jnp.asarray(pz)
    zt = round_stochastic(pz.astype(jnp.float32) + u, dtype, jnp.full(u.shape, 0xFFFFFFFF, jnp.uint32))
    out = np.asarray(optax.apply_updates(pz, update_to(zt, pz)))
    np.testing.assert_array_equal(out[zero].view(np.uint16), np.asarray(pz)[zero].view(np.uint16))


@pytest.mark.parametrize("dtype", LOW)
def test_stochastic_rounding_is_unbiased(dtype):
    xs = np.float32([1.0 + 1e-3, -3.0001, 1e-6, 6.1e-5, -1234.567])  # float16 subnormal and normal, signs
    n = 40_000
    p = jnp.repeat(jnp.asarray(xs)[:, None], n, axis=1).astype(dtype)
    u = jnp.asarray(xs)[:, None] - p.astype(jnp.float32)  # p + u == x exactly
    opt = fmp.optax.stochastic_round(seed=3)
    upd, _ = jax.jit(opt.update)(u, opt.init(p), p)
    new = np.asarray(optax.apply_updates(p, upd), np.float64)
    lo, hi = _neighbours(xs, dtype)
    for row, x, a, b in zip(new, xs, lo, hi, strict=True):
        assert set(np.unique(row)) == {a, b}
        se = row.std() / np.sqrt(n)
        assert abs(row.mean() - x) < 4 * se, (row.mean(), x, se)


def test_key_advances_replays_and_float32_passes_through():
    params = {"w": jnp.ones(64, jnp.bfloat16), "b": jnp.ones(3, jnp.float32)}
    grads = {"w": jnp.full(64, 1e-3, jnp.float32), "b": jnp.full(3, 1e-3, jnp.float32)}

    opt = fmp.optax.stochastic_round()
    step = jax.jit(opt.update)

    def run(seed, steps=3):
        state, p, keys = fmp.optax.stochastic_round(seed=seed).init(params), params, []
        for _ in range(steps):
            u, new = step(grads, state, p)
            jax.lax.cond(True, lambda: state, lambda: new)  # noqa: B023 (structure and dtypes did not drift)
            state, p = new, optax.apply_updates(p, u)
            keys.append(np.asarray(state.key).tobytes())
        return p, keys

    p0, k0 = run(0)
    p0b, k0b = run(0)
    p1, _ = run(1)
    assert step._cache_size() == 1  # no recompile: the seed lives in the state
    assert len(set(k0)) == 3 and k0 == k0b and bits(p0) == bits(p0b)
    assert bits(p0["w"]) != bits(p1["w"])
    assert np.asarray(p0["b"]).tolist() == pytest.approx([1.003] * 3, rel=1e-6)


def test_vmap_over_a_batch_of_runs():
    opt = fmp.optax.stochastic_round()
    p = jnp.ones((4, 256), jnp.bfloat16)
    states = jax.vmap(lambda k: fmp.optax.StochasticRoundState(k))(jax.random.split(jax.random.PRNGKey(0), 4))
    upd, new = jax.jit(jax.vmap(opt.update))(jnp.full((4, 256), 1e-3, jnp.float32), states, p)
    out = np.asarray(optax.apply_updates(p, upd), np.float32)
    assert new.key.shape == (4, 2) and len({r.tobytes() for r in out}) == 4  # each run its own bits
    assert 1.0 < out.mean() < 1.002


@pytest.mark.parametrize("repair", [fmp.optax.stochastic_round, fmp.optax.kahan])
def test_skipped_step_rounds_nothing_inside_loss_scaled_and_accumulate(repair):
    params = {"w": jnp.array([1.0, -0.0, 3.0], jnp.bfloat16), "b": jnp.ones(2)}
    good = {"w": jnp.full(3, 4e-3, jnp.bfloat16), "b": jnp.ones(2)}
    bad = {"w": jnp.array([jnp.inf, 0.0, 1.0], jnp.bfloat16), "b": jnp.ones(2)}
    opt = fmp.optax.loss_scaled(optax.chain(optax.sgd(0.5), repair()), fmp.GradScaler(init_scale=4.0))
    step = jax.jit(opt.update)
    _, state = step(good, opt.init(params), params)
    upd, new = step(bad, state, params)
    assert int(new.skipped_steps) == 1
    assert bits(optax.apply_updates(params, upd)) == bits(params) and bits(new.inner_state) == bits(state.inner_state)
    acc = fmp.optax.accumulate(optax.chain(optax.sgd(0.5), repair()), 2)
    s0 = acc.init(params)
    upd, s1 = jax.jit(acc.update)(good, s0, params)  # a micro-step
    assert bits(optax.apply_updates(params, upd)) == bits(params) and bits(s1.inner_state) == bits(s0.inner_state)


def test_outside_loss_scaled_a_skipped_step_keeps_params_and_advances_the_key():
    params = jnp.array([1.0, -0.0, 0.0, 3.0], jnp.bfloat16)
    opt = optax.chain(fmp.optax.loss_scaled(optax.sgd(0.5)), fmp.optax.stochastic_round())
    state = opt.init(params)
    upd, new = jax.jit(opt.update)(jnp.full(4, jnp.nan, jnp.bfloat16), state, params)
    assert bits(optax.apply_updates(params, upd)) == bits(params)
    assert bits(new[1].key) != bits(state[1].key)


@pytest.mark.parametrize("dtype", LOW)
def test_kahan_accumulates_updates_below_half_an_ulp(dtype):
    params = {"w": jnp.ones(4, dtype), "b": jnp.ones(1)}
    opt = optax.chain(optax.sgd(1.0), fmp.optax.kahan())
    state = opt.init(params)
    assert state[1].compensation["b"] is None and state[1].compensation["w"].dtype == dtype
    grads = {"w": jnp.full(4, -1e-4, jnp.float32), "b": jnp.zeros(1)}

    def body(carry, _):
        p, s = carry
        u, s = opt.update(grads, s, p)
        return (optax.apply_updates(p, u), s), None

    (p, s), _ = jax.jit(lambda c: jax.lax.scan(body, c, None, length=500))((params, state))
    w = np.asarray(p["w"], np.float32)
    ulp = float(jnp.finfo(dtype).eps)  # the spacing at 1.0; round-to-nearest would stay at 1.0
    assert np.all(np.abs(w - 1.05) <= ulp), w
    assert s[1].compensation["w"].dtype == dtype


def test_checks_and_messages():
    with pytest.raises(TypeError, match="seed must be an int"):
        fmp.optax.stochastic_round(seed=0.5)
    opt = fmp.optax.kahan()
    with pytest.raises(ValueError, match="kahan needs the current params"):
        opt.update(jnp.ones(2), opt.init(jnp.ones(2, jnp.bfloat16)))
    with pytest.raises(TypeError, match="KahanState"):
        opt.update(jnp.ones(2), fmp.optax.stochastic_round().init(None), jnp.ones(2, jnp.bfloat16))


def test_sharded_params_draw_their_own_bits_without_a_gather():
    out = run_with_devices(
        """
        import jax, jax.numpy as jnp, numpy as np, optax
        import fmp.optax
        from jax.sharding import NamedSharding, PartitionSpec as P
        mesh = jax.make_mesh((8,), ("d",))
        sh = NamedSharding(mesh, P("d"))
        p = jnp.ones((8, 1024), jnp.bfloat16)
        g = jnp.full((8, 1024), 1e-3, jnp.float32)
        opt = fmp.optax.stochastic_round(seed=0)
        step = jax.jit(lambda g, s, p: optax.apply_updates(p, opt.update(g, s, p)[0]))
        hlo = step.lower(jax.device_put(g, sh), opt.init(p), jax.device_put(p, sh)).compile().as_text()
        out = step(jax.device_put(g, sh), opt.init(p), jax.device_put(p, sh))
        ref = jax.jit(lambda g, s, p: optax.apply_updates(p, opt.update(g, s, p)[0]))(g, opt.init(p), p)
        rows = {np.asarray(r).tobytes() for r in out}
        print("gather" in hlo, out.sharding.is_equivalent_to(sh, 2), bool((out == ref).all()), len(rows))
        """
    )
    assert out.split() == ["False", "True", "True", "8"], out


@optax_not_strict
def test_minibatch_adam_with_bfloat16_params_needs_a_repair():
    def run(kind, steps=300, d=16, n=512, batch=32):
        kx, kw, kn, kb = jax.random.split(jax.random.PRNGKey(0), 4)
        x = jax.random.normal(kx, (n, d))
        y = x @ (3.0 + jax.random.normal(kw, (d,))) + 0.2 * jax.random.normal(kn, (n,))
        adam = optax.adam(optax.cosine_decay_schedule(0.1, steps, alpha=0.02))
        wide = fmp.optax.state_dtypes(adam, mu="float32", nu="float32")
        opt = {
            "float32": adam,
            "bfloat16": adam,
            "stochastic": optax.chain(wide, fmp.optax.stochastic_round()),
            "kahan": optax.chain(wide, fmp.optax.kahan()),
        }[kind]
        params = jnp.zeros(d, jnp.float32 if kind == "float32" else jnp.bfloat16)

        def loss(p, xb, yb):
            return jnp.mean((xb @ p.astype(jnp.float32) - yb) ** 2)

        def body(carry, i):
            p, s = carry
            u, s = opt.update(jax.grad(loss)(p, x[i], y[i]), s, p)
            return (optax.apply_updates(p, u), s), None

        idx = jax.random.randint(kb, (steps, batch), 0, n)
        (p, _), _ = jax.jit(lambda c: jax.lax.scan(body, c, idx))((params, opt.init(params)))
        return float(loss(p, x, y))

    ref = run("float32")
    ratios = {k: run(k) / ref for k in ("bfloat16", "stochastic", "kahan")}
    assert ratios["bfloat16"] > 2.0 and ratios["stochastic"] < 1.2 and ratios["kahan"] < 1.2, ratios


def test_composes_with_float8_step():
    def f(w, x):
        return x @ w

    w, x = jnp.ones((4, 2), jnp.bfloat16), jnp.ones((3, 4), jnp.bfloat16)
    policy = "p=bf16,c=bf16,o=f32,float8=delayed"
    fp8 = fmp.float8_state(f, policy)(w, x)

    def loss(w, fp8):
        return fmp.autocast(f, policy, float8_state=fp8)(w, x).astype(jnp.float32).sum()

    opt = optax.chain(optax.sgd(1e-3), fmp.optax.stochastic_round())
    state = opt.init(w)
    step = jax.jit(lambda w, state, fp8: fmp.optax.float8_step(opt, jax.grad(loss, (0, 1))(w, fp8), state, w, fp8))
    for _ in range(3):  # 3 steps of -3e-3, under half of bfloat16's spacing at 1.0
        w, state, fp8 = step(w, state, fp8)
    assert w.dtype == jnp.bfloat16 and float(jnp.mean(w.astype(jnp.float32))) < 0.997  # expected 0.991
