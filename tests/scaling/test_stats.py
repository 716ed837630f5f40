"""fmp.optax.scaler_stats: host-side numbers from a loss_scaled state, nested anywhere; run_processes' cleanup."""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import pytest

optax = pytest.importorskip("optax")

from _helpers.common import optax_not_strict, run_processes  # noqa: E402

import fmp  # noqa: E402
import fmp.optax  # noqa: E402


@optax_not_strict
def test_reads_the_state_inside_master_weights_and_accumulate_after_jitted_steps():
    opt = fmp.optax.master_weights(fmp.optax.accumulate(fmp.optax.loss_scaled(optax.adam(0.1)), 2))
    params = {"w": jnp.ones(3, jnp.bfloat16)}
    state = opt.init(params)
    step = jax.jit(lambda g, s, p: opt.update(g, s, p))
    good, bad = {"w": jnp.ones(3, jnp.bfloat16)}, {"w": jnp.array([1.0, jnp.inf, 1.0], jnp.bfloat16)}
    stats = []
    for g in (good, good, bad, good, bad, good):  # effective batches: good, bad, bad
        _, state = step(g, state, params)
        stats.append(fmp.optax.scaler_stats(state))
    inner = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, fmp.optax.LossScaledState))
    inner = [x for x in inner if isinstance(x, fmp.optax.LossScaledState)][0]
    assert stats[-1] == {
        "loss_scale": float(inner.scaler.loss_scale),
        "skipped_steps": int(inner.skipped_steps),
        "consecutive_skipped": int(inner.consecutive_skipped),
    }
    assert [s["skipped_steps"] for s in stats] == [0, 0, 0, 1, 1, 2]
    assert stats[-1] == {"loss_scale": 2.0**14, "skipped_steps": 2, "consecutive_skipped": 2}
    assert all(type(v) in (float, int) for s in stats for v in s.values())  # Python numbers, not arrays


def test_refuses_a_state_without_or_with_two_loss_scaled_states():
    p = jnp.zeros(2)
    with pytest.raises(ValueError, match="no fmp.optax.loss_scaled state"):
        fmp.optax.scaler_stats(optax.sgd(0.1).init(p))
    two = optax.chain(fmp.optax.loss_scaled(optax.sgd(0.1)), fmp.optax.loss_scaled(optax.sgd(0.1)))
    with pytest.raises(ValueError, match="holds 2 loss_scaled states"):
        fmp.optax.scaler_stats(two.init(p))


def test_run_processes_kills_the_peers_of_a_failed_process():
    """The launcher of the multi-process tests: one process fails, its peer (blocked, as on a collective) dies."""
    scripts = ["import time; time.sleep(120)", "import sys; print('bye'); sys.exit(3)"]
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"(?s)a process failed.*process 0: exit -9.*process 1: exit 3.*bye"):
        run_processes(lambda i: [sys.executable, "-c", scripts[i]], 2, env={}, timeout=60)
    assert time.monotonic() - t0 < 30
    with pytest.raises(AssertionError, match="timed out after 1 s"):
        run_processes(lambda i: [sys.executable, "-c", scripts[0]], 2, env={}, timeout=1)
