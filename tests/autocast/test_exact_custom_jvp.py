"""``jax.nn.relu`` and other custom_jvp helpers that only pick values run in the dtype they are given.

A custom_jvp call keeps its original boundary types, so a bfloat16 value going through ``jax.nn.relu`` used to
be cast up to float32 and back down by the matmul after it. A call whose body and jvp rule only compare, select
and move values (``_hops._exact``) now runs in its input's dtype when its output goes to an op that casts it
anyway: the same bits, forward and backward, with the converts hand-cast code has.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers.jaxprs import all_eqns, rewritten

import fmp
from fmp._autocast._engine._cast import is_rounding
from fmp._autocast._hops import _exact

KEY = jax.random.key(0)
P = {
    "w1": jax.random.normal(KEY, (16, 32)) / 4,
    "b1": jnp.linspace(-1.0, 1.0, 32),
    "w2": jax.random.normal(jax.random.key(1), (32, 16)) / 6,
}
X = jax.random.normal(jax.random.key(2), (8, 16))


def relu_mlp(p, x):
    return jnp.mean(jnp.exp(jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"]))


def relu6_mlp(p, x):
    return jnp.mean(jnp.exp(jax.nn.relu6(4 * (x @ p["w1"] + p["b1"])) @ p["w2"]))


def relu_squared(p, x):  # the square (unlisted) would run in the dtype relu gives it: relu stays float32
    return jnp.mean(jax.nn.relu(x @ p["w1"] + p["b1"]) ** 2)


@jax.custom_jvp
def leaky(x):
    return jnp.maximum(x, 0.0)


@leaky.defjvp
def _leaky_jvp(primals, tangents):  # a rule that computes (scales the tangent): not an exact one
    (x,), (t,) = primals, tangents
    return leaky(x), jnp.where(x > 0, t, 0.01 * t)


def leaky_mlp(p, x):
    return jnp.mean(leaky(x @ p["w1"] + p["b1"]) @ p["w2"])


def _relu_in(fn, policy="mixed_bfloat16"):
    """Input dtypes of the program's custom_jvp calls (not float16's rounding marks, ``_cast.is_rounding``)."""
    calls = [e for e in all_eqns(rewritten(fn, P, X, policy=policy)) if e.primitive.name == "custom_jvp_call"]
    return [tuple(np.dtype(v.aval.dtype).name for v in e.invars) for e in calls if not is_rounding(e)]


@pytest.mark.parametrize("policy,low", [("mixed_bfloat16", "bfloat16"), ("mixed_float16", "float16")])
@pytest.mark.parametrize("fn", [relu_mlp, relu6_mlp], ids=["relu", "relu6"])
def test_value_picking_helper_runs_in_its_input_dtype(fn, policy, low):
    assert _relu_in(fn, policy) == [(low,)]


@pytest.mark.parametrize("fn", [relu_squared, leaky_mlp], ids=["unlisted-consumer", "computing-rule"])
def test_other_calls_keep_their_boundary(fn):
    assert _relu_in(fn) == [("float32",)]


def _results(fn, policy):
    f = fmp.autocast(fn, policy)
    second = jax.grad(lambda p, x: jnp.sum(jax.grad(f, argnums=1)(p, x)))  # relu's rule differentiated
    return [jax.jit(jax.value_and_grad(f))(P, X), jax.value_and_grad(f)(P, X), jax.jit(second)(P, X)]


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("fn", [relu_mlp, relu6_mlp], ids=["relu", "relu6"])
def test_same_bits_as_the_call_kept_in_float32(fn, policy, monkeypatch):
    new = _results(fn, policy)
    monkeypatch.setattr(_exact, "input_dtype", lambda *a: None)  # every custom_jvp call at its own boundary
    old = _results(fn, policy)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
