"""Test configuration: strict dtype promotion, markers, GPU skipping, shared fixtures."""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys

import jax
import pytest


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
