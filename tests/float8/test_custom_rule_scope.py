"""The float8 scope rule in a custom derivative's rule: a custom_jvp's jvp rule and a custom_vjp's fwd rule take
the weights of the call's operands, whether JAX asks for the rule while the rewrite runs (eager ``grad``) or
after it returned (``grad`` or ``jvp`` of a ``jit``); a jvp rule's tangent products stay out of float8."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from _helpers.jaxprs import all_eqns

import fmp

D = 32


def _args():
    w = jax.random.normal(jax.random.key(0), (D, D)) / 4
    x = jax.random.normal(jax.random.key(2), (8, D))
    return w, x


def _float8_operands(closed) -> int:
    """How many matmul operands are quantised to e4m3 (two per float8 product; a gradient goes to e5m2)."""
    return sum(1 for e in all_eqns(closed) for v in e.outvars if str(v.aval.dtype) == "float8_e4m3fn")


@jax.custom_jvp
def _linear(x, w):
    return x @ w


@_linear.defjvp
def _linear_jvp(primals, tangents):
    x, w = primals
    tx, tw = tangents
    return x @ w, tx @ w + x @ tw


def _jvp_loss(w, x):
    return jnp.sum(jnp.tanh(_linear(jnp.tanh(x), w)) ** 2)


def _ways(loss, policy="mixed_float8"):
    f = fmp.autocast(loss, policy)
    return {
        "grad": jax.value_and_grad(f),
        "grad of jit": jax.value_and_grad(jax.jit(f)),
        "jvp": lambda w, x: jax.jvp(lambda w: f(w, x), (w,), (w,)),
        "jvp of jit": lambda w, x: jax.jvp(lambda w: jax.jit(f)(w, x), (w,), (w,)),
    }


def _check(loss, ways, policy="mixed_float8"):
    w, x = _args()
    forward = _float8_operands(jax.make_jaxpr(fmp.autocast(loss, policy))(w, x))
    want = jax.tree.leaves(ways["grad"](w, x))[0]
    for name, way in ways.items():
        assert _float8_operands(jax.make_jaxpr(way)(w, x)) == forward, name
        np.testing.assert_allclose(jax.tree.leaves(way(w, x))[0], want, rtol=1e-6, err_msg=name)
    return forward


def test_jvp_rule_decides_as_the_primal_body_eager_and_jitted():
    # tanh(x) @ w: a weight operand, in float8 in the primal body and in the rule, eager or jitted; the rule's
    # tangent products (tx @ w, x @ tw) stay bfloat16, so reverse mode can transpose them
    assert _check(_jvp_loss, _ways(_jvp_loss)) == 2
    w, x = _args()
    got = jax.grad(fmp.autocast(_jvp_loss, "mixed_float8"))(w, x)
    ref = jax.grad(_jvp_loss)(w, x)
    assert float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref)) < 0.1


def test_jvp_rule_tangent_products_stay_out_of_float8_with_activations_true():
    # every product of the primal body is in float8, the rule's tangent products still are not (else reverse
    # mode fails to transpose the float8 product's custom_vjp)
    policy = dataclasses.replace(fmp.get_policy("mixed_float8"), float8=fmp.Float8Recipe(activations=True))
    assert _check(_jvp_loss, _ways(_jvp_loss, policy), policy) == 2


@jax.custom_vjp
def _mixer(h, w):
    return (h @ h.T) @ (h @ w)


def _mixer_fwd(h, w):
    return _mixer(h, w), (h, w)


@fmp.bwd_as_written  # its products are not counted: as written, in float32
def _mixer_bwd(res, g):
    h, w = res
    return jax.vjp(lambda h, w: (h @ h.T) @ (h @ w), h, w)[1](g)


_mixer.defvjp(_mixer_fwd, _mixer_bwd)


def _vjp_loss(w, x):
    return jnp.sum(jnp.tanh(_mixer(jnp.tanh(x), w)) ** 2)


def test_fwd_rule_decides_as_the_primal_body_eager_and_jitted():
    # h @ w has a weight operand: float8; h @ h.T and the product of their results are activation x activation:
    # bfloat16, in the fwd rule as in the primal body (a fwd rule JAX asks for after the rewrite returned took
    # every input for a weight)
    ways = _ways(_vjp_loss)
    grads = {k: ways[k] for k in ("grad", "grad of jit")}
    assert _check(_vjp_loss, grads) == 2
