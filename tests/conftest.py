"""Test configuration: strict dtype promotion, markers, GPU skipping, shared fixtures.

The suite runs in parallel with pytest-xdist (``python -m pytest -n auto``; ``--dist loadgroup`` is in
pyproject.toml's addopts). Tests are independent (each worker is its own process with its own temporary folders,
subprocesses get their own environment) except those marked ``xdist_group("processes")``: they start processes
that meet on a localhost port (jax.distributed, torch.distributed gloo, examples/multiprocess.py), and the
session or module fixtures that launch them run once per worker. One worker runs that whole group, one launch
at a time, so no two launches race for a port, starve each other past a collective's timeout or run twice.
A test file whose module-scoped fixture is costly (a model compared, a plan searched, an example's run)
marks the tests that use it with an ``xdist_group`` of its own, so one worker computes it, not both.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys

# Set before any test module imports torch. Under pytest-xdist with a worker per core (`-n auto`, as CI and the
# README run the suite) torch's default of one intra-op thread per core puts twice as many busy threads as cores
# on the machine, and OpenMP threads spin while they wait: next to other work on the 2-core machine, 60 steps of
# examples/low_precision_training.py's torch runs took 45 s of CPU with 2 threads and 12 s with 1 (same losses).
# One thread per worker, and in the processes the tests start (they inherit it); an OMP_NUM_THREADS already set
# is kept.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")) >= (os.cpu_count() or 1):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax  # noqa: E402
import pytest  # noqa: E402


class _TorchNotInstalled(importlib.abc.MetaPathFinder):
    """tests/ is on sys.path (the suite imports its helpers by bare name), so where torch is not installed
    `import torch` would find the tests/torch folder as an empty namespace package and every
    `pytest.importorskip("torch")` would pass. This finder makes it fail as a missing torch does (a None in
    sys.modules would not do: libraries such as scipy read sys.modules["torch"] as a module)."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            raise ModuleNotFoundError("No module named 'torch'", name="torch")
        return None


_torch = importlib.util.find_spec("torch")
if _torch is not None and _torch.origin is None:  # a namespace package: the tests/torch folder
    sys.meta_path.insert(0, _TorchNotInstalled())

# Silent upcasts are exactly the kind of bug fmp exists to prevent: make them errors.
jax.config.update("jax_numpy_dtype_promotion", "strict")


@functools.cache
def _has_gpu() -> bool:
    try:
        if jax.devices("gpu"):
            return True
    except RuntimeError:
        pass
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none found by jax or torch)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _strict_promotion():
    """Every test starts and ends with strict promotion (a test may not leave it relaxed)."""
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    yield
    assert jax.config.jax_numpy_dtype_promotion == "strict", "a test left dtype promotion relaxed"


_MSG_GROUP_LOST = (
    "pytest-xdist did not keep this test's xdist_group: with this pytest and pytest-xdist its processes could run "
    "on both workers at once. Install the versions that the dev extra allows (pip install -e '.[dev]') or run "
    "without -n."
)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under ``--dist loadgroup`` pytest-xdist tags a grouped test's id with ``@group``; pytest-xdist 3.8 under
    pytest 9.2 drops the tag, and the groups, without a word. Such a test fails here, before its fixtures start
    any process."""
    if getattr(item.config.option, "loadgroup", False) and item.get_closest_marker("xdist_group"):
        if "@" not in item.nodeid:
            pytest.fail(_MSG_GROUP_LOST, pytrace=False)
