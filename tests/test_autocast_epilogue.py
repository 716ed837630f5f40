"""The epilogue rule: a bias add after a lower_precision op runs in the compute dtype (torch's linear/addmm)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from autocast_helpers import all_eqns

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
