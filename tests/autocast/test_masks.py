"""Additive attention masks under autocast: what is added to attention scores is no linear layer's bias.

A padding mask built from ``finfo(float32).min`` and added after ``q·kᵀ`` must not run as a bias epilogue in
bfloat16 (it would round to -inf, and a query that sees no key, left padding under a causal mask, would
become NaN), and no constant is cast into a dtype that cannot hold it.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fmp

B, T, H, D = 2, 8, 2, 16
BF16 = jnp.bfloat16
# row 0 is left-padded by 3: its first three queries see no key under the causal mask
PAD = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1], [1] * T], bool)
CAUSAL = jnp.tril(jnp.ones((T, T), bool))


def _qkv(seed=0):
    return tuple(jax.random.normal(k, (B, T, H, D)) for k in jax.random.split(jax.random.key(seed), 3))


def _mask(pad):
    return pad[:, None, None, :] & CAUSAL


def _bias(pad, dtype=jnp.float32):
    return jnp.where(_mask(pad), 0.0, jnp.finfo(dtype).min).astype(dtype)


def _err(a, ref):
    return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - ref)))


def _check(fn, hand, *args):
    """``fn`` under autocast: finite, jit equal to eager, as close to float32 as the hand-cast ``hand``."""
    ref = fn(*args)
    out = fmp.autocast(fn)(*args)
    assert bool(jnp.all(jnp.isfinite(out))), "autocast gave NaN or inf"
    np.testing.assert_allclose(jax.jit(fmp.autocast(fn))(*args), out, rtol=1e-6, atol=1e-6)
    assert _err(out, ref) <= max(1.5 * _err(hand, ref), 1e-3), (_err(out, ref), _err(hand, ref))


def test_linen_attention_bias_with_left_padding():
    q, k, v = _qkv()

    def attend(q, k, v, pad):
        return nn.dot_product_attention(q, k, v, bias=_bias(pad))

    hand = nn.dot_product_attention(*(a.astype(BF16) for a in (q, k, v)), bias=_bias(PAD, BF16))
    _check(attend, hand, q, k, v, PAD)
    # the mask add is no epilogue: it varies along the batch and the queries; it runs in float32
    (row,) = fmp.explain(attend)(q, k, v, PAD).filter(op="add").records
    assert row.category == "promote" and row.out_after == ("float32",)
    assert "other than the output features" in row.detail


@pytest.mark.parametrize("how", ["bias", "mask"])
def test_linen_attention_weights_with_left_padding(how):
    q, k, _ = _qkv(1)

    def weights(q, k, pad):
        if how == "bias":
            return nn.dot_product_attention_weights(q, k, bias=_bias(pad))
        return nn.dot_product_attention_weights(q, k, mask=_mask(pad))  # jnp.where(mask, w, finfo.min)

    kw = {"bias": _bias(PAD, BF16)} if how == "bias" else {"mask": _mask(PAD)}
    hand = nn.dot_product_attention_weights(q.astype(BF16), k.astype(BF16), **kw)
    _check(weights, hand, q, k, PAD)
    # a query that sees no key attends uniformly, as in float32
    np.testing.assert_allclose(fmp.autocast(weights)(q, k, PAD)[0, :, 0], 1.0 / T, rtol=1e-6)


@pytest.mark.parametrize("how", ["bias", "mask"])
def test_nnx_attention_with_mask_or_bias(how):
    q, k, v = _qkv(2)

    def attend(q, k, v, pad):
        kw = {"bias": _bias(pad)} if how == "bias" else {"mask": _mask(pad)}
        return nnx.dot_product_attention(q, k, v, **kw)

    kw = {"bias": _bias(PAD, BF16)} if how == "bias" else {"mask": _mask(PAD)}
    with jax.numpy_dtype_promotion("standard"):  # the mask value is a float32 constant
        hand = nnx.dot_product_attention(*(a.astype(BF16) for a in (q, k, v)), **kw)
    _check(attend, hand, q, k, v, PAD)


def _rms(x, g):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g


def _rotate(x, pos):
    inv = 1.0 / (10000.0 ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D))
    ang = jnp.einsum("bt,f->btf", pos.astype(jnp.float32), inv)[:, :, None, :]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    cos, sin = jnp.cos(ang).astype(x.dtype), jnp.sin(ang).astype(x.dtype)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _llama_block(p, x, attention_mask, dt=jnp.float32):
    """One decoder layer as Hugging Face's Flax Llama writes it (``dt``: the hand-cast matmul dtype)."""
    lin = lambda h, w: (h.astype(dt) @ w.astype(dt)).astype(jnp.float32)  # noqa: E731
    h = _rms(x, p["g1"])
    q, k, v = (lin(h, p[n]).reshape(B, T, H, D) for n in ("wq", "wk", "wv"))
    pos = jnp.maximum(jnp.cumsum(attention_mask, -1) - 1, 0)
    q, k = _rotate(q, pos), _rotate(k, pos)
    mask = (attention_mask[:, None, None, :] > 0) & CAUSAL
    bias = jax.lax.select(mask, jnp.full(mask.shape, 0.0), jnp.full(mask.shape, jnp.finfo(jnp.float32).min))
    # as FlaxLlamaAttention: flax's weights (query scaled, then q·kᵀ + bias, softmax)
    if dt == jnp.float32:
        w = nn.dot_product_attention_weights(q, k, bias=bias)
    else:
        with jax.numpy_dtype_promotion("standard"):  # bfloat16 scores + the float32 bias, as hand-cast code does
            w = nn.dot_product_attention_weights(q.astype(dt), k.astype(dt), bias=bias)
    o = jnp.einsum("bhqk,bkhd->bqhd", w.astype(dt), v.astype(dt)).astype(jnp.float32).reshape(B, T, H * D)
    x = x + lin(o, p["wo"])
    return x + lin(jax.nn.silu(lin(_rms(x, p["g2"]), p["w1"])), p["w2"])


def _llama_setup():
    ks = jax.random.split(jax.random.key(3), 8)
    e = H * D
    p = {n: jax.random.normal(k, (e, e)) / np.sqrt(e) for n, k in zip(("wq", "wk", "wv", "wo"), ks, strict=False)}
    p |= {"w1": jax.random.normal(ks[4], (e, 4 * e)) / np.sqrt(e), "w2": jax.random.normal(ks[5], (4 * e, e)) / 8}
    p |= {"g1": jnp.ones(e), "g2": jnp.ones(e)}
    return p, jax.random.normal(ks[6], (B, T, e)), PAD.astype(jnp.int32)


def _llama_loss(p, x, am, dt=jnp.float32):
    return jnp.mean(_llama_block(p, x, am, dt) ** 2)


def test_llama_block_with_left_padded_batch():
    p, x, am = _llama_setup()
    loss = _llama_loss
    l32, lhand = loss(p, x, am), loss(p, x, am, BF16)
    lac = fmp.autocast(loss)(p, x, am)
    assert np.isfinite(float(lac))
    assert abs(float(lac) - float(l32)) <= max(2 * abs(float(lhand) - float(l32)), 2e-3 * abs(float(l32)))
    np.testing.assert_allclose(jax.jit(fmp.autocast(loss))(p, x, am), lac, rtol=1e-6)


@pytest.mark.gallery
def test_llama_block_gradients_with_left_padded_batch():
    p, x, am = _llama_setup()
    loss = _llama_loss
    g32 = jax.grad(loss)(p, x, am)
    gac = jax.jit(jax.grad(fmp.autocast(loss)))(p, x, am)
    for n in p:
        assert bool(jnp.all(jnp.isfinite(gac[n]))), n
        np.testing.assert_allclose(gac[n], g32[n], atol=0.05 * float(jnp.max(jnp.abs(g32[n]))))


def test_linear_bias_stays_epilogue_next_to_a_mask():
    x, w, b = jnp.ones((B, T, H * D)), jnp.ones((H * D, H * D)), jnp.ones(H * D)

    def f(x, w, b, pad):
        h = (x @ w + b).reshape(B, T, H, D)  # a projection with a bias: the epilogue
        s = jnp.einsum("bqhd,bkhd->bhqk", h, h)
        return jax.nn.softmax(s + _bias(pad))  # the mask: promotes to float32

    rows = fmp.explain(f)(x, w, b, PAD).filter(op="add").records
    assert [(r.category, r.in_after, r.out_after) for r in rows] == [
        ("epilogue", ("bfloat16", "bfloat16"), ("bfloat16",)),
        ("promote", ("float32", "float32"), ("float32",)),
    ]
    assert rows[0].detail == "a bias along the output features"


def test_a_constant_the_compute_dtype_cannot_hold_is_not_cast_into_it():
    x, w = jax.random.normal(jax.random.key(4), (4, 8)), jax.random.normal(jax.random.key(5), (8, 8))
    keep = jnp.arange(8) < 5

    def masked(x, w):
        return x @ w - 1e9 * (
            1.0 - keep.astype(jnp.float32)
        )  # a bias along the features; in float16, -1e9 would be -inf

    out = fmp.autocast(masked, "mixed_float16")(x, w)
    np.testing.assert_allclose(out, masked(x, w), rtol=1e-2, atol=1e-2)
    (row,) = fmp.explain(masked, "mixed_float16")(x, w).filter(op="sub").records[-1:]
    assert row.category == "promote" and row.out_after == ("float32",) and "overflows float16" in row.detail
    # a closed-over mask bfloat16 cannot hold (finfo(float32).min rounds to -inf): no epilogue, float32
    big = jnp.where(keep, 0.0, jnp.finfo(jnp.float32).min)
    lin = lambda x, w: x @ w + big  # noqa: E731
    assert float(jnp.min(fmp.autocast(lin)(x, w))) == float(jnp.finfo(jnp.float32).min)
    (row,) = fmp.explain(lin)(x, w).filter(op="add").records
    assert row.category == "promote" and row.out_after == ("float32",) and "overflows bfloat16" in row.detail
    # a constant bfloat16 holds still takes the epilogue
    (row,) = fmp.explain(lambda x, w: x @ w + jnp.where(keep, 0.0, -1e30))(x, w).filter(op="add").records
    assert row.category == "epilogue"


def test_runtime_overflow_still_becomes_inf():
    # only constants are kept: a float16 matmul that overflows at run time gives inf (what loss scaling sees)
    x, w = jnp.full((2, 64), 300.0, jnp.float32), jnp.full((64, 4), 10.0, jnp.float32)
    assert bool(jnp.all(jnp.isinf(fmp.autocast(lambda x, w: x @ w, "mixed_float16")(x, w))))
    # an argument is a runtime value, even when it holds a huge number
    big = jnp.full((4,), -1e9, jnp.float32)
    ones = jnp.ones((2, 64), jnp.float32), jnp.ones((64, 4), jnp.float32)
    out = fmp.autocast(lambda x, w, b: x @ w + b, "mixed_float16")(*ones, big)
    assert bool(jnp.all(jnp.isinf(out)))
