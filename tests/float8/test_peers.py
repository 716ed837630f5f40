"""The peers' named float8 recipes (``fmp.Float8Recipe.from_peer``) against the peers' own code: torchao 0.18's
emulated ``Float8Linear`` bit for bit, Transformer Engine's ``DelayedScaling`` scale formula; the gradient format
option ``grad_dtype``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fmp
from fmp._float8 import _quant
from fmp._float8._dot import float8_dot_general
from fmp._float8._state import delayed_dot_general

F32 = jnp.float32
HI = jax.lax.Precision.HIGHEST
LINEAR = (((1,), (1,)), ((), ()))  # x[m, k] @ w[n, k].T, as torch.nn.Linear


# --- grad_dtype ------------------------------------------------------------------------------------------------------
def _qdq(x, dtype, pow2=True):
    s = _quant.scale_from_amax(jnp.max(jnp.abs(x)), dtype, pow2=pow2)
    return _quant.dequantize(_quant.quantize(x, s, dtype), s)


@pytest.mark.parametrize("grad_dtype", ["float8_e5m2", "float8_e4m3fn"])
def test_grad_dtype_quantises_the_output_gradient_of_both_products(grad_dtype):
    x, w, g = (jax.random.normal(jax.random.key(i), s, F32) for i, s in enumerate([(8, 16), (16, 8), (8, 8)]))
    recipe = fmp.Float8Recipe("tensorwise", grad_dtype=grad_dtype)
    f = lambda a, b: float8_dot_general(a, b, (((1,), (0,)), ((), ())), recipe, F32)  # noqa: E731
    _, vjp = jax.vjp(f, x, w)
    dx, dw = vjp(g)
    qg = _qdq(g, jnp.dtype(grad_dtype))
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(jnp.dot(qg, _qdq(w, _quant.E4M3).T, precision=HI)))
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(jnp.dot(_qdq(x, _quant.E4M3).T, qg, precision=HI)))


def test_grad_dtype_reaches_convolutions_and_delayed_scaling():
    x, w = jax.random.normal(jax.random.key(0), (1, 1, 8, 8), F32), jax.random.normal(jax.random.key(1), (2, 1, 3, 3))
    conv = lambda a, b: jax.lax.conv(a, b, (1, 1), "SAME")  # noqa: E731
    grads = {}
    for gd in ("float8_e5m2", "float8_e4m3fn"):
        policy = fmp.Policy("f32", "bf16", "f32", float8=fmp.Float8Recipe(grad_dtype=gd))
        grads[gd] = jax.grad(lambda a, b, p=policy: jnp.sum(fmp.autocast(conv, p)(a, b) ** 2))(x, w)
    assert not np.array_equal(np.asarray(grads["float8_e5m2"]), np.asarray(grads["float8_e4m3fn"]))
    st = fmp.Float8State.zeros(["a"], fmp.Float8Recipe("delayed", history_len=2, grad_dtype="float8_e4m3fn"))
    st = dataclasses.replace(st, amax_history=st.amax_history.at[0, :, 0].set(448.0))
    np.testing.assert_array_equal(np.asarray(st.scales()), [[1.0, 1.0, 1.0]])  # 448 / 448: an e4m3 gradient


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"grad_dtype": "bfloat16"}, ["grad_dtype", "'float8_e5m2', 'float8_e4m3fn'", "'bfloat16'"]),
        ({"grad_dtype": jnp.float16}, ["grad_dtype", "'float16'"]),
        ({"amax_compute_algo": "mean"}, ["amax_compute_algo", "'max' or 'most_recent'", "'mean'"]),
    ],
)
def test_recipe_refuses_an_unknown_grad_dtype_or_amax_algo_naming_the_choices(kwargs, words):
    with pytest.raises(ValueError) as err:
        fmp.Float8Recipe(**kwargs)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_from_peer_names_and_overrides():
    assert fmp.Float8Recipe.PEERS == ("torchao_tensorwise", "torchao_rowwise", "te_delayed")
    assert fmp.Float8Recipe.from_peer("torchao_tensorwise") == fmp.Float8Recipe("tensorwise", pow2_scales=False)
    assert fmp.Float8Recipe.from_peer("torchao_rowwise") == fmp.Float8Recipe("rowwise", grad_dtype=jnp.float8_e4m3fn)
    te = fmp.Float8Recipe.from_peer("TE_delayed", amax_compute_algo="most_recent")
    assert (te.scaling, te.history_len, te.pow2_scales, te.margin) == ("delayed", 1024, False, 0)
    assert (te.amax_compute_algo, te.grad_dtype) == ("most_recent", "float8_e5m2")
    with pytest.raises(ValueError, match="'torchao_tensorwise', 'torchao_rowwise', 'te_delayed', got 'te'"):
        fmp.Float8Recipe.from_peer("te")


# --- torchao 0.18, emulate mode --------------------------------------------------------------------------------------
def _data(seed, m=16, k=32, n=24):
    """x[m, k], w[n, k], g[m, n]: random signs and magnitudes in [1, 2) times a non-power-of-two factor per row
    (so each row gets its own scale); the factors keep every float32 sum of dequantised products exact (checked by
    ``_order_free``), so that torch's and XLA's different summation orders cannot tell the two sides apart."""
    rng = np.random.default_rng(seed)

    def draw(r, c, lo, hi):
        mag = rng.uniform(1, 2, (r, c)) * rng.uniform(lo, hi, (r, 1))
        return (mag * rng.choice([-1.0, 1.0], (r, c))).astype(np.float32)

    return draw(m, k, 0.3, 5.0), draw(n, k, 0.05, 0.2), draw(m, n, 0.5, 3.0)


def _order_free(a, b):
    """Every summation order of ``a @ b`` gives the exact result in float32: all products are multiples of 2**e
    and the sum of their magnitudes is below 2**(e + 24)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    lsb = lambda v: np.where(v != 0, np.frexp(v)[1] - 1 - 3, 10**6)  # noqa: E731  (float8 values: 4 significant bits)
    e = np.min(lsb(a)) + np.min(lsb(b))
    return float(np.max(np.abs(a) @ np.abs(b))) < 2.0 ** (e + 24)


def _torchao_linear(name, x, w, g, dtype):
    torch = pytest.importorskip("torch", reason="the torchao comparison needs torch (the torch extra)")
    pytest.importorskip("torchao", reason="torchao is not installed: pip install 'torchao==0.18.*' (the dev extra)")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(name), emulate=True)
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    x, w, g = (torch.from_numpy(np.array(v, np.float32)) for v in (x, w, g))  # writable float32 copies
    lin = torch.nn.Sequential(torch.nn.Linear(x.shape[1], w.shape[0], bias=False))
    with torch.no_grad():
        lin[0].weight.copy_(w)
    model = convert_to_float8_training(lin.to(tdt), config=config)
    xt = x.to(tdt).requires_grad_()
    y = model(xt)
    y.backward(g.to(tdt))
    to_np = lambda t: t.detach().float().numpy()  # noqa: E731
    return to_np(y), to_np(xt.grad), to_np(model[0].weight.grad)


def _fmp_linear(recipe, x, w, g, dtype):
    """fmp's float8 ``x @ w.T`` through autocast: float32 inputs and results, or bfloat16 ones."""
    if dtype == "float32":
        policy = fmp.Policy("f32", "bf16", "f32", float8=dataclasses.replace(recipe, output="float32"))
    else:
        policy = fmp.Policy("bf16", "bf16", "bf16", float8=recipe)
    args = (jnp.asarray(x, dtype), jnp.asarray(w, dtype))
    y, vjp = jax.vjp(fmp.autocast(lambda a, b: a @ b.T, policy), *args)
    dx, dw = vjp(jnp.asarray(g, dtype))
    assert y.dtype == dx.dtype == dw.dtype == jnp.dtype(dtype)
    return tuple(np.asarray(v.astype(F32)) for v in (y, dx, dw))


def _bf16_exact(*arrays):
    return tuple(np.asarray(jnp.asarray(v, jnp.bfloat16).astype(F32)) for v in arrays)


@pytest.mark.parametrize(("seed", "dtype"), [(0, "float32"), (1, "float32"), (0, "bfloat16")])
def test_torchao_rowwise_equals_torchao_bit_for_bit(seed, dtype):
    x, w, g = _data(seed) if dtype == "float32" else _bf16_exact(*_data(seed))
    ours = _fmp_linear(fmp.Float8Recipe.from_peer("torchao_rowwise"), x, w, g, dtype)
    theirs = _torchao_linear("rowwise", x, w, g, dtype)
    for name, a, b in zip(("forward", "dx", "dw"), ours, theirs, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)
    # with e5m2 gradients (fmp's default) the backward differs: the gradient format is what the option changes
    e5m2 = _fmp_linear(fmp.Float8Recipe("rowwise"), x, w, g, dtype)
    assert not np.array_equal(e5m2[2], theirs[2])


def test_torchao_comparison_data_make_summation_order_irrelevant():
    x, w, g = _data(0)
    recipe = fmp.Float8Recipe.from_peer("torchao_rowwise")
    qx, qw = (np.asarray(_quant.qdq_first(jnp.asarray(v)[None], _quant.E4M3, "rowwise", 128, True)[0]) for v in (x, w))
    assert _order_free(qx, qw.T)
    qg_rows = np.asarray(_quant.qdq_first(jnp.asarray(g)[None], jnp.dtype(recipe.grad_dtype), "rowwise", 128, True)[0])
    assert _order_free(qg_rows, qw)  # dx's operands (w quantised per column: same magnitudes)


def _pow2_amax(x, amax):
    """``x`` rescaled so that its amax is exactly ``amax`` (``fp8_max / amax`` then is a power of two)."""
    return (x / np.max(np.abs(x)) * np.float32(amax)).astype(np.float32)


def test_torchao_tensorwise_equals_torchao_bit_for_bit():
    x, w, g = _data(2)
    # amaxes whose exact scale fp8_max / amax is a power of two: dividing by it (torchao) and multiplying by its
    # inverse (fmp) agree, as do all summation orders; the quantisation itself is compared on any data below
    x, w, g = _pow2_amax(x, 3.5), _pow2_amax(w, 0.875), _pow2_amax(g, 7.0)  # 448/128, 448/512, 57344/8192
    ours = _fmp_linear(fmp.Float8Recipe.from_peer("torchao_tensorwise"), x, w, g, "float32")
    theirs = _torchao_linear("tensorwise", x, w, g, "float32")
    for name, a, b in zip(("forward", "dx", "dw"), ours, theirs, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_torchao_exact_scale_quantisation_equals_torchao_bit_for_bit(dtype):
    torch = pytest.importorskip("torch", reason="the torchao comparison needs torch (the torch extra)")
    pytest.importorskip("torchao", reason="torchao is not installed: pip install 'torchao==0.18.*' (the dev extra)")
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    x = np.random.default_rng(3).standard_normal((64, 48)).astype(np.float32) * 3.3
    t = hp_tensor_to_float8_dynamic(torch.from_numpy(x), getattr(torch, dtype), LinearMMConfig())
    s = _quant.scale_from_amax(jnp.max(jnp.abs(jnp.asarray(x))), dtype)
    q = _quant.quantize(jnp.asarray(x), s, dtype)
    assert np.float32(s) == t._scale.item() and np.float32(s) != np.exp2(np.floor(np.log2(np.float32(s))))
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), t._data.view(torch.uint8).numpy())


def test_torchao_tensorwise_on_any_data_differs_only_by_dequantisation_and_summation_order():
    x, w, g = (v * np.float32(1.37) for v in _data(4))  # exact scales that are not powers of two
    ours = _fmp_linear(fmp.Float8Recipe.from_peer("torchao_tensorwise"), x, w, g, "float32")
    theirs = _torchao_linear("tensorwise", x, w, g, "float32")
    for name, a, b in zip(("forward", "dx", "dw"), ours, theirs, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.max(np.abs(b)), err_msg=name)  # a few float32 ulps
        assert not np.array_equal(a, b)  # when this fails, the two have become equal: make the test bit for bit


# --- Transformer Engine DelayedScaling: scale = fp8_max / amax / 2**margin, amax from the history ------------------
def _te_scale(history, fp8_max, margin, algo):
    """TE's delayed scale from the amaxes of past steps (newest first), by its documented formula; the first step
    (no history yet) is fmp's current scaling, where TE starts from scale 1."""
    amax = np.float32(history[0] if algo == "most_recent" else max(history))
    return np.float32(np.float32(fp8_max) / amax / np.float32(2.0**margin))


@pytest.mark.parametrize(("algo", "margin"), [("max", 0), ("most_recent", 0), ("max", 1)])
def test_te_delayed_scales_follow_the_delayed_scaling_formula(algo, margin):
    recipe = fmp.Float8Recipe.from_peer("te_delayed", amax_compute_algo=algo, margin=margin)
    hist = jnp.zeros((3, recipe.history_len), F32)
    fn = jax.jit(lambda a, b, h: delayed_dot_general(a, b, LINEAR, h, recipe, F32))
    past = {0: [], 1: [], 2: []}
    for step, factor in enumerate([3.0, 0.4, 1.3, 0.7]):  # amaxes rise and fall: max and most_recent differ
        x, w, g = (v * np.float32(factor) for v in _data(10 + step))
        out, vjp = jax.vjp(fn, x, w, hist)
        dx, dw, hist = vjp(jnp.asarray(g))
        if step:
            sx, sw, sg = (_te_scale(past[j][::-1], m, margin, algo) for j, m in enumerate((448.0, 448.0, 57344.0)))
            qx, qw = (_quant.dequantize(_quant.quantize(v, s, _quant.E4M3), s) for v, s in ((x, sx), (w, sw)))
            qg = _quant.dequantize(_quant.quantize(g, sg, _quant.E5M2), sg)
            np.testing.assert_array_equal(np.asarray(out), np.asarray(jnp.dot(qx, qw.T, precision=HI)))
            np.testing.assert_array_equal(np.asarray(dx), np.asarray(jnp.dot(qg, qw, precision=HI)))
            np.testing.assert_array_equal(np.asarray(dw), np.asarray(jnp.dot(qg.T, qx, precision=HI)))
        for j, v in enumerate((x, w, g)):
            past[j].append(np.float32(np.max(np.abs(v))))
        np.testing.assert_array_equal(np.asarray(hist[:, 0]), [past[j][-1] for j in range(3)])


@pytest.mark.parametrize(("algo", "expected"), [("max", 448.0 / 4.0), ("most_recent", 448.0 / 2.0)])
def test_float8_state_scales_follow_amax_compute_algo(algo, expected):
    recipe = fmp.Float8Recipe("delayed", history_len=3, pow2_scales=False, amax_compute_algo=algo)
    st = fmp.Float8State.zeros(["a"], recipe)
    st = dataclasses.replace(st, amax_history=st.amax_history.at[0, 0].set(jnp.asarray([2.0, 4.0, 1.0])))
    assert float(st.scales()[0, 0]) == expected  # newest first: 2 is the last step's amax, 4 the largest
