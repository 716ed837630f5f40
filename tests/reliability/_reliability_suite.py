"""The fault-injection plan shared by the slow test and ``bench/reliability_report.py`` (one source of figures)."""

from __future__ import annotations

import time

from _reliability_jax import JAX_PATHS, Counts
from _reliability_jax import run_path as run_jax

# (micro-)steps per path in the full run: 10,500 in all. Seeds are fixed so the figures are reproducible.
FULL_PLAN: dict[str, int] = {
    "value_and_grad": 1500,
    "loss_scaled": 1500,
    "skip_nonfinite": 1500,
    "accumulate": 1500,
    "master_weights": 1500,
    "torch_facade": 1000,
    "torch_accumulate": 1000,
    "fp16_optimizer": 1000,
}
P_FAULT = 0.1


def run_one(path: str, steps: int, seed: int, p_fault: float = P_FAULT) -> Counts:
    if path in JAX_PATHS or path == "multisteps":
        return run_jax(path, steps, seed, p_fault)
    from _reliability_torch import run_path as run_torch

    return run_torch(path, steps, seed, p_fault)


def run_plan(plan: dict[str, int], seed0: int = 1000, p_fault: float = P_FAULT) -> tuple[list[Counts], float]:
    """Runs every path of ``plan``; returns the counts and the wall time in seconds."""
    t0 = time.perf_counter()
    out = [run_one(path, steps, seed0 + i, p_fault) for i, (path, steps) in enumerate(plan.items())]
    return out, time.perf_counter() - t0
