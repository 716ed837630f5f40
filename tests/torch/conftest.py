"""Fixtures of the torch facade's tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def dist_results():
    """Every multi-process suite, run once on 2 local ranks (gloo); ``[rank0, rank1]`` of ``{suite: results}``."""
    pytest.importorskip("torch")
    from tests.torch.dist_launch import launch

    return launch("tests.torch.dist_worker", "group", "found_inf", "sharded", timeout=420)
