"""The epilogue rule: a bias add after a lower_precision op runs in the compute dtype (torch's linear/addmm)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers.jaxprs import all_eqns

import fmp

X = jnp.ones((2, 3, 4))
W = jnp.ones((4, 5))
B = jnp.ones(5)
NO_EPILOGUE = fmp.DEFAULT_RULES.derive(epilogue=[])


def _adds(fn, *args, **kw):
    """(input dtypes, output dtype) of every add/sub in the jaxpr ``fmp.autocast_jaxpr`` returns."""
    cj = fmp.autocast_jaxpr(jax.make_jaxpr(fn)(*args), **kw)
    return [
        (tuple(np.dtype(v.aval.dtype).name for v in e.invars), np.dtype(e.outvars[0].aval.dtype).name)
        for e in all_eqns(cj)
        if e.primitive.name in ("add", "sub")
    ]


BF2 = (("bfloat16", "bfloat16"), "bfloat16")
F2 = (("float32", "float32"), "float32")


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, w, b: x @ w + b,
        lambda x, w, b: b + x @ w,
        lambda x, w, b: x @ w - b,
        lambda x, w, b: jnp.einsum("btd,de->bte", x, w) + b,
        # flax Dense: the bias is reshaped to (1, 1, features)
        lambda x, w, b: jnp.dot(x, w) + jnp.reshape(b, (1, 1, -1)),
        # through a reshape of the matmul's result (heads split)
        lambda x, w, b: (x @ w).reshape(2, 3, 5, 1) + b[:, None],
        # a convolution's bias
        lambda x, w, b: jax.lax.conv(x, jnp.ones((5, 3, 2)), (1,), "SAME") + b[None, :, None],
    ],
)
def test_bias_add_after_lower_precision_op_runs_in_compute_dtype(fn):
    assert _adds(fn, X, W, B) == [BF2]
    # the rule is data in the rule table: turning it off gives the plain promote rule
    assert _adds(fn, X, W, B, rules=NO_EPILOGUE) == [F2]


def test_not_an_epilogue():
    other = jnp.ones((2, 3, 5))
    # a full-size float32 operand (a residual stream) promotes as before
    assert _adds(lambda x, w, o: o + x @ w, X, W, other) == [F2]
    # the (bfloat16) matmul's result is cast to float32 by the user: respected, the add is float32
    up = lambda x, w, b: (x @ w).astype(jnp.float32) + b  # noqa: E731
    assert _adds(up, X.astype(jnp.bfloat16), W.astype(jnp.bfloat16), B) == [F2]
    # the add's operand is not a matmul result (tanh computes on it)
    assert _adds(lambda x, w, b: jnp.tanh(x @ w) + b, X, W, B) == [F2]
    # an explicit float32 accumulation type is kept, so the result is float32 and so is the add
    pet = lambda x, w, b: jnp.matmul(x, w, preferred_element_type=jnp.float32) + b  # noqa: E731
    assert _adds(pet, X.astype(jnp.bfloat16), W.astype(jnp.bfloat16), B) == [F2]
    # float64 is never cast: a float64 Dense layer stays float64
    with jax.enable_x64(True):
        f64 = _adds(lambda x, w, b: x @ w + b, *(a.astype(jnp.float64) for a in (X, W, B)))
    assert f64 == [(("float64", "float64"), "float64")]


def test_float32_policy_and_override_keep_float32():
    assert _adds(lambda x, w, b: x @ w + b, X, W, B, policy="float32") == [F2]

    def scoped(x, w, b):
        with jax.named_scope("head"):
            return x @ w + b

    assert _adds(scoped, X, W, B, overrides={"head": "float32"}) == [F2]


def test_float16_policy_and_explain_row():
    assert _adds(lambda x, w, b: x @ w + b, X, W, B, policy="mixed_float16") == [(("float16", "float16"), "float16")]
    rep = fmp.explain(lambda x, w, b: jax.nn.relu(x @ w + b))(X, W, B)
    (row,) = rep.filter(op="add").records
    assert row.category == "epilogue"
    assert row.in_before == ("float32", "float32") and row.in_after == ("bfloat16", "bfloat16")


def test_dense_layer_grads_float32_and_close():
    def f(x, w, b):
        return jnp.sum(jnp.tanh(x @ w + b) ** 2)

    x = jax.random.normal(jax.random.key(0), (4, 8, 16))
    w = jax.random.normal(jax.random.key(1), (16, 32)) / 4
    b = jax.random.normal(jax.random.key(2), (32,))
    g32, g16 = jax.jit(lambda *a: (jax.grad(f, argnums=(1, 2))(*a), jax.grad(fmp.autocast(f), argnums=(1, 2))(*a)))(
        x, w, b
    )
    for a, r in zip(g16, g32, strict=True):
        assert a.dtype == jnp.float32
        np.testing.assert_allclose(a, r, rtol=5e-2, atol=5e-2 * float(jnp.max(jnp.abs(r))))


def test_derive_epilogue_validation_and_torch_tables_unchanged():
    assert fmp.DEFAULT_RULES.jax_epilogue == frozenset({"add", "sub"})
    r = fmp.DEFAULT_RULES.derive(epilogue=["add"])
    assert r.jax_epilogue == frozenset({"add"}) and r != fmp.DEFAULT_RULES and hash(r) != hash(NO_EPILOGUE)
    assert r.torch_cpu == fmp.DEFAULT_RULES.torch_cpu and r.torch_cuda == fmp.DEFAULT_RULES.torch_cuda
    # derive without epilogue= keeps it
    assert fmp.DEFAULT_RULES.derive(float32=["tanh"]).jax_epilogue == fmp.DEFAULT_RULES.jax_epilogue
    with pytest.raises(TypeError, match="epilogue"):
        fmp.DEFAULT_RULES.derive(epilogue="add")
    with pytest.raises(TypeError, match="epilogue"):
        fmp.DEFAULT_RULES.derive(epilogue=[1])


def _on(h, f):
    return f(h)


@pytest.mark.parametrize(
    "fn",
    [
        # normalisation: the mean and the variance are computed from the matmul's result
        lambda x, w, b: _on(x @ w, lambda h: h - jnp.mean(h, axis=-1, keepdims=True)),
        lambda x, w, b: jax.nn.standardize(x @ w, axis=-1),
        # max-subtraction (a hand-written softmax) and a stop_gradient'ed max
        lambda x, w, b: _on(x @ w, lambda h: h - jnp.max(h, axis=-1, keepdims=True)),
        lambda x, w, b: _on(x @ w, lambda h: h - jax.lax.stop_gradient(jnp.max(h, axis=0))),
        # a statistic of the same value through a reshape
        lambda x, w, b: _on((x @ w).reshape(6, 5), lambda h: h - jnp.mean(h, 0)),
        # ... through jnp's re-viewing helpers (each its own jitted call in the traced program)
        lambda x, w, b: _on(x @ w[:, :1], lambda h: jnp.squeeze(h, -1) - jnp.mean(h)),
        lambda x, w, b: _on(x @ w, lambda h: jnp.ravel(h) - jnp.mean(h)),
        lambda x, w, b: _on(x @ w, lambda h: jnp.swapaxes(h, 0, 1) - jnp.mean(h)),
    ],
)
def test_a_statistic_of_the_result_is_no_bias(fn):
    # the normal promotion decides: the same dtypes as with the epilogue rule turned off
    rows = _adds(fn, X, W, B)
    assert rows and rows == _adds(fn, X, W, B, rules=NO_EPILOGUE)
    assert not fmp.explain(fn)(X, W, B).filter(category="epilogue").records
    # the same through fmp.autocast, which keeps jnp's helpers as calls where it can
    direct = _autocast_adds(fmp.autocast(fn), X, W, B)
    assert direct and direct == _autocast_adds(fmp.autocast(fn, rules=NO_EPILOGUE), X, W, B)


def _autocast_adds(fn, *args):
    """(input dtypes, output dtype) of every add/sub in ``fn``'s jaxpr, helper bodies included."""
    return [
        (tuple(np.dtype(v.aval.dtype).name for v in e.invars), np.dtype(e.outvars[0].aval.dtype).name)
        for e in all_eqns(jax.make_jaxpr(fn)(*args))
        if e.primitive.name in ("add", "sub")
    ]


def test_an_independent_bias_next_to_a_statistic_is_still_a_bias():
    # the bias add keeps the epilogue; the centring of its result (a statistic of it) promotes
    rows = _adds(lambda x, w, b: _on(x @ w + b, lambda h: h - jnp.mean(h, -1, keepdims=True)), X, W, B)
    assert rows[0] == BF2 and rows[-1][1] == "float32", rows
    # a mean of the bfloat16 result is float32: the centring promotes to float32
    assert _adds(lambda x, w, b: _on(x @ w, lambda h: h - jnp.mean(h, -1, keepdims=True)), X, W, B) == [F2]


class _BNNet(nn.Module):
    dtype: object = None  # the hand-cast variant sets bfloat16 on the convolutions

    @nn.compact
    def __call__(self, x):
        x = nn.BatchNorm(use_running_average=False)(nn.Conv(8, (3, 3), use_bias=False, dtype=self.dtype)(x))
        x = nn.BatchNorm(use_running_average=False)(
            nn.Conv(8, (3, 3), use_bias=False, dtype=self.dtype)(jax.nn.relu(x))
        )
        return jnp.mean(jnp.tanh(x) * jnp.cos(jnp.arange(x.size).reshape(x.shape)))


@pytest.mark.gallery
def test_batchnorm_gradients_match_float32():
    # BatchNorm's centring (x - mean(x)) once ran in bfloat16 as a bias add: gradients off by 15x to 1e4x
    x = jax.random.normal(jax.random.key(0), (8, 8, 8, 3))
    v = _BNNet().init(jax.random.key(1), x)

    def loss(model):
        return lambda p, x: model.apply({"params": p, "batch_stats": v["batch_stats"]}, x, mutable=["batch_stats"])[0]

    g32 = jax.jit(jax.grad(loss(_BNNet())))(v["params"], x)
    gac = jax.jit(jax.grad(fmp.autocast(loss(_BNNet()))))(v["params"], x)
    with jax.numpy_dtype_promotion("standard"):  # flax's BatchNorm promotes bfloat16 with float32
        ghand = jax.jit(jax.grad(loss(_BNNet(dtype=jnp.bfloat16))))(v["params"], x)

    def rel(a, r):
        return float(jnp.linalg.norm(a - r) / jnp.linalg.norm(r))

    for (path, r), a, h in zip(
        jax.tree_util.tree_leaves_with_path(g32), jax.tree.leaves(gac), jax.tree.leaves(ghand), strict=True
    ):
        assert a.dtype == jnp.float32
        # as close to float32 as the same network with bfloat16 convolutions cast by hand (flax dtype=)
        assert rel(a, r) <= max(1.5 * rel(h, r), 0.02), (jax.tree_util.keystr(path), rel(a, r), rel(h, r))
