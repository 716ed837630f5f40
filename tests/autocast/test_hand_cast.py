"""Every higher-order primitive under autocast computes what the same program cast by hand computes.

Each case is a program and its hand-cast twin: the matmul's inputs cast to bfloat16 where the rule table puts
it in the compute dtype, everything else as the rewrite leaves it (an unlisted op in the dtype it is given, a
mixed add in float32, a loop carry and a custom call's boundary in the dtypes of the original program). The
two are the same computation, so the forward values and the gradients agree to the bit on CPU (``_up`` says how); the float32
program differs from both by a bfloat16 rounding, so a hop whose body were not rewritten fails here. Run on
every JAX version the package claims (each reads its hop's params differently).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import fmp

BF, F32 = jnp.bfloat16, jnp.float32
W = jnp.eye(4) * 0.5 + jnp.linspace(0.0, 0.3, 16).reshape(4, 4)
X = jnp.linspace(-0.5, 1.0, 16).reshape(4, 4)
XS = jnp.linspace(-0.2, 0.4, 12).reshape(3, 4)


def _mm(a, b, cast):
    """``a @ b`` as the rewrite computes it (``cast``: bfloat16 inputs and output) or as written."""
    return a.astype(BF) @ b.astype(BF) if cast else a @ b


def _up(y, cast):
    """A bfloat16 value back in float32, as the rewrite returns it: with a ``reduce_precision`` to bfloat16's
    bits (the identity on it), which keeps XLA on CPU from computing a compiled body's bfloat16 matmul in
    float32 and skipping the rounding (``fmp.autocast`` marks its casts back to float32 this way)."""
    return jax.lax.reduce_precision(y.astype(F32), exponent_bits=8, mantissa_bits=7) if cast else y


def scan(x, w, cast=False):
    def body(c, xi):  # the carry stays float32: the body returns a float32 sum
        return _up(jnp.tanh(_mm(c, w, cast)), cast) + xi, jnp.sum(c)

    return jax.lax.scan(body, x, XS)


def fori(x, w, cast=False):  # the body returns bfloat16 for a float32 carry: the carry is kept float32
    return jax.lax.fori_loop(0, 3, lambda i, c: _up(jnp.tanh(_mm(c, w, cast)), cast), x)


def while_(x, w, cast=False):
    def body(c):
        return _up(jnp.tanh(_mm(c[0], w, cast)), cast), c[1] + 1

    return jax.lax.while_loop(lambda c: c[1] < 3, body, (x, 0))[0]


def cond(x, w, cast=False):  # the branches disagree (bfloat16 / float32): the output is float32
    return jax.lax.cond(jnp.sum(x) > 0, lambda a: _up(_mm(a, w, cast), cast), lambda a: a * 2.0, x)


def remat(x, w, cast=False):
    return _up(jax.checkpoint(lambda a: jnp.sin(_mm(a, w, cast)))(x), cast)


def _cjvp(cast):
    @jax.custom_jvp
    def f(x, w):  # the call keeps its float32 boundary; its body and its jvp rule are rewritten
        return _up(jnp.tanh(_mm(x, w, cast)), cast)

    @f.defjvp
    def f_jvp(primals, tangents):
        (x, w), (tx, tw) = primals, tangents
        y = jnp.tanh(_mm(x, w, cast))
        dy = (1.0 - y**2) * (_mm(tx, w, cast) + _mm(x, tw, cast))
        return _up(y, cast), _up(dy, cast)

    return f


def custom_jvp(x, w, cast=False):
    return _cjvp(cast)(x, w)


def _cvjp(cast):
    @jax.custom_vjp
    def f(x, w):
        return _up(jnp.tanh(_mm(x, w, cast)), cast)

    def fwd(x, w):  # the residuals keep the float32 of the fwd rule's outputs
        y = f(x, w)
        return y, (x, w, y)

    def bwd(res, g):  # run under the forward's policy: the matmuls in bfloat16, the outputs as the rule gives
        x, w, y = res
        d = g * (1.0 - y**2)
        return _up(_mm(d, w.T, cast), cast), _up(_mm(x.T, d, cast), cast)

    f.defvjp(fwd, bwd)
    return f


def custom_vjp(x, w, cast=False):
    return _cvjp(cast)(x, w)


def shard_map(x, w, cast=False):
    mesh = jax.make_mesh((1,), ("d",))
    body = lambda a, b: jax.lax.psum(_mm(a, b, cast), "d")  # noqa: E731
    return _up(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P())(x, w), cast)


CASES = {f.__name__.rstrip("_"): f for f in (scan, fori, while_, cond, remat, custom_jvp, custom_vjp, shard_map)}


def _loss(fn):
    return lambda x, w: sum(jnp.sum(jnp.sin(o)) for o in jax.tree.leaves(fn(x, w)))


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_equals_hand_cast(name: str) -> None:
    fn = CASES[name]
    out = fmp.autocast(fn)(X, W)
    hand = fn(X, W, cast=True)
    ref = fn(X, W)
    for o, h, r in zip(jax.tree.leaves(out), jax.tree.leaves(hand), jax.tree.leaves(ref), strict=True):
        assert o.dtype == r.dtype
        np.testing.assert_array_equal(np.asarray(o), np.asarray(h))
    assert any(
        not np.array_equal(np.asarray(h), np.asarray(r))
        for h, r in zip(jax.tree.leaves(hand), jax.tree.leaves(ref), strict=True)
    )


def _derivative(name: str, loss):
    """Reverse mode; forward mode for while_loop, which JAX cannot reverse-differentiate."""
    if name == "while":
        return lambda x, w: jax.jvp(loss, (x, w), (jnp.ones_like(x), W))[1:]
    return jax.grad(loss, argnums=(0, 1))


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradient_equals_hand_cast(name: str) -> None:
    fn = CASES[name]
    g = _derivative(name, _loss(fmp.autocast(fn)))(X, W)
    gh = _derivative(name, _loss(lambda x, w: fn(x, w, cast=True)))(X, W)
    gr = _derivative(name, _loss(fn))(X, W)
    for a, h in zip(g, gh, strict=True):
        assert a.dtype == F32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(h))
    assert any(not np.array_equal(np.asarray(h), np.asarray(r)) for h, r in zip(gh, gr, strict=True))


def test_explain_and_compare_on_a_layer_scanned_linen_model() -> None:
    """nn.scan over remat'ed blocks (a scan primitive holding a checkpoint): explain lists the body's matmul
    once, in bfloat16, and explain(compare=True) measures it over the three layers."""
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return x + nn.tanh(nn.Dense(4)(x)), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            scan = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
            return scan()(x, None)[0]

    model = Stack()
    params = model.init(jax.random.key(0), X)

    def loss(p, x):
        return jnp.sum(model.apply(p, x) ** 2)

    plain = fmp.explain(loss)(params, X)
    (mm,) = [r for r in plain.records if r.op == "dot_general"]
    assert mm.in_after == ("bfloat16", "bfloat16")
    rep = fmp.explain(loss, compare=True)(params, X)
    assert [(r.op, r.category) for r in rep.records] == [(r.op, r.category) for r in plain.records]
    (mm,) = [r for r in rep.records if r.op == "dot_general"]
    assert mm.iterations == 3 and 0 < mm.added_error < 2**-7
    np.testing.assert_allclose(float(fmp.autocast(loss)(params, X)), float(loss(params, X)), rtol=2e-2)
