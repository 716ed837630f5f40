"""The rewrite's cost is linear in the size of the program.

Every analysis the rewrite makes of the original program (a constant's bound, where a value comes from,
whether an operand is a weight, whether a helper call can stay a call) walks values of that program;
each answer is kept, so a value is walked a bounded number of times however long the program is. The
walks count their steps (``_provenance.STEPS``): an unrolled MLP four times as deep takes about four
times the steps, where a walk back through the whole program per equation (a bound of every helper's
operands found anew at every call) would take sixteen times as many.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import fmp
from fmp._autocast._engine._provenance import STEPS

D = 8


def _params(layers: int) -> list[dict[str, jax.Array]]:
    ones, zeros = jnp.ones((D,)), jnp.zeros((D,))
    w1, w2 = jnp.full((D, 2 * D), 0.1), jnp.full((2 * D, D), 0.1)
    return [{"g": ones, "b": zeros, "w1": w1, "b1": jnp.zeros((2 * D,)), "w2": w2, "b2": zeros}] * layers


def _mlp(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    """Pre-LN MLP blocks, unrolled: layernorm, a Dense layer, gelu, a Dense layer, the residual add."""
    for p in params:
        m = x.mean(-1, keepdims=True)
        h = (x - m) * jax.lax.rsqrt(jnp.square(x - m).mean(-1, keepdims=True) + 1e-5) * p["g"] + p["b"]
        x = x + jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    return jnp.mean(x**2)


def _steps(layers: int, policy: str) -> int:
    STEPS.clear()
    jax.make_jaxpr(fmp.autocast(_mlp, policy))(_params(layers), jnp.ones((2, D)))
    return sum(STEPS.values())


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float8"])
def test_walk_steps_grow_linearly_with_depth(policy):
    shallow, deep = _steps(64, policy), _steps(256, policy)
    assert shallow > 64  # the walks ran (a counter nobody increments would pass any ratio)
    assert deep / shallow < 5.0, (shallow, deep)  # linear: ~4x; quadratic: ~16x
