"""Zero overhead: after XLA optimisation autocast has no more converts than the same program cast by hand."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers.common import load_bench
from test_autocast import X, _mlp_params, mlp, mlp_hand

import fmp

B = load_bench("autocast")


def _converts(fn, *args) -> int:
    return B.count_converts(jax.jit(fn).lower(*args).compile().as_text())


def _small_block():
    params = B.init_params(jax.random.key(0), d=64, layers=1)
    x = jax.random.normal(jax.random.key(1), (2, 16, 64))
    return params, x


def test_mlp_no_more_converts_than_hand_cast():
    p = _mlp_params()
    assert _converts(fmp.autocast(mlp), p, X) <= _converts(mlp_hand, p, X)
    auto = _converts(jax.value_and_grad(fmp.autocast(mlp)), p, X)
    hand = _converts(jax.value_and_grad(mlp_hand), p, X)
    assert hand > 0
    # jax.nn.relu (a custom_jvp that only picks values) runs in bfloat16 as in the hand-cast MLP (_hops._exact):
    # no cast up and down around it, forward or backward, on every jaxlib (0.10: 44 and 44; 0.11, 0.12: 34 and 34)
    assert auto <= hand


# (autocast rules, the hand-cast program they should equal): under the default rules gelu's cube (integer_pow)
# is unlisted, so gelu runs in bfloat16, as hand-cast code does; with integer_pow moved to float32, gelu runs on
# float32 input.
PAIRS = {
    "default-rules": (fmp.DEFAULT_RULES, {}),
    "integer_pow-float32": (B.F32_POW_RULES, {"gelu_f32": True}),
}


@pytest.mark.parametrize("pair", list(PAIRS))
def test_transformer_block_converts_and_values_match_hand_cast(pair):
    rules, kw = PAIRS[pair]
    params, x = _small_block()
    auto = jax.jit(jax.value_and_grad(fmp.autocast(B.loss, rules=rules))).lower(params, x).compile()
    hand = jax.jit(jax.value_and_grad(lambda p, x: B.loss(p, x, hand=True, **kw))).lower(params, x).compile()
    n_auto, n_hand = B.count_converts(auto.as_text()), B.count_converts(hand.as_text())
    assert n_hand > 0
    assert n_auto <= n_hand
    (va, ga), (vh, gh) = auto(params, x), hand(params, x)
    np.testing.assert_array_equal(va, vh)  # the same program: bitwise equal
    for a, h in zip(jax.tree.leaves(ga), jax.tree.leaves(gh), strict=True):
        assert a.dtype == jnp.float32
        np.testing.assert_array_equal(a, h)


def test_transformer_residuals_match_hand_cast_and_beat_float32():
    params, x = B.init_params(jax.random.key(0)), jax.ShapeDtypeStruct((8, 128, 256), jnp.float32)
    f32 = B.residual_bytes(B.loss, params, x)
    hand = B.residual_bytes(lambda p, x: B.loss(p, x, hand=True), params, x)
    hand_f32_gelu = B.residual_bytes(lambda p, x: B.loss(p, x, hand=True, gelu_f32=True), params, x)
    auto = B.residual_bytes(fmp.autocast(B.loss), params, x)
    auto_f32_pow = B.residual_bytes(fmp.autocast(B.loss, rules=B.F32_POW_RULES), params, x)
    no_epilogue = fmp.DEFAULT_RULES.derive(epilogue=[])
    auto_no_epilogue = B.residual_bytes(fmp.autocast(B.loss, rules=no_epilogue), params, x)
    # the issue's configuration: hand-cast Dense layers keep ~0.62x of float32's residual bytes
    assert hand / f32 < 0.66
    assert auto <= hand
    assert auto_f32_pow <= hand_f32_gelu < f32
    # without the epilogue rule the bias add returns gelu's input to float32
    assert auto_no_epilogue > auto


def test_cold_pair_times_both_variants_at_their_own_sequence_lengths(monkeypatch):
    traced = []
    real = B.compile_once

    def spy(fn, params, x, compile=True):
        traced.append(x.shape)
        return real(fn, params, x, compile=compile)

    monkeypatch.setattr(B, "compile_once", spy)
    times = B.first_pair("hand,auto")
    # warm-up at D=64, then the first variant at T=128 and the second at T=120
    assert traced == [(2, 16, 64), (8, 128, 256), (8, 120, 256)]
    assert len(times) == 4 and all(t > 0 for t in times)
