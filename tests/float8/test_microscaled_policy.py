"""Block-scaled policies (``mixed_mxfp8``, ``mixed_mxfp4``, ``mixed_nvfp4``): the three MXFP8 products and the
NVFP4 recipe against references built from ``fmp.quantize`` (itself checked against torchao and the NVFP4
chain), the stochastic-rounding key, and training a digits MLP against bfloat16."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers.common import optax_not_strict

import fmp
from fmp._float8._block_dot import block_dot_general
from fmp._float8._nvfp4 import hadamard16, random_hadamard

F32 = jnp.float32
HI = jax.lax.Precision.HIGHEST
DN = (((1,), (0,)), ((), ()))  # x[m, k] @ w[k, n]


def qdq(x, fmt, axis, **kw):
    return fmp.quantize(x, fmt, axis=axis, **kw).dequantize()


def _operands(m=24, k=80, n=40):
    ks = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(ks[0], (m, k), F32) * jnp.exp2(jax.random.randint(ks[1], (m, 1), -4, 4)).astype(F32)
    w = jax.random.normal(ks[2], (k, n), F32) * jnp.exp2(jnp.arange(k, dtype=F32) % 5 - 6)[:, None]
    g = jax.random.normal(jax.random.key(9), (m, n), F32)
    return x, w, g


def _products(recipe, x, w, g, key=None):
    out, vjp = jax.vjp(lambda a, b: block_dot_general(a, b, DN, recipe, F32, key), x, w)
    return (out, *vjp(g))


@pytest.mark.parametrize("grad_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_the_three_mxfp8_products_quantise_along_their_own_contraction(grad_dtype):
    x, w, g = _operands()
    out, dx, dw = _products(fmp.Float8Recipe("mxfp8", grad_dtype=grad_dtype), x, w, g)
    gfmt = "mxfp8" if grad_dtype == "float8_e4m3fn" else "mxfp8_e5m2"
    np.testing.assert_array_equal(out, jnp.dot(qdq(x, "mxfp8", 1), qdq(w, "mxfp8", 0), precision=HI))
    np.testing.assert_array_equal(dx, jnp.dot(qdq(g, gfmt, 1), qdq(w, "mxfp8", 1).T, precision=HI))
    np.testing.assert_array_equal(dw, jnp.dot(qdq(x, "mxfp8", 0).T, qdq(g, gfmt, 0), precision=HI))
    # the weight is quantised twice: along k for the forward product, along n for the input gradient
    assert not np.array_equal(qdq(w, "mxfp8", 0), qdq(w, "mxfp8", 1))


def test_mxfp4_and_a_scale_rounding_mode_reach_the_products():
    x, w, g = _operands()
    out, _, _ = _products(fmp.Float8Recipe("mxfp4", scale_rounding="floor"), x, w, g)
    ref = jnp.dot(qdq(x, "mxfp4", 1, scale_rounding="floor"), qdq(w, "mxfp4", 0, scale_rounding="floor"), precision=HI)
    np.testing.assert_array_equal(out, ref)


def test_nvfp4_forward_tiles_the_weight_and_blocks_the_activation():
    x, w, g = _operands()
    out, dx, dw = _products(fmp.Float8Recipe("nvfp4"), x, w, g)
    qw = qdq(w, "nvfp4", 0, block="16x16")
    np.testing.assert_array_equal(out, jnp.dot(qdq(x, "nvfp4", 1), qw, precision=HI))
    # the input gradient reuses the same tiles (one quantisation serves the weight and its transpose)
    np.testing.assert_array_equal(dx, jnp.dot(qdq(g, "nvfp4", 1), qw.T, precision=HI))
    # the weight gradient: both inputs through the random Hadamard transform along the tokens, then 1x16
    pad = lambda v: jnp.pad(v, ((0, -v.shape[0] % 16), (0, 0)))  # noqa: E731
    hx, hg = random_hadamard(pad(x), 0), random_hadamard(pad(g), 0)
    np.testing.assert_array_equal(dw, jnp.dot(qdq(hx, "nvfp4", 0).T, qdq(hg, "nvfp4", 0), precision=HI))
    np.testing.assert_allclose(dw, x.T @ g, rtol=0.3, atol=0.3 * float(jnp.abs(x.T @ g).max()))


def test_the_hadamard_transform_is_orthogonal_with_the_transformer_engine_signs():
    h = hadamard16()
    np.testing.assert_array_equal(h @ h.T, np.eye(16, dtype=np.float32))
    assert np.array_equal(np.sign(h[:, 0]), [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1])


def test_the_weight_may_be_the_first_operand():
    x, w, _ = _operands()
    recipe = fmp.Float8Recipe("nvfp4")
    first = block_dot_general(w.T, x.T, DN, recipe, F32, weight_first=True)  # w^T @ x^T, weight on the left
    np.testing.assert_array_equal(first.T, block_dot_general(x, w, DN, recipe, F32))


# --- policies ---------------------------------------------------------------------------------------------------------
def mlp(p, x):
    h = jax.nn.gelu(x @ p["w1"])
    return jnp.mean((h @ p["w2"]) ** 2)


def _mlp_params():
    k1, k2 = jax.random.split(jax.random.key(4))
    return {"w1": jax.random.normal(k1, (64, 48), F32) * 0.1, "w2": jax.random.normal(k2, (48, 16), F32) * 0.1}


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
def test_presets_name_the_format(fmt):
    policy = fmp.get_policy(f"mixed_{fmt}")
    assert policy.float8 == fmp.Float8Recipe(fmt) and policy.compute_dtype == jnp.bfloat16
    assert fmp.get_policy(str(policy)) == policy
    assert fmp.get_policy(f"p=f32,c=bf16,o=f32,float8={fmt}") == policy
    rep = fmp.explain(mlp, policy)(_mlp_params(), jnp.ones((32, 64), F32))
    rows = [r for r in rep.records if r.category == "float8"]
    assert len(rows) == 2 and {r.detail for r in rows} == {fmt}
    elem = "float4_e2m1fn" if fmt != "mxfp8" else "float8_e4m3fn"
    assert all(r.in_after == (elem, elem) for r in rows)


def test_mx_is_mxfp8_and_runs_anywhere():
    assert fmp.Float8Recipe("mx") == fmp.Float8Recipe("mxfp8") and fmp.Float8Recipe("mx").grad_dtype == "float8_e4m3fn"
    x, w, _ = _operands()
    out = fmp.autocast(lambda a, b: a @ b, "p=f32,c=bf16,o=f32,float8=mx")(x, w)
    assert out.dtype == F32 and np.isfinite(np.asarray(out)).all()
    with pytest.raises(ValueError, match="scale_rounding"):
        fmp.Float8Recipe("mxfp8", scale_rounding="nearest")


def test_nvfp4_gradients_replay_with_the_same_key():
    p, x = _mlp_params(), jax.random.normal(jax.random.key(1), (32, 64), F32)
    grad = jax.jit(lambda p, x, k: jax.grad(fmp.autocast(mlp, "mixed_nvfp4", key=k))(p, x))
    a, b, c = grad(p, x, jax.random.key(0)), grad(p, x, jax.random.key(0)), grad(p, x, jax.random.key(1))
    np.testing.assert_array_equal(a["w1"], b["w1"])
    np.testing.assert_array_equal(a["w2"], b["w2"])
    assert not np.array_equal(a["w1"], c["w1"])
    nearest = jax.jit(jax.grad(fmp.autocast(mlp, "mixed_nvfp4")))(p, x)  # no key: gradients round to nearest
    assert not np.array_equal(a["w1"], nearest["w1"])


def test_a_key_without_an_nvfp4_recipe_warns():
    with pytest.warns(UserWarning, match="key changes nothing"):
        fmp.autocast(mlp, "mixed_mxfp8", key=jax.random.key(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fmp.autocast(mlp, "mixed_bfloat16", overrides={"x": "mixed_nvfp4"}, key=jax.random.key(0))
    with pytest.raises(TypeError, match="key"):
        fmp.autocast(mlp, "mixed_nvfp4", key=0)


# --- training -------------------------------------------------------------------------------------------------------
def _digits():
    datasets = pytest.importorskip("sklearn.datasets")
    d = datasets.load_digits()
    return jnp.asarray(d.data / 16.0, F32), jnp.asarray(d.target, jnp.int32)


def _train(policy, x, y, steps=300, batch=128):
    optax = pytest.importorskip("optax")
    sizes = [64, 128, 128, 10]
    keys = jax.random.split(jax.random.key(0), len(sizes) - 1)
    params = [
        jax.random.normal(k, (a, b), F32) / np.sqrt(a) for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]

    def loss(params, xb, yb):
        h = xb
        for w in params[:-1]:
            h = jax.nn.gelu(h @ w)
        return optax.softmax_cross_entropy_with_integer_labels(h @ params[-1], yb).mean()

    opt = optax.adam(3e-3)
    idx = jax.random.randint(jax.random.key(1), (steps, batch), 0, x.shape[0])

    def step(carry, i):
        params, state = carry
        key = jax.random.fold_in(jax.random.key(2), i) if policy == "mixed_nvfp4" else None
        grads = jax.grad(fmp.autocast(loss, policy, key=key))(params, x[idx[i]], y[idx[i]])
        updates, state = opt.update(grads, state)
        return (optax.apply_updates(params, updates), state), None

    (params, _), _ = jax.lax.scan(step, (params, opt.init(params)), jnp.arange(steps))
    return float(loss(params, x, y))  # the final loss on every digit, in float32


@pytest.mark.gallery  # three 300-step trainings, about 30 s on two CPU cores
@optax_not_strict
def test_digits_mlp_trains_in_mxfp8_and_nvfp4_close_to_bfloat16():
    x, y = _digits()
    ref = _train("mixed_bfloat16", x, y)
    mx, nv = _train("mixed_mxfp8", x, y), _train("mixed_nvfp4", x, y)
    print(f"final loss: bfloat16 {ref:.4f}, mxfp8 {mx:.4f}, nvfp4 {nv:.4f}")
    assert ref < 0.2  # it learned
    assert mx < 1.1 * ref and nv < 1.5 * ref


@pytest.mark.gallery  # six short trainings and a compared explain: about a minute on two CPU cores
def test_the_example_trains_every_policy_and_names_the_layers_it_keeps():
    import json
    import subprocess
    import sys

    from _helpers.common import ROOT

    script = ROOT / "examples" / "microscaled_training.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--steps", "5", "--no-plot", "--json"],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["run"] for r in runs][:4] == ["float32", "bfloat16", "mxfp8", "nvfp4"]
    assert all(np.isfinite(r["final"]) and r["ms_per_step"] > 0 for r in runs)
    assert all(r["kept"] for r in runs[4:])  # a "+ keep" run only where the report kept layers


# --- the precision debugger -----------------------------------------------------------------------------------------
def four_layers(p, x):
    with jax.named_scope("a"):
        h = jnp.tanh(x @ p["w1"])
    with jax.named_scope("b"):
        h = jnp.tanh(h @ p["w2"])
    with jax.named_scope("c"):  # one massive channel enters this layer's matmul
        h = jnp.tanh((h * p["gain"]) @ p["w3"])
    with jax.named_scope("d"):
        return jnp.mean((h @ p["w4"]) ** 2)


@pytest.mark.parametrize("policy", ["mixed_mxfp8", "mixed_nvfp4"])
def test_explain_measures_flushed_elements_and_saturated_scales_and_keeps_the_worst_layer(policy):
    ks = jax.random.split(jax.random.key(0), 4)
    p = {f"w{i + 1}": jax.random.normal(k, (64, 64), F32) / 8 for i, k in enumerate(ks)}
    p["gain"], p["w3"] = jnp.ones(64, F32).at[5].set(1e6), p["w3"].at[5].multiply(1e-6)
    x = jax.random.normal(jax.random.key(2), (32, 64), F32)
    rep = fmp.explain(four_layers, policy, compare=True)(p, x)
    rows = {r.scope: r for r in rep.records if r.category == "float8"}
    assert set(rows) == {"a", "b", "c", "d"}
    # the massive channel crushes its neighbours: elements flushed to zero (NVFP4: whole blocks whose e4m3
    # scale underflows, since its tensor scale follows the massive value)
    assert rows["c"].block_flushed > 0.1 and rows["c"].block_flushed > rows["a"].block_flushed
    if policy == "mixed_nvfp4":  # e2m1 flushes a tenth of a plain layer's elements (below a quarter step)
        assert rows["c"].block_saturated > 0.5 and rows["a"].block_saturated == 0
    else:
        assert rows["a"].block_flushed == 0 and rows["c"].block_saturated == 0
    assert f"#{rows['c'].index} {policy[6:]}: " in str(rep)
    assert rep.suggested() == {"overrides": {"c": "mixed_bfloat16"}}  # the measured layer kept in bfloat16
    fixed = fmp.explain(four_layers, policy, compare=True, **rep.suggested())(p, x)
    assert "c" not in {r.scope for r in fixed.records if r.category == "float8"}
    assert fmp.explain(four_layers, policy)(p, x).records[0].block_flushed is None  # needs compare=True


def test_the_emulation_is_said_once_as_information(caplog):
    from fmp._float8 import _block_dot

    _block_dot.EMULATION_NOTED.clear()
    x, w, _ = _operands()
    with caplog.at_level("INFO", logger="fmp"):
        for fmt in ("mxfp8", "nvfp4"):
            block_dot_general(x, w, DN, fmp.Float8Recipe(fmt), F32)
    notes = [r for r in caplog.records if "emulated" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelname == "INFO" and jax.default_backend() in notes[0].getMessage()
