"""Numerics a user can rely on: one rounding per compute-dtype value, jit or not."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fmp


def _leaves_close(a, b, rtol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        assert x.dtype == y.dtype and x.shape == y.shape
        scale = max(float(np.abs(x).max()), 1e-30)
        assert float(np.abs(x - y).max()) <= rtol * scale, (x.shape, float(np.abs(x - y).max()) / scale)


def _ce(w, b, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(x @ w + b, y)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_cross_entropy_jit_equals_eager_and_is_never_negative(policy):
    # bfloat16 logits of magnitude ~20 (an ulp of 0.125): the label logit (a gather of the bfloat16 logits) and
    # the log-normaliser (the logits cast up for exp) must see the same rounding, or the loss goes negative
    k = jax.random.split(jax.random.key(0), 4)
    w = jax.random.normal(k[0], (64, 10)) * (2.0 if policy == "mixed_bfloat16" else 0.5)
    b = jax.random.normal(k[1], (10,))
    x = jax.random.normal(k[2], (256, 64))
    y = jax.random.randint(k[3], (256,), 0, 10)
    f = fmp.autocast(_ce, policy)
    eager, jitted = f(w, b, x, y), jax.jit(f)(w, b, x, y)
    assert float(jnp.min(eager)) >= 0.0 and float(jnp.min(jitted)) >= 0.0
    _leaves_close(eager, jitted, rtol=1e-6)


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.LayerNorm()(nn.Conv(16, (3, 3))(x)))
        x = jax.nn.relu(nn.Dense(64)(x.reshape(x.shape[0], -1)))
        return nn.Dense(10)(x)


@pytest.mark.gallery
def test_linen_loss_and_gradients_jit_equal_eager():
    # without one rounding per value the conv kernel's gradient under jit differed from eager by ~2e-3 relative
    k = jax.random.split(jax.random.key(1), 3)
    x, y = jax.random.normal(k[0], (16, 8, 8, 3)), jax.random.randint(k[1], (16,), 0, 10)
    net = _Net()
    params = net.init(k[2], x)

    def loss(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(net.apply(p, x), y).mean()

    f = fmp.autocast(jax.value_and_grad(loss))
    _leaves_close(f(params, x, y), jax.jit(f)(params, x, y), rtol=1e-6)


def test_up_cast_rounds_once_in_the_rewritten_program():
    # every cast fmp inserts from the compute dtype up to float32 carries the rounding explicitly
    cj = fmp.autocast_jaxpr(jax.make_jaxpr(_ce)(jnp.ones((4, 3)), jnp.ones(3), jnp.ones((2, 4)), jnp.zeros(2, int)))
    eqns = cj.jaxpr.eqns
    ups = [
        i
        for i, e in enumerate(eqns)
        if e.primitive.name == "convert_element_type"
        and e.invars[0].aval.dtype == jnp.bfloat16
        and e.outvars[0].aval.dtype == jnp.float32
    ]
    assert ups
    for i in ups:
        nxt = eqns[i + 1]
        assert nxt.primitive.name == "reduce_precision" and nxt.invars[0] is eqns[i].outvars[0]
        assert (nxt.params["exponent_bits"], nxt.params["mantissa_bits"]) == (8, 7)


def _stats(h):
    return [jnp.sum(h, 0), jnp.mean(h, 0), jnp.var(h, 0), jnp.std(h, 0), jax.nn.standardize(h, 0)]


def test_statistics_of_compute_dtype_values_stay_float32():
    # jnp accumulates a bfloat16 array's sum/mean/var in float32 and rounds the result back to bfloat16; under
    # autocast that rounding is dropped (torch returns float32 from its float32-list reductions)
    h = jax.random.normal(jax.random.key(0), (64, 8)).astype(jnp.bfloat16)
    exact = _stats(h.astype(jnp.float32))

    def f(h):
        return [s.astype(jnp.float32) for s in _stats(h)]

    plain = f(h)
    for out in (fmp.autocast(f)(h), jax.jit(fmp.autocast(f))(h)):
        for got, ref, rounded in zip(out, exact, plain, strict=True):
            np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
            assert float(jnp.max(jnp.abs(rounded - ref))) > 1e-4  # the plain program does round them
    rep = fmp.explain(f)(h)
    assert rep.filter(category="statistic").records
    assert all(r.out_after == ("float32",) for r in rep.filter(category="statistic").records)


def test_a_users_explicit_cast_of_a_statistic_is_kept():
    h = jax.random.normal(jax.random.key(0), (64, 8)).astype(jnp.bfloat16)

    def f(h):
        return jnp.sum(h.astype(jnp.float32), 0).astype(jnp.bfloat16).astype(jnp.float32)

    ref = f(h)  # rounded to bfloat16 by the user's astype
    np.testing.assert_array_equal(fmp.autocast(f)(h), ref)
    np.testing.assert_array_equal(jax.jit(fmp.autocast(f))(h), ref)
    assert not fmp.explain(f)(h).filter(category="statistic").records


def test_jit_equals_eager_through_program_casts():
    # a compute-dtype value read through a cast the program wrote (jnp.sum's own cast up) sees one rounding too
    x = jax.random.normal(jax.random.key(0), (64, 8))
    w = jax.random.normal(jax.random.key(1), (8, 8))

    def f(x, w):
        h = (x @ w).astype(jnp.bfloat16)
        return [s.astype(jnp.float32) for s in _stats(h)] + [h.astype(jnp.float32) * 3.0]

    f = fmp.autocast(f)
    _leaves_close(f(x, w), jax.jit(f)(x, w), rtol=1e-6)


def test_weak_typed_values_follow_and_weak_angles_keep_float32():
    # rotary angles: positions times inverse frequencies built from Python scalars are weak-typed float32;
    # the outer product sums one element per output, so it keeps float32 (bfloat16 lost the angles:
    # |sin error| ~0.9); so does the same product written as a contraction over a dimension of size 1
    def angles(x):
        inv_freq = jnp.exp(jnp.arange(0, 64, 2) * -(math.log(1e4) / 64))  # weak-typed inside the trace
        return jnp.sin(jnp.einsum("i,j->ij", jnp.arange(2048), inv_freq)) + x

    x = jnp.zeros((2048, 32))
    with jax.numpy_dtype_promotion("standard"):
        dots = [e for e in jax.make_jaxpr(fmp.autocast(angles))(x).jaxpr.eqns if e.primitive.name == "dot_general"]
        assert dots and not any(str(v.aval.dtype) == "bfloat16" for e in dots for v in e.invars)
        np.testing.assert_allclose(np.asarray(fmp.autocast(angles)(x)), np.asarray(angles(x)), atol=1e-6)
        pos, inv = jnp.arange(2048) * 1.0, jnp.exp(jnp.arange(0, 64, 2) * -(math.log(1e4) / 64))
        assert pos.weak_type and inv.weak_type
        outer = fmp.autocast(lambda p, f: p[:, None] @ f[None, :])(pos, inv)
        np.testing.assert_array_equal(outer, pos[:, None] @ inv[None, :])
    # a Python scalar follows the other operand (no float32 promotion of a bfloat16 value)
    y = fmp.autocast(lambda x: jnp.sin(2.0) * x)(jnp.ones(3, jnp.bfloat16))
    assert y.dtype == jnp.bfloat16


@pytest.mark.parametrize("compute", [jnp.bfloat16, jnp.float16])
def test_a_matmul_of_weak_typed_arrays_runs_in_the_compute_dtype(compute):
    # arrays built from Python scalars (jnp.full, jnp.ones_like of one, int arrays times 0.5) are weak-typed;
    # with no strongly typed input to follow, a matmul or convolution still takes the policy, as in torch
    with jax.numpy_dtype_promotion("standard"):  # int positions times a Python float
        a, b = jnp.full((64, 128), 0.3), (jnp.arange(128 * 32) % 7).reshape(128, 32) * 0.37
    assert a.weak_type and b.weak_type
    policy = fmp.Policy(param_dtype=jnp.float32, compute_dtype=compute, output_dtype=jnp.float32)

    def f(a, b):
        return a @ b, (a * 2.0) @ b

    hand = [(x.astype(compute) @ b.astype(compute)).astype(jnp.float32) for x in (a, a * 2.0)]
    for out in (fmp.autocast(f, policy)(a, b), jax.jit(fmp.autocast(f, policy))(a, b)):
        for o, h in zip(out, hand, strict=True):
            np.testing.assert_array_equal(o, h)
    assert float(jnp.abs(hand[0] - a @ b).max()) > 0  # the compute dtype's rounding shows
    dots = [e for e in jax.make_jaxpr(fmp.autocast(f, policy))(a, b).jaxpr.eqns if e.primitive.name == "dot_general"]
    assert [str(v.aval.dtype) for e in dots for v in e.invars] == [jnp.dtype(compute).name] * 4
    img, ker = jnp.full((1, 3, 8, 8), 0.5), jnp.full((4, 3, 3, 3), 0.25)
    conv = fmp.explain(lambda i, k: jax.lax.conv(i, k, (1, 1), "SAME"), policy)(img, ker)
    (row,) = conv.filter(op="conv_general_dilated").records
    assert row.out_after == (jnp.dtype(compute).name,)
    # a weak-typed array still follows a strongly typed operand: no float32 promotion of a bfloat16 value
    (row,) = fmp.explain(lambda x, y: x + y, policy)(a, jnp.ones((64, 128), compute)).filter(op="add").records
    assert row.out_after == (jnp.dtype(compute).name,)


def test_float16_subnormals_survive_the_cast_up_forward_and_backward():
    # float16 holds values down to 2**-24 (subnormals below 2**-14); the rounding fmp adds to each cast up must
    # keep them, in the forward and in the cotangent (what a loss scaler relies on), as hand-cast code and torch do
    x = jnp.array([[1e-6, 3e-5, 6e-8, 1e-4, 7e3, -2e-7, 2.9e-8, 3.1e-8]], jnp.float32)
    w = jnp.eye(8)
    f = lambda x, w: (x @ w) * 1.0  # noqa: E731
    hand = (x.astype(jnp.float16) @ w.astype(jnp.float16)).astype(jnp.float32)
    assert float(jnp.min(jnp.abs(hand[0, :6]))) > 0  # the case is the subnormal range, not a zero product
    for run in (fmp.autocast(f, "mixed_float16"), jax.jit(fmp.autocast(f, "mixed_float16"))):
        np.testing.assert_array_equal(np.asarray(run(x, w)), np.asarray(hand))
    ct = jnp.array([1e-6, 1e-7, 3e-8, 1.0, 1.0, 2e-6, 5e-7, 1e-5])
    grad = jax.grad(lambda x: jnp.sum(fmp.autocast(f, "mixed_float16")(x, w) * ct))(x)
    # the cotangent reaches the float16 matmul rounded to float16, subnormals kept (torch: grad.half())
    np.testing.assert_array_equal(np.asarray(grad[0]), np.asarray(ct, np.float16).astype(np.float32))
