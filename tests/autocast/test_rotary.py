"""Contractions that sum one element per output (outer and batch-only products) run in their inputs' dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fmp

N, F = 2048, 64
INV_FREQ = 1.0 / (10000.0 ** (jnp.arange(0, F, 2, dtype=jnp.float32) / F))


def _angles(pos, inv):
    return jnp.einsum("i,j->ij", pos, inv)  # dot_general with no contracting dimension


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32])
def test_rotary_angles_keep_float32(dtype):
    with jax.numpy_dtype_promotion("standard"):  # int32 positions times float32 frequencies
        _check_angles(jnp.arange(N, dtype=dtype))


def _check_angles(pos):
    ref = _angles(pos, INV_FREQ)
    out = fmp.autocast(_angles)(pos, INV_FREQ)
    np.testing.assert_array_equal(out, ref)  # at position 2047 bfloat16 was off by radians
    np.testing.assert_array_equal(
        jax.jit(fmp.autocast(lambda p, f: jnp.cos(_angles(p, f))))(pos, INV_FREQ), jnp.cos(ref)
    )
    np.testing.assert_array_equal(fmp.autocast(lambda p, f: jnp.sin(_angles(p, f)))(pos, INV_FREQ), jnp.sin(ref))
    (row,) = fmp.explain(_angles)(pos, INV_FREQ).filter(op="dot_general").records
    assert row.category == "promote" and row.out_after == ("float32",)
    assert "elementwise product" in row.detail


@pytest.mark.parametrize(
    ("spec", "shapes", "low"),
    [
        ("ij,jk->ik", ((8, 16), (16, 4)), True),  # an ordinary matmul: bfloat16
        ("i,i->", ((16,), (16,)), True),  # a dot product
        ("ik,kj->ij", ((8, 1), (1, 4)), False),  # contracts a dimension of size 1
        ("bi,bj->bij", ((2, 8), (2, 4)), False),  # batch-only product
        ("i,j->ij", ((8,), (4,)), False),  # outer product
    ],
)
def test_which_contractions_run_in_compute_dtype(spec, shapes, low):
    args = [jnp.ones(s) for s in shapes]
    (row,) = fmp.explain(lambda a, b: jnp.einsum(spec, a, b))(*args).filter(op="dot_general").records
    assert row.out_after == (("bfloat16",) if low else ("float32",))
    # the rule is data in the rule table: without it every dot_general is a matmul
    off = fmp.DEFAULT_RULES.derive(uncontracted=[])
    (row,) = fmp.explain(lambda a, b: jnp.einsum(spec, a, b), rules=off)(*args).filter(op="dot_general").records
    assert row.out_after == ("bfloat16",)


def _rope(x, pos):
    ang = jnp.einsum("i,j->ij", pos, INV_FREQ)
    x1, x2 = x[..., : F // 2], x[..., F // 2 :]
    cos, sin = jnp.cos(ang).astype(x.dtype), jnp.sin(ang).astype(x.dtype)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def test_rotary_attention_logits_close_to_float32():
    t = 512
    kx, kq, kk = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (t, F))
    wq, wk = (jax.random.normal(k, (F, F)) / 8 for k in (kq, kk))
    pos = jnp.arange(N - t, N, dtype=jnp.float32)  # the last positions of a 2048 context

    def logits(x, wq, wk, pos):
        return _rope(x @ wq, pos) @ _rope(x @ wk, pos).T

    def hand(x, wq, wk, pos):  # angles in float32, matmuls in bfloat16
        bf = jnp.bfloat16
        q, k = (x.astype(bf) @ w.astype(bf) for w in (wq, wk))
        return (_rope(q, pos) @ _rope(k, pos).T).astype(jnp.float32)

    ref = logits(x, wq, wk, pos)
    err = float(jnp.max(jnp.abs(fmp.autocast(logits)(x, wq, wk, pos) - ref)))
    err_hand = float(jnp.max(jnp.abs(hand(x, wq, wk, pos) - ref)))
    assert err <= 1.5 * err_hand, (err, err_hand)
    # jit against eager: the same program (autocast marks its roundings, so XLA keeps them); jaxlib 0.11 and
    # later compute a handful of the jitted bfloat16 products one bfloat16 step apart (3 of 262144 logits)
    jitted = np.asarray(jax.jit(fmp.autocast(logits))(x, wq, wk, pos))
    eager = np.asarray(fmp.autocast(logits)(x, wq, wk, pos))
    assert np.count_nonzero(jitted != eager) <= 1e-4 * eager.size
    np.testing.assert_allclose(jitted, eager, rtol=2**-7)
