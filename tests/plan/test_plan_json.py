"""A plan saved as JSON reads back equal, and prints a verdict over its table."""

from __future__ import annotations

import json

import pytest

import fmp
from fmp._plan._device import device_of
from fmp._plan._formats import formats_of
from fmp._plan._plan import make_plan
from fmp._plan._search import Measured
from fmp._plan._sites import Site


def _plan():
    own = {"emb": 0.2, "mlp": 0.03, "head": 0.5}

    def measure(a):
        e = sum(own[k] ** 2 for k, f in a.items() if f.name == "float8") ** 0.5
        return Measured(e, e / 2, e)

    sites = [Site(k, ((4096, 8192, 8192), (4096, 8192, 2048))) for k in own]
    return make_plan(
        sites,
        measure,
        budget=0.25,
        formats=formats_of(("float8", "bfloat16", "float32")),
        device=device_of("h100"),
        grads=True,
        framework="jax",
    )


def test_a_plan_round_trips_through_json(tmp_path):
    plan = _plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    back = fmp.Plan.load(path)
    assert back == plan
    assert back.rows[0].gemm == (4096, 8192, 8192)
    assert json.loads(path.read_text())["version"] == 1


def test_a_plan_prints_its_verdict_over_a_table():
    plan = _plan()
    text = str(plan)
    head, table = text.split("\n\n")
    assert head.startswith("precision plan (jax, h100): error ")
    assert "within budget 2.50e-01" in head and "predicted speedup" in head
    assert [line.split()[0] for line in table.splitlines()[2:]] == ["emb", "mlp", "head"]
    assert plan.formats == {"emb": "float8", "mlp": "float8", "head": "bfloat16"}
    assert 1.0 < plan.predicted_speedup < 2.0


def test_a_plan_of_another_version_is_refused():
    data = _plan().to_dict()
    data["version"] = 99
    with pytest.raises(ValueError, match="version 99"):
        fmp.Plan.from_dict(data)
