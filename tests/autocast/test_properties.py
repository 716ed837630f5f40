"""Property tests: random small programs mixing the higher-order primitives autocast rewrites.

A program is a random tree of ops. Leaves act on a float32 state (matmuls,
exponentials, normalisations, ...); inner nodes wrap their children in ``jit``,
``scan``, ``fori_loop`` (while), ``cond``, ``checkpoint`` or a ``custom_jvp``.
Every op also advances an independent float64 and int32 state through the same
control flow, which autocast must never change.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers.jaxprs import in_dtypes

import fmp

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

LEAVES = ["dot", "exp", "norm", "softmax", "bias", "tanh", "astype_bf16"]
NODES = ["jit", "scan", "fori", "cond", "remat", "custom_jvp"]

programs = st.recursive(
    st.sampled_from(LEAVES),
    lambda children: st.tuples(st.sampled_from(NODES), st.lists(children, min_size=1, max_size=3)),
    max_leaves=6,
)


def _leaf(op, x, w, b):
    if op == "dot":
        return jnp.tanh(x @ w)
    if op == "exp":
        return jnp.exp(jnp.clip(x, -2.0, 2.0)) / 4.0
    if op == "norm":
        return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1.0)
    if op == "softmax":
        return jax.nn.softmax(x, axis=-1) * 4.0
    if op == "bias":
        return x + b
    if op == "tanh":
        return jnp.tanh(x * 1.5)
    if op == "astype_bf16":  # a user's explicit round trip: respected as written
        return x.astype(jnp.bfloat16).astype(jnp.float32)
    raise AssertionError(op)


def _side(d, n, w64):
    """The float64 and int32 states: must come out bitwise unchanged."""
    return jnp.tanh(d @ w64), (n * 3 + 1) % 97


def _apply(prog, state, params):
    x, d, n = state
    w, b, w64 = params
    if isinstance(prog, str):
        d, n = _side(d, n, w64)
        return _leaf(prog, x, w, b), d, n
    kind, children = prog

    def seq(s):
        for c in children:
            s = _apply(c, s, params)
        return s

    if kind == "jit":
        return jax.jit(seq)(state)
    if kind == "scan":
        return jax.lax.scan(lambda s, _: (seq(s), None), state, None, length=2)[0]
    if kind == "fori":
        return jax.lax.fori_loop(0, 2, lambda i, s: seq(s), state)
    if kind == "cond":
        return jax.lax.cond(x[0, 0] > 0, seq, lambda s: (s[0] * 0.5, *_side(s[1], s[2], w64)), state)
    if kind == "remat":
        return jax.checkpoint(seq)(state)
    if kind == "custom_jvp":
        f = jax.custom_jvp(lambda x, d, n: seq((x, d, n)))
        f.defjvp(lambda p, t: (f(*p), (t[0] * 0.5, t[1], t[2])))
        return f(x, d, n)
    raise AssertionError(kind)


def _inputs():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    f32 = jnp.float32
    x = jax.random.uniform(k1, (4, 8), f32, minval=-1.0, maxval=1.0)
    w = jnp.eye(8, dtype=f32) * 0.6 + jax.random.normal(k2, (8, 8), f32) * 0.1
    b = jax.random.normal(k3, (8,), f32) * 0.1
    d = jnp.linspace(-1.0, 1.0, 32, dtype=jnp.float64).reshape(4, 8)
    w64 = jnp.eye(8, dtype=jnp.float64) * 0.5
    n = jnp.arange(32, dtype=jnp.int32).reshape(4, 8)
    return (x, d, n), (w, b, w64)


def _check(prog):
    with jax.enable_x64(True):
        state, params = _inputs()
        fn = lambda s, p: _apply(prog, s, p)  # noqa: E731
        ref = jax.jit(fn)(state, params)
        # 1. traces, and every matmul in the rewritten program runs in bfloat16
        cj = jax.make_jaxpr(fmp.autocast(fn))(state, params)
        dots = in_dtypes(cj, "dot_general")
        assert all(t in (("bfloat16", "bfloat16"), ("float64", "float64")) for t in dots), dots
        out = jax.jit(fmp.autocast(fn))(state, params)
        # 2. float64 and integer results unchanged
        np.testing.assert_array_equal(out[1], ref[1])
        np.testing.assert_array_equal(out[2], ref[2])
        assert [o.dtype for o in out] == [r.dtype for r in ref]
        # 3. bitwise identity under the float32 policy
        same = jax.jit(fmp.autocast(fn, "float32"))(state, params)
        for a, r in zip(same, ref, strict=True):
            np.testing.assert_array_equal(a, r)
        # 4. close to float32 on well-conditioned inputs (bounded ops, contracting matmuls)
        np.testing.assert_allclose(out[0], ref[0], rtol=0.05, atol=0.05)


@hypothesis.settings(max_examples=6, deadline=None, derandomize=True)
@hypothesis.given(programs)
def test_random_programs(prog):
    _check(prog)


@pytest.mark.slow
@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(programs)
def test_random_programs_many(prog):
    _check(prog)
