"""Float8 recipes against a plain quantise/dequantise float32 reference: forward, both backward products,
saturation, all-zero and tiny tensors."""

from __future__ import annotations

import dataclasses
import functools
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fmp
from fmp._float8 import _quant
from fmp._float8._dot import float8_dot_general
from fmp._float8._state import delayed_dot_general

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
F32 = jnp.float32
DN = (((1,), (0,)), ((), ()))
HI = jax.lax.Precision.HIGHEST


# --- the reference: plain NumPy quantise/dequantise in float32, one block at a time ---------------------------------
def _ref_qdq_blocks(x, dtype, pow2, rows, cols):
    """Quantise-dequantise x[R, C] with one scale per (rows x cols) block (NumPy, float32)."""
    x = np.asarray(x, np.float32)
    r, c = x.shape
    pr, pc = -r % rows, -c % cols
    xp = np.pad(x, ((0, pr), (0, pc))).reshape((r + pr) // rows, rows, (c + pc) // cols, cols)
    amax = np.abs(xp).max(axis=(1, 3), keepdims=True)
    top = np.float32(jnp.finfo(dtype).max)
    with np.errstate(divide="ignore"):
        s = np.where(amax > 0, top / np.where(amax > 0, amax, 1), 1).astype(np.float32)
    if pow2:
        s = np.ldexp(np.float32(1), np.frexp(s)[1] - 1).astype(np.float32)
    q = np.clip(xp * s, -top, top).astype(jnp.dtype(dtype)).astype(np.float32)
    return (q * (np.float32(1) / s)).reshape(r + pr, c + pc)[:r, :c]


def ref_first(x, dtype, scaling, pow2=False, block=128):
    """First operand x[m, k] of a product (contraction k)."""
    m, k = x.shape
    rows, cols = {"tensorwise": (m, k), "rowwise": (1, k), "blockwise": (1, block)}[scaling]
    return jnp.asarray(_ref_qdq_blocks(x, dtype, pow2, rows, cols))


def ref_second(x, dtype, scaling, pow2=False, block=128, grad=False):
    """Second operand x[k, n] of a product (contraction k); a gradient gets block x 1 tiles, a weight blocks."""
    k, n = x.shape
    rows, cols = {"tensorwise": (k, n), "rowwise": (k, 1), "blockwise": (block, 1 if grad else block)}[scaling]
    return jnp.asarray(_ref_qdq_blocks(x, dtype, pow2, rows, cols))


def ref_dot(x, w, g, scaling, pow2=False):
    """Forward x @ w and the two backward products g @ w^T, x^T @ g, quantised as the recipe says."""
    out = jnp.dot(ref_first(x, E4M3, scaling, pow2), ref_second(w, E4M3, scaling, pow2), precision=HI)
    dx = jnp.dot(ref_first(g, E5M2, scaling, pow2), ref_second(w.T, E4M3, scaling, pow2), precision=HI)
    dw = jnp.dot(ref_first(x.T, E4M3, scaling, pow2), ref_second(g, E5M2, scaling, pow2, grad=True), precision=HI)
    return out, dx, dw


@functools.partial(jax.jit, static_argnums=(3, 4))
def lib_dot(x, w, g, scaling, pow2=False):
    recipe = fmp.Float8Recipe(scaling, pow2_scales=pow2)
    out, vjp = jax.vjp(lambda a, b: float8_dot_general(a, b, DN, recipe, F32), x, w)
    return (out, *vjp(g))


def _data(m=24, k=300, n=160, seed=0):
    kx, kw, kg = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(kx, (m, k), F32) * jnp.exp(jax.random.normal(kx, (m, 1), F32))  # rows of unequal size
    w = jax.random.normal(kw, (k, n), F32) * 0.05
    g = jax.random.normal(kg, (m, n), F32) * 1e-3
    return x, w, g


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("pow2", [False, True])
def test_recipe_matches_quantise_dequantise_reference(scaling, pow2):
    x, w, g = _data()
    got = lib_dot(x, w, g, scaling, pow2)
    want = ref_dot(x, w, g, scaling, pow2)
    for name, a, b in zip(("forward", "dlhs", "drhs"), got, want, strict=True):
        assert a.dtype == F32 and a.shape == b.shape
        # the same float32 arithmetic on CPU (jitted library vs eager reference): bit for bit
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_recipes_are_close_to_float32_and_finer_is_closer():
    x, w, g = _data(seed=1)
    exact = (x @ w, g @ w.T, x.T @ g)
    errs = {}
    for scaling in ("tensorwise", "rowwise", "blockwise"):
        got = lib_dot(x, w, g, scaling)
        errs[scaling] = [float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) for a, b in zip(got, exact, strict=True)]
        assert max(errs[scaling]) < 0.1, (scaling, errs[scaling])
    # x's rows differ in size by e^N(0,1): one scale per row (or per tile) quantises them better than one per tensor
    assert errs["rowwise"][0] < errs["tensorwise"][0]
    assert errs["blockwise"][0] < errs["tensorwise"][0]


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_quantisation_traces_as_primitives_without_nested_calls(scaling):
    # every float8 matmul traces its operands' quantisation; jnp's functions would each add a traced call
    x, h = jnp.ones((1, 4, 8)), jnp.ones((3, 16))
    recipe = fmp.Float8Recipe("delayed", margin=1)
    progs = [
        lambda x, h: _quant.qdq_first(x, E4M3, scaling, 128, True),
        lambda x, h: _quant.qdq_second(x, E5M2, scaling, 128, False, tiles=True),
        lambda x, h: delayed_dot_general(x[0], x[0].T, (((1,), (0,)), ((), ())), h, recipe, jnp.bfloat16),
    ]
    for prog in progs:
        eqns = jax.make_jaxpr(prog)(x, h).jaxpr.eqns
        eqns = [e for e in eqns if e.primitive.name != "custom_vjp_call"] + [
            b for e in eqns if e.primitive.name == "custom_vjp_call" for b in e.params["call_jaxpr"].jaxpr.eqns
        ]
        assert eqns and not [e.params["name"] for e in eqns if e.primitive.name in ("jit", "pjit")]


def test_saturating_cast_and_scales():
    assert float(_quant.quantize(jnp.array([1e9], F32), jnp.float32(1), E4M3).astype(F32)[0]) == 448.0
    assert float(_quant.quantize(jnp.array([-1e9], F32), jnp.float32(1), E5M2).astype(F32)[0]) == -57344.0
    assert float(jnp.array([1e9], F32).astype(E4M3).astype(F32)[0]) != 448.0  # the plain cast would not saturate
    s = _quant.scale_from_amax(jnp.array([0.0, 1e-37, 2.0, jnp.inf, jnp.nan], F32), E4M3)  # 448/1e-37: inf
    np.testing.assert_array_equal(np.asarray(s), np.array([1, 2.0**126, 224, np.nan, np.nan], np.float32))


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("pow2", [False, True])
def test_all_zero_and_tiny_tensors_give_no_nan(scaling, pow2):
    x, w, g = _data()  # the shapes of the tests above: the jitted products are reused
    for xx, ww, gg in ((x * 0, w, g), (x, w * 0, g * 0), (x * 1e-42, w, g * 1e-42)):
        out, dx, dw = lib_dot(xx, ww, gg, scaling, pow2)
        for a in (out, dx, dw):
            assert np.isfinite(np.asarray(a)).all()
    out, dx, dw = lib_dot(x * 0, w, g * 0, scaling, pow2)
    assert not np.asarray(out).any() and not np.asarray(dw).any()
    # a tensor far below float8's range is scaled up into it (scale 2**126, whose inverse is still normal)
    out, _, _ = lib_dot(x * 1e-37, w * 1e3, g, scaling, pow2)
    ref = np.asarray(x @ w, np.float64) * 1e-34
    assert np.asarray(out).any() and np.allclose(np.asarray(out), ref, rtol=0.1, atol=0.1 * np.abs(ref).max())


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("margin", [0, 3, 64])
def test_power_of_two_scales_are_normal_powers_of_two_at_most_the_exact_scale(dtype, margin):
    amax = jnp.asarray([0, 1e-45, 1e-37, 1e-20, 0.3, 1, 2, 448, 5e4, 1e30, 3.4e38, jnp.inf, -jnp.inf, jnp.nan], F32)
    for wrap in (lambda f: f, jax.jit):  # eager and jitted (XLA CPU may treat the subnormal 1e-45 as 0 in one)
        s = np.asarray(wrap(lambda a: _quant.scale_from_amax(a, dtype, pow2=True, margin=margin))(amax), np.float64)
        exact = np.asarray(wrap(lambda a: _quant.scale_from_amax(a, dtype, margin=margin))(amax), np.float64)
        assert np.isnan(s[11:]).all() and np.isnan(exact[11:]).all()  # a non-finite amax is never saturated away
        s, exact = s[:11], exact[:11]
        mant, _ = np.frexp(s)
        assert (mant == 0.5).all(), s  # powers of two
        assert (s >= 2.0**-126).all() and (s <= 2.0**126).all() and (1 / s >= 2.0**-126).all()
        assert (s <= exact).all() and (s > exact / 2).all()
        assert s[0] == 2.0**-margin  # zero amax: scale 1 (before the margin)


def test_gradient_is_quantised_to_e5m2_not_e4m3():
    # a gradient whose values differ in the 3rd mantissa bit: e4m3 keeps them, e5m2 (2 bits) rounds them
    x, w = jnp.eye(4, dtype=F32), jnp.eye(4, dtype=F32)
    g = jnp.full((4, 4), 1.125, F32).at[0, 0].set(448.0)
    _, dx, _ = lib_dot(x, w, g, "tensorwise", True)
    e5 = ref_first(g, E5M2, "tensorwise", True)
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(e5))
    assert not np.array_equal(np.asarray(dx), np.asarray(ref_first(g, E4M3, "tensorwise", True)))


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "blockwise", "delayed", "mx"])
def test_power_of_two_scales_by_default(scaling):
    assert fmp.Float8Recipe(scaling).pow2_scales is True
    assert fmp.get_policy(f"p=f32,c=bf16,o=f32,float8={scaling}").float8.pow2_scales is True
    assert fmp.get_policy("mixed_float8").float8.pow2_scales is True
    assert fmp.Float8Recipe(scaling, pow2_scales=False).pow2_scales is False
    with pytest.raises(ValueError, match="pow2_scales"):
        fmp.Float8Recipe(scaling, pow2_scales=1)


def test_power_of_two_scales_keep_exact_values_exact():
    # digits-like pixels k/16 and a one-hot row: float8 holds each exactly, and a power-of-two scale keeps them so;
    # the scale 448/amax (28 * 16 for amax 1) does not: 9/16 * 448 = 252 has no e4m3 value
    x = jnp.asarray(np.random.default_rng(0).integers(0, 17, (8, 64)) / 16, F32).at[0].set(jax.nn.one_hot(3, 64))
    w = jnp.eye(64, dtype=F32)
    for scaling in ("tensorwise", "rowwise", "blockwise"):
        exact = float8_dot_general(x, w, DN, fmp.Float8Recipe(scaling), F32)
        np.testing.assert_array_equal(np.asarray(exact), np.asarray(x))
        rounded = float8_dot_general(x, w, DN, fmp.Float8Recipe(scaling, pow2_scales=False), F32)
        assert not np.array_equal(np.asarray(rounded), np.asarray(x))


def test_general_dimension_numbers_match_einsum_reference():
    # batch dims and two contracting dims in unusual positions: canonicalisation must not scramble rows
    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    lhs = jax.random.normal(k1, (3, 5, 2, 4), F32)  # (k1, m, b, k2)
    rhs = jax.random.normal(k2, (2, 4, 6, 3), F32)  # (b, k2, n, k1)
    dn = (((0, 3), (3, 1)), ((2,), (0,)))
    recipe = fmp.Float8Recipe("tensorwise", pow2_scales=True)
    got = jax.jit(lambda a, b: float8_dot_general(a, b, dn, recipe, F32))(lhs, rhs)
    ql, qr = (
        ref_first(lhs.reshape(1, -1), E4M3, "tensorwise", True),
        ref_second(rhs.reshape(-1, 1), E4M3, "tensorwise", True),
    )
    want = jax.lax.dot_general(ql.reshape(lhs.shape), qr.reshape(rhs.shape), dn, precision=HI)
    assert got.shape == want.shape == (2, 5, 6)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_delayed_scaling_uses_history_saturates_and_reports_amax():
    x, w, g = _data(m=8, k=16, n=8)
    hist = jnp.zeros((3, 4), F32).at[0, 1].set(1.0).at[1, 2].set(0.01)  # past amaxes smaller than now: saturation
    recipe = fmp.Float8Recipe("delayed", history_len=4, pow2_scales=False)  # scales exactly 448 / amax
    fn = lambda a, b, h: delayed_dot_general(a, b, DN, h, recipe, F32)  # noqa: E731
    out, (dx, dw, new_hist) = jax.jit(lambda *a: (lambda o, v: (o, v(g)))(*jax.vjp(fn, *a)))(x, w, hist)
    sx, sw = F32(448.0), F32(448.0 / np.float32(0.01))
    qx = jnp.clip(x * sx, -448, 448).astype(E4M3).astype(F32) * (1 / sx)
    qw = jnp.clip(w * sw, -448, 448).astype(E4M3).astype(F32) * (1 / sw)
    np.testing.assert_allclose(np.asarray(out), np.asarray(jnp.dot(qx, qw, precision=HI)), rtol=0, atol=1e-6)
    assert float(jnp.max(jnp.abs(qx))) == 1.0  # saturated at the history's amax, no NaN
    np.testing.assert_array_equal(
        np.asarray(new_hist[:, 0]), np.asarray([jnp.max(jnp.abs(v)) for v in (x, w, g)], np.float32)
    )
    np.testing.assert_array_equal(np.asarray(new_hist[:, 1:]), np.asarray(hist[:, :3]))  # rolled by one step
    assert np.isfinite(np.asarray(dx)).all() and np.isfinite(np.asarray(dw)).all()


def test_float8_state_pytree_jit_pickle_and_flax_serialization():
    from flax import serialization

    st = fmp.Float8State.zeros(["a", "b"], fmp.Float8Recipe("delayed", history_len=3))
    st = jax.jit(lambda s: s.update(jax.tree_util.tree_map(lambda h: h + 2.0, s)))(st)
    assert st.sites == ("a", "b") and float(st.amax_history.sum()) == 2.0 * 18
    back = pickle.loads(pickle.dumps(st))
    np.testing.assert_array_equal(np.asarray(back.amax_history), np.asarray(st.amax_history))
    assert back.sites == st.sites and back.recipe == st.recipe
    fmp.Float8State.register_flax_serialization()
    blank = fmp.Float8State.zeros(["a", "b"], st.recipe)
    restored = serialization.from_bytes(blank, serialization.to_bytes(st))
    np.testing.assert_array_equal(np.asarray(restored.amax_history), np.asarray(st.amax_history))
    chosen = jax.lax.cond(True, lambda: st, lambda: blank)
    assert jax.tree_util.tree_structure(chosen) == jax.tree_util.tree_structure(st)
    np.testing.assert_array_equal(np.asarray(st.scales())[:, :2], np.full((2, 2), 128.0, np.float32))  # 448/2 -> 2**7
    exact = dataclasses.replace(st, recipe=fmp.Float8Recipe("delayed", history_len=3, pow2_scales=False))
    np.testing.assert_array_equal(np.asarray(exact.scales())[:, :2], np.full((2, 2), 224.0, np.float32))


def test_float8_state_keeps_its_history_on_a_non_finite_step():
    st = fmp.Float8State.zeros(["a", "b"], fmp.Float8Recipe("delayed", history_len=3))
    st = st.update(jax.tree_util.tree_map(lambda h: h + 2.0, st))
    bad = jax.tree_util.tree_map(lambda h: h.at[0, 2, 0].set(jnp.inf).at[1].set(5.0), st)
    out = jax.jit(lambda s, g: s.update(g))(st, bad)
    np.testing.assert_array_equal(np.asarray(out.amax_history[0]), np.asarray(st.amax_history[0]))  # kept
    np.testing.assert_array_equal(np.asarray(out.amax_history[1]), np.full((3, 3), 5.0, np.float32))  # taken
    assert np.isfinite(np.asarray(out.scales())).all()


def test_float8_state_orbax_round_trip(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint", reason="orbax is not installed")
    st = fmp.Float8State.zeros(["a"], fmp.Float8Recipe("delayed", history_len=2))
    st = st.update(jax.tree_util.tree_map(lambda h: h + 3.0, st))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "fp8", st)
        ckptr.wait_until_finished()
        back = ckptr.restore(tmp_path / "fp8", fmp.Float8State.zeros(["a"], st.recipe))
    np.testing.assert_array_equal(np.asarray(back.amax_history), np.asarray(st.amax_history))


def test_mx_recipe_with_emulate_false_has_a_clear_error_off_gpu():
    if jax.default_backend() == "gpu":
        pytest.skip("this checks the error raised where scaled_dot_general has no lowering; running on a GPU")
    from fmp._float8._block_dot import block_dot_general

    with pytest.raises(ValueError, match="scaled_dot_general.*no lowering"):
        block_dot_general(jnp.ones((2, 32)), jnp.ones((32, 2)), DN, fmp.Float8Recipe("mx", emulate=False), F32)


def test_quantisation_is_traced_once_per_shape_not_once_per_matmul(monkeypatch):
    calls = []
    scales = _quant.row_scales  # called once per traced product for its first operand
    monkeypatch.setattr(
        _quant, "row_scales", lambda *a, **k: (calls.append(1) if k["first"] else None) or scales(*a, **k)
    )

    def stack(ws, x):  # four layers of the same shape
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.sum(x.astype(jnp.float32))

    ws = [jnp.eye(19) * (i + 1) for i in range(4)]  # shapes no other test uses: JAX's cache starts cold
    x = jnp.ones((5, 19))
    got = jax.jit(jax.value_and_grad(fmp.autocast(stack, "mixed_float8")))(ws, x)
    # once per shape and dtype (the first layer's float32 input is a dtype of its own): 5 here, and 12 when
    # the quantisation's ops were traced for every matmul
    assert len(calls) <= 6
    plain = jax.value_and_grad(stack)(ws, x)
    np.testing.assert_allclose(got[0], plain[0], rtol=0.1)
