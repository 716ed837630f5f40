"""Fault injection: inf/NaN in random gradient leaves, the loss and aux, for every way to train with fmp.

The fast subset runs a few hundred seeded steps in the default suite; the full 10,500-step run is marked slow
(its figures are in docs/reliability.md, written by bench/reliability_report.py from the same plan).
"""

from __future__ import annotations

import pytest

pytest.importorskip("optax")

from _reliability_jax import JAX_PATHS  # noqa: E402
from _reliability_suite import FULL_PLAN, run_one, run_plan  # noqa: E402

FAST_STEPS = 40  # per path; with p_fault 0.25 about 10 faults each


@pytest.mark.parametrize("path", JAX_PATHS)
def test_jax_path_survives_faults(path):
    c = run_one(path, FAST_STEPS, seed=JAX_PATHS.index(path), p_fault=0.25)
    assert c.corruptions == 0, c.notes
    assert c.injected >= 3 and c.expected_skips >= 2 and c.skipped >= c.expected_skips


@pytest.mark.parametrize("path", ["torch_facade", "torch_accumulate", "fp16_optimizer"])
def test_torch_path_survives_faults(path):
    pytest.importorskip("torch")
    c = run_one(path, FAST_STEPS, seed=7, p_fault=0.25)
    assert c.corruptions == 0, c.notes
    assert c.injected >= 3 and c.expected_skips >= 2 and c.skipped >= c.expected_skips


def test_harness_catches_multisteps_never_recovering():
    # The harness can fail: optax.MultiSteps(loss_scaled(...)) keeps a NaN accumulator after the first bad
    # micro-batch, so it skips effective batches the reference takes.
    c = run_one("multisteps", 80, seed=1, p_fault=0.25)
    assert c.corruptions > 0 and c.skipped > c.expected_skips
    assert any("differ" in n for n in c.notes)


@pytest.mark.slow
def test_full_fault_injection_run():
    pytest.importorskip("torch")
    results, _ = run_plan(FULL_PLAN)
    assert sum(c.steps for c in results) >= 10_000
    for c in results:
        assert c.corruptions == 0, (c.path, c.notes)
        assert c.expected_skips > 0
