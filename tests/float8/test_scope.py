"""The float8 scope rule: under a float8 recipe only matmuls and convolutions with a weight operand run in
float8 (as torchao, Transformer Engine and flax scope it); attention's activation x activation products stay
in bfloat16 unless ``Float8Recipe(activations=True)``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import fmp
from fmp._float8._dot import float8_dot_general

BF16, F32 = jnp.bfloat16, jnp.float32
DN = (((1,), (0,)), ((), ()))
NT = (((1,), (1,)), ((), ()))
EXACT = {"xla_allow_excess_precision": False}


def _weights(d=16):
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(ks[0], (8, d), F32)
    return x, {n: jax.random.normal(k, (d, d), F32) / 4 for n, k in zip("qkv", ks[1:], strict=True)}


def attention(x, w):
    q, k, v = x @ w["q"], x @ w["k"], x @ w["v"]
    p = jax.nn.softmax(q @ k.T)
    return p @ v


def attention_by_hand(x, w):
    """attention as mixed_float8 runs it: float8 projections, bfloat16 q k^T and p v (float32 softmax)."""
    r = fmp.Float8Recipe("tensorwise")
    q, k, v = (float8_dot_general(x, w[n], DN, r, BF16) for n in "qkv")
    s = jax.lax.dot_general(q, k, NT, preferred_element_type=BF16)
    e = jnp.exp((s - jnp.max(s, axis=-1, keepdims=True)).astype(F32))  # bfloat16 max-subtraction, float32 exp
    p = (e / jnp.sum(e, axis=-1, keepdims=True)).astype(BF16)
    return (p @ v).astype(F32)


def _dots(rep):
    return [(r.category, r.why.split(" (")[0]) for r in rep.records if r.op in ("dot_general", "conv_general_dilated")]


def test_attention_products_stay_bfloat16_and_projections_are_float8():
    x, w = _weights()
    rows = _dots(fmp.explain(attention, "mixed_float8")(x, w))
    weight, act = ("float8", "weight operand"), ("lower_precision", "activation x activation")
    assert rows == [weight, weight, weight, act, act]
    rep = fmp.explain(attention, "mixed_float8")(x, w)
    dots = [r for r in rep.records if r.op == "dot_general"]
    assert dots[2].why == "weight operand (rhs: input 3)"  # flat inputs: x, then the leaves of w
    assert "Float8Recipe(activations=True) puts it in float8" in dots[3].why
    got = jax.jit(fmp.autocast(attention, "mixed_float8"), compiler_options=EXACT)(x, w)
    want = jax.jit(attention_by_hand, compiler_options=EXACT)(x, w)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_activations_true_puts_every_matmul_in_float8():
    x, w = _weights()
    pol = fmp.Policy("f32", "bf16", "f32", float8=fmp.Float8Recipe("tensorwise", activations=True))
    rows = _dots(fmp.explain(attention, pol)(x, w))
    assert rows == [("float8", "activations=True")] * 5


def test_weight_seen_through_slice_reshape_transpose_and_astype():
    x, w = _weights()

    def f(x, stack):  # stack[0]: a slice of stacked layer weights
        wt = stack[0].reshape(4, 4, 16).reshape(16, 16).T.astype(BF16)
        return jnp.tanh(x).astype(BF16) @ jnp.broadcast_to(wt, (16, 16))  # tanh(x): an activation

    stack = jnp.stack([w["q"], w["k"]])
    assert _dots(fmp.explain(f, "mixed_float8")(x, stack)) == [("float8", "weight operand")]


def test_two_inputs_of_the_function_are_both_weights():
    # an input of the autocast function is a weight, whatever it holds: a product of two inputs is float8
    x, w = _weights()
    assert _dots(fmp.explain(lambda a, b: a @ b, "mixed_float8")(x, w["q"])) == [("float8", "weight operand")]


def test_scan_over_stacked_weights_is_float8_in_the_body():
    x, w = _weights()
    stacked = jnp.stack([w["q"], w["k"], w["v"]])

    def f(x, ws):
        def layer(h, wl):
            y = jnp.tanh(h @ wl)
            return y, jax.nn.softmax(y @ y.T)  # the second product is activation x activation

        return jax.lax.scan(layer, x, ws)

    rows = _dots(fmp.explain(f, "mixed_float8")(x, stacked))
    assert rows == [("float8", "weight operand"), ("lower_precision", "activation x activation")]
    st = fmp.float8_state(f, "p=f32,c=bf16,o=f32,float8=delayed")(x, stacked)
    assert st.amax_history.shape[0] == 3  # one weight site per layer, none for y y^T


def test_flax_linen_and_nnx_params_are_weights():
    import flax.linen as nn
    from flax import nnx

    x, _ = _weights()
    mlp = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(4)])
    params = mlp.init(jax.random.PRNGKey(1), x)
    assert _dots(fmp.explain(mlp.apply, "mixed_float8")(params, x)) == [("float8", "weight operand")] * 2

    lin = nnx.Linear(16, 4, rngs=nnx.Rngs(0))
    graph, state = nnx.split(lin)
    rows = _dots(fmp.explain(lambda s, x: nnx.merge(graph, s)(x), "mixed_float8")(state, x))
    assert rows == [("float8", "weight operand")]


def test_conv_with_a_kernel_input_is_float8_and_of_two_activations_is_not():
    x = jax.random.normal(jax.random.PRNGKey(2), (2, 3, 8, 8), F32)
    k = jax.random.normal(jax.random.PRNGKey(3), (4, 3, 3, 3), F32)

    def f(x, k):
        y = jax.lax.conv_general_dilated(x, k, (1, 1), "SAME")
        return jax.lax.conv_general_dilated(y, jnp.tanh(y[:, :, :3, :3]), (1, 1), "SAME")

    rows = _dots(fmp.explain(f, "mixed_float8")(x, k))
    assert rows == [("float8", "weight operand"), ("lower_precision", "activation x activation")]
