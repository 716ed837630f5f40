"""Real models under autocast: a flax nnx transformer block and a flax linen CNN train close to float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers.jaxprs import in_dtypes

import fmp

nnx = pytest.importorskip("flax.nnx")
nn = pytest.importorskip("flax.linen")
optax = pytest.importorskip("optax")


# ---------------------------------------------------------------- nnx transformer block


class Block(nnx.Module):
    def __init__(self, d: int, *, rngs: nnx.Rngs, norm_region: bool = False):
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=4, in_features=d, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 2 * d, rngs=rngs)
        self.down = nnx.Linear(2 * d, d, rngs=rngs)
        self.norm_region = norm_region

    def norm(self, ln, x):
        if self.norm_region:  # nnx opens no name scopes: a nested autocast region keeps the norm in float32
            return fmp.autocast(ln, "float32")(x)
        with jax.named_scope("norm"):
            return ln(x)

    def __call__(self, x):
        x = x + self.attn(self.norm(self.ln1, x))
        return x + self.down(jax.nn.gelu(self.up(self.norm(self.ln2, x))))


def _nnx_data():
    k1, k2 = jax.random.split(jax.random.key(0))
    x = jax.random.normal(k1, (4, 8, 32))
    y = jnp.roll(x, 1, axis=1) * 0.5
    return x, y


def _nnx_train(wrap, norm_region=False, steps=8):
    model = Block(32, rngs=nnx.Rngs(0), norm_region=norm_region)
    graphdef, params = nnx.split(model, nnx.Param)
    x, y = _nnx_data()

    def loss(params, x, y):
        return jnp.mean((nnx.merge(graphdef, params)(x) - y) ** 2)

    @jax.jit
    def step(params):
        value, grads = jax.value_and_grad(wrap(loss))(params, x, y)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value, grads

    losses = []
    for _ in range(steps):
        params, value, grads = step(params)
        losses.append(float(value))
    return np.array(losses), grads, loss, params


def test_nnx_transformer_block_trains_close_to_float32():
    l32, _, _, _ = _nnx_train(lambda f: f)
    l16, grads, loss, params = _nnx_train(lambda f: fmp.autocast(f, overrides={"norm": "float32"}))
    assert l16[-1] < 0.9 * l16[0], "the block must train under autocast"
    # documented tolerance for bfloat16 training: within 5% of the float32 loss curve
    np.testing.assert_allclose(l16, l32, rtol=5e-2)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))

    x, y = _nnx_data()
    rep = fmp.explain(loss, overrides={"norm": "float32"})(params, x, y)
    dots = rep.filter(op="dot_general").records
    assert dots and all(r.in_after == ("bfloat16", "bfloat16") for r in dots)
    assert all(r.out_after == ("float32",) for r in rep.filter(op="exp").records)  # softmax
    assert all(r.in_after == ("float32",) for r in rep.filter(op="reduce_sum").records)  # stats, loss
    # norm scope ran in float32: its rsqrt and its multiplies see float32
    norm_rows = [r for r in rep.records if "norm" in r.scope and r.op != "convert_element_type"]
    assert norm_rows and all(set(r.in_after) <= {"float32"} for r in norm_rows)
    assert rep.summary["low_precision_flop_share"] > 0.99


def test_nnx_norm_as_nested_float32_region():
    model = Block(32, rngs=nnx.Rngs(0), norm_region=True)
    x, _ = _nnx_data()
    graphdef, params = nnx.split(model, nnx.Param)
    cj = jax.make_jaxpr(fmp.autocast(lambda p, x: nnx.merge(graphdef, p)(x)))(params, x)
    assert set(in_dtypes(cj, "dot_general")) == {("bfloat16", "bfloat16")}
    rep = fmp.explain(lambda p, x: nnx.merge(graphdef, p)(x))(params, x)
    nested = [r for r in rep.records if r.category == "nested" and r.op == "rsqrt"]
    assert len(nested) == 2 and all(r.in_after == ("float32",) for r in nested)


# ---------------------------------------------------------------- linen CNN


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        x = nn.LayerNorm()(x)
        x = nn.relu(nn.Conv(8, (3, 3), strides=2)(x))
        x = x.mean(axis=(1, 2))
        return nn.Dense(4)(x)


def test_linen_cnn_trains_close_to_float32():
    k1, k2 = jax.random.split(jax.random.key(1))
    x = jax.random.normal(k1, (8, 8, 8, 1))
    labels = jax.random.randint(k2, (8,), 0, 4)
    model = CNN()
    params0 = model.init(jax.random.key(2), x)

    def loss(params, x, labels):
        logits = model.apply(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    opt = optax.sgd(0.2)

    def train(fn):
        step = jax.jit(
            lambda p, s: (lambda v, g: (optax.apply_updates(p, opt.update(g, s)[0]), s, v))(
                *jax.value_and_grad(fn)(p, x, labels)
            )
        )
        p, s, out = params0, opt.init(params0), []
        for _ in range(6):
            p, s, v = step(p, s)
            out.append(float(v))
        return np.array(out)

    l32 = train(loss)
    l16 = train(fmp.autocast(loss, overrides={"LayerNorm": "float32"}))
    assert l16[-1] < l16[0]
    np.testing.assert_allclose(l16, l32, rtol=3e-2)

    rep = fmp.explain(loss, overrides={"LayerNorm": "float32"})(params0, x, labels)
    convs = rep.filter(op="conv_general_dilated").records
    assert len(convs) == 2 and all(r.in_after == ("bfloat16", "bfloat16") for r in convs)
    assert rep.filter(op="dot_general").records[0].out_after == ("bfloat16",)
    ln = [r for r in rep.records if "LayerNorm" in r.scope and r.op in ("reduce_sum", "rsqrt", "mul", "sub")]
    assert ln and all(set(r.in_after) == {"float32"} for r in ln)
    assert all(r.in_after == ("float32",) for r in rep.filter(op="reduce_sum").records)
    assert rep.summary["low_precision_flop_share"] == 1.0
    text = str(rep)
    assert "conv_general_dilated" in text


class _Stateful(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.Dropout(0.5, deterministic=not train)(x)
        return nn.Dense(4)(nn.relu(x))


def test_linen_batchnorm_dropout_with_mutable_state():
    m, x = _Stateful(), jnp.linspace(-1.0, 1.0, 32).reshape(4, 8)
    v = m.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x, False)

    def loss(params, x):
        out, state = m.apply(
            {**v, "params": params}, x, True, rngs={"dropout": jax.random.key(2)}, mutable=["batch_stats"]
        )
        return jnp.sum(out**2), state

    (val, state), grads = jax.jit(jax.value_and_grad(fmp.autocast(loss), has_aux=True))(v["params"], x)
    (val32, state32), grads32 = jax.jit(jax.value_and_grad(loss, has_aux=True))(v["params"], x)
    np.testing.assert_allclose(val, val32, rtol=5e-2)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(state32), strict=True):
        assert a.dtype == jnp.float32
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=1e-2)
    scale = max(float(jnp.abs(b).max()) for b in jax.tree.leaves(grads32))
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads32), strict=True):
        assert a.dtype == jnp.float32
        np.testing.assert_allclose(a, b, rtol=0.1, atol=0.02 * scale)
