"""JAX on 2 processes x 4 CPU devices (``jax.distributed`` over localhost, gloo collectives): one skip decision.

One pair of processes runs every scenario of ``tests/scaling/_jax_multiprocess_worker.py`` (start-up is the cost): a
loss-scaled step through ``fmp.value_and_grad``, ``fmp.optax.loss_scaled`` around a clipped AdamW with params
sharded across both processes, ``master_weights(accumulate(loss_scaled(adamw)))`` on bfloat16 params,
``shard_map`` with and without ``axis_name``, ``fmp.nonfinite_leaves`` and an orbax checkpoint written by both
processes and resumed. The faults (an inf in a batch row or a gradient) live on process 1 only.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from _helpers.common import ROOT, free_port, run_processes

pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")

pytestmark = pytest.mark.xdist_group("processes")  # see tests/conftest.py

NPROC = 2
WORKER = ROOT / "tests" / "scaling" / "_jax_multiprocess_worker.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    ckpt, port = tmp_path_factory.mktemp("ckpt"), str(free_port())
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    outs = run_processes(
        lambda i: [sys.executable, str(WORKER), str(i), str(NPROC), port, str(ckpt)], NPROC, env=env, timeout=300
    )
    lines = [[x for x in out.splitlines() if x.startswith("RESULT ")] for out in outs]
    assert all(lines), outs
    return [json.loads(found[-1][len("RESULT ") :]) for found in lines]


@pytest.mark.gallery
def test_every_process_reaches_the_same_decisions_and_bits(results):
    r0, r1 = results
    assert r0["devices"] == 8 and r0["local_devices"] == r1["local_devices"] == 4
    # only process 1 holds the inf of the nonfinite_leaves scenario, both processes name the leaf
    assert (r0.pop("local_shards_with_inf"), r1.pop("local_shards_with_inf")) == (0, 1)
    # everything else, the digests of the raw bytes of every final param included, is equal across processes
    assert r0 == r1


@pytest.mark.gallery
def test_the_fault_on_one_process_skips_the_step_everywhere(results):
    r = results[0]
    vag = r["value_and_grad"]  # the bad batches are steps 2 and 4; growth_interval=2
    assert vag["finite"] == [True, True, False, True, False, True]
    assert vag["scales"] == [1024.0, 2048.0, 1024.0, 1024.0, 512.0, 512.0]
    assert r["loss_scaled_adamw"]["skipped"] == [0, 0, 1, 1, 2, 2]
    assert r["loss_scaled_adamw"]["stats"] == {"loss_scale": 256.0, "skipped_steps": 2, "consecutive_skipped": 0}
    # accumulate(k=2) skips the effective batch holding the bad micro-batch, at its last micro-step
    assert r["master_accumulate"]["skipped"] == [0, 0, 0, 1, 1, 2]
    assert r["nonfinite_leaves"] == ["['w1']"]


@pytest.mark.gallery
def test_multiprocess_matches_one_device(results):
    """The same steps computed by one process alone on one device: same decisions, same params up to rounding."""
    r = results[0]
    for name in ("value_and_grad", "loss_scaled_adamw", "master_accumulate"):
        assert all(r[name]["same_as_one_device"].values()), (name, r[name])
    # float16 autocast (value_and_grad) rounds differently when the batch mean is reduced across devices
    assert r["value_and_grad"]["max_abs_diff_to_one_device"] < 1e-3
    assert r["loss_scaled_adamw"]["max_abs_diff_to_one_device"] < 1e-6
    assert r["master_accumulate"]["max_abs_diff_to_one_device"] < 1e-2  # bfloat16 params: one ulp near 1


@pytest.mark.gallery
def test_shard_map_needs_axis_name(results):
    r = results[0]
    # device 6 (process 1) holds the inf after the gradient all-reduce: with axis_name nobody steps
    assert r["shard_map_axis"] == {"moved": [False] * 8, "scales": [512.0] * 8}
    # without it the devices diverge, across processes too
    assert r["shard_map_no_axis"]["moved"] == [True] * 6 + [False, True]
    assert r["shard_map_no_axis"]["scales"] == [1024.0] * 6 + [512.0, 1024.0]


@pytest.mark.gallery
def test_orbax_checkpoint_written_by_both_processes_resumes_bitwise(results):
    ck = results[0]["checkpoint"]
    assert ck["resumed_digest"] == ck["uninterrupted_digest"]
    assert ck["stats"][0] == ck["stats"][1]
    assert results[0]["checkpoint_shardings_kept"] == ["P(None, 'd')", "P()"]


@pytest.mark.gallery
def test_scaler_stats_refuses_a_counter_sharded_across_processes(results):
    msg = results[0]["stats_error"]
    assert msg and "skipped_steps is a global array" in msg and "process_allgather" in msg


@pytest.mark.gallery
def test_check_scaler_health_on_global_arrays(results):
    r = results[0]
    assert r["health_ok"] is True
    healthy, msg = r["health_alarm"]
    assert healthy is False and "1 non-finite steps in a row" in msg and "[\"['w1']\"]" in msg, msg
