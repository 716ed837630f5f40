"""Test configuration: strict dtype promotion, markers, GPU skipping, shared fixtures."""

from __future__ import annotations

import functools

import jax
import pytest

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
