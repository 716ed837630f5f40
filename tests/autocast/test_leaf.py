"""The leaf rules decide once: what ``keeps`` says of an equation (the shortcut that gives a body back as
written) is what ``leaf`` does to it, the re-decision of a contraction that sums one element per output
included."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import fmp
from fmp._autocast import _leaf
from fmp._autocast._transform import configure, make_context

F32, BF16 = jnp.float32, jnp.bfloat16


def _ones(shape, dtype=F32):
    return jnp.ones(shape, dtype)


PROGRAMS = {
    "outer product": (lambda a, b: jnp.einsum("i,j->ij", a, b), (_ones(8), _ones(4)), True),
    "outer product, bfloat16": (lambda a, b: jnp.einsum("i,j->ij", a, b), (_ones(8, BF16), _ones(4, BF16)), True),
    "matmul": (lambda a, b: a @ b, (_ones((4, 8)), _ones((8, 4))), False),
    "exp": (jnp.exp, (_ones(8),), True),
    "exp, bfloat16": (jnp.exp, (_ones(8, BF16),), False),
    "scalar times": (lambda a: 2.0 * a, (_ones(8),), True),
}


def _signature(closed):
    return [(e.primitive.name, [str(v.aval.dtype) for v in e.invars]) for e in closed.jaxpr.eqns]


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_keeps_says_what_leaf_does(name):
    fn, args, kept = PROGRAMS[name]
    closed = jax.make_jaxpr(fn)(*args)
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name not in ("broadcast_in_dim", "reshape")]
    ctx = make_context(configure("mixed_bfloat16"))
    assert _leaf.keeps(eqn, ctx, ctx.policy) is kept
    unchanged = _signature(fmp.autocast_jaxpr(closed, "mixed_bfloat16")) == _signature(closed)
    if kept:  # kept: the rewrite gives the equation back as written (no cast, no new parameter)
        assert unchanged
    if name in ("exp, bfloat16", "matmul"):
        assert not unchanged and not kept  # a float32 op of a bfloat16 value, a matmul of float32 ones: cast


def test_keeps_and_leaf_read_one_decision(monkeypatch):
    calls = []
    decision = _leaf._decision
    monkeypatch.setattr(_leaf, "_decision", lambda *a: calls.append(a[0].primitive.name) or decision(*a))
    fn, args, _ = PROGRAMS["outer product"]
    closed = jax.make_jaxpr(fn)(*args)
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "dot_general"]
    ctx = make_context(configure("mixed_bfloat16"))
    assert _leaf.keeps(eqn, ctx, ctx.policy)
    fmp.autocast_jaxpr(closed, "mixed_bfloat16")
    assert calls == ["dot_general", "dot_general"]  # once for keeps, once for the rewrite
