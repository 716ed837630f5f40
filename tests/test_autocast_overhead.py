"""Zero overhead: after XLA optimisation autocast has no more converts than the same program cast by hand."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
from helpers import ROOT
from test_autocast import X, _mlp_params, mlp, mlp_hand

import fmp


def _bench():
    spec = importlib.util.spec_from_file_location("fmp_bench_autocast", ROOT / "bench" / "autocast.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


B = _bench()


def _converts(fn, *args) -> int:
    return B.count_converts(jax.jit(fn).lower(*args).compile().as_text())


def _small_block():
    params = B.init_params(jax.random.key(0), d=64, layers=1)
    x = jax.random.normal(jax.random.key(1), (2, 16, 64))
    return params, x


def test_mlp_no_more_converts_than_hand_cast():
    p = _mlp_params()
    auto = _converts(jax.value_and_grad(fmp.autocast(mlp)), p, X)
    hand = _converts(jax.value_and_grad(mlp_hand), p, X)
    assert hand > 0
    assert auto <= hand


def test_transformer_block_converts_and_values_match_hand_cast():
    params, x = _small_block()
    auto = jax.jit(jax.value_and_grad(fmp.autocast(B.loss))).lower(params, x).compile()
    hand = jax.jit(jax.value_and_grad(lambda p, x: B.loss(p, x, hand=True))).lower(params, x).compile()
    n_auto, n_hand = B.count_converts(auto.as_text()), B.count_converts(hand.as_text())
    assert n_hand > 0
    assert n_auto <= n_hand
    (va, ga), (vh, gh) = auto(params, x), hand(params, x)
    np.testing.assert_array_equal(va, vh)  # the same program: bitwise equal
    for a, h in zip(jax.tree.leaves(ga), jax.tree.leaves(gh), strict=True):
        assert a.dtype == jnp.float32
        np.testing.assert_array_equal(a, h)


def test_transformer_residuals_match_hand_cast_and_beat_float32():
    params, x = _small_block()
    auto = B.residual_bytes(fmp.autocast(B.loss), params, x)
    hand = B.residual_bytes(lambda p, x: B.loss(p, x, hand=True), params, x)
    f32 = B.residual_bytes(B.loss, params, x)
    assert auto <= hand < f32
