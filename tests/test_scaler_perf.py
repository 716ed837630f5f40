"""Hot path of loss scaling: NaN detection in large leaves, and the deterministic cost of the compiled
post-gradient step (bytes accessed, temporaries), read from XLA's cost and memory analyses."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import ROOT

import fmp
import fmp.optax


def _bench():
    spec = importlib.util.spec_from_file_location("fmp_bench_scaler", ROOT / "bench" / "scaler.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


B = _bench()


# --- NaN in large leaves --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
@pytest.mark.parametrize("size", [1 << 14, 1 << 16, 300_001])
def test_all_finite_sees_nan_in_large_leaves(dtype, bad, size):
    # XLA CPU's max-reduction over 16384+ elements drops NaN (jax 0.10.2): a check built on max|g|
    # passed NaN gradients as finite. Every position class: first, middle, last element.
    x = jnp.ones((size,), dtype)
    assert bool(jax.jit(fmp.all_finite)({"w": x}))
    for i in (0, size // 2 + 1, size - 1):
        assert not bool(jax.jit(fmp.all_finite)({"w": x.at[i].set(bad)})), (i, bad)


def test_nonfinite_leaves_sees_nan_in_a_large_leaf():
    g = {"big": jnp.ones((300, 300)).at[150, 7].set(jnp.nan), "ok": jnp.ones((300, 300))}
    assert fmp.nonfinite_leaves(g) == ["['big']"]


@pytest.mark.parametrize("huge", [3.0e38, -3.0e38])
def test_all_finite_accepts_the_largest_finite_values(huge):
    # the check multiplies by zero: a huge finite gradient must not read as an overflow
    x = jnp.zeros((1 << 15,)).at[5].set(huge)
    assert bool(jax.jit(fmp.all_finite)(x))
    assert bool(fmp.all_finite(x.astype(jnp.bfloat16)))


def test_loss_scaled_skips_a_nan_in_a_large_leaf():
    opt = fmp.optax.loss_scaled(optax.sgd(0.1), fmp.GradScaler(init_scale=4.0))
    params = {"w": jnp.ones((200, 200))}
    state = opt.init(params)
    updates, state = jax.jit(opt.update)({"w": jnp.ones((200, 200)).at[3, 3].set(jnp.nan)}, state, params)
    assert int(state.skipped_steps) == 1
    assert bool(jnp.all(updates["w"] == 0))
