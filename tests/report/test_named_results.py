"""The comparison core's results are named, and both frameworks fill their rows through one function."""

from __future__ import annotations

import ast
import dataclasses

import numpy as np
import pytest
from _helpers.common import ROOT

from fmp._report import _blame, _compare
from fmp._report._records import OpRecord


def test_stats_are_the_row_fields_of_their_names():
    assert set(_compare.Stats._fields) <= {f.name for f in dataclasses.fields(OpRecord)}
    row = OpRecord(0, "exp", "", "", "float32", ("bfloat16",), ("bfloat16",), ("bfloat16",), ("bfloat16",))
    stats = _compare.Stats(0.25, 12.0, 0.5, False, 3, 2.0)
    got = _compare.with_stats(row, stats, 0.125)
    assert [getattr(got, name) for name in stats._fields] == list(stats) and got.added_error == 0.125


def test_parts_and_stats_come_back_named():
    r = np.array([1.0, 2.0, 4.0])
    p = np.array([1.0, 2.0, 5.0])
    parts = _compare.array_parts(np, p, r)
    assert isinstance(parts, _compare.Parts) and float(parts.ref_max) == 4.0 and float(parts.diff_max) == 1.0
    stats = _compare.combine([parts], flips=2)
    assert isinstance(stats, _compare.Stats)
    assert stats.flips == 2 and stats.ref_max == 4.0 and stats.max_abs_error == 1.0
    assert stats.error == pytest.approx(1.0 / np.linalg.norm(r))
    assert _compare.combine([]) == _compare.Stats(None, None, None, False, 0, None)


def test_no_unnamed_result_of_any_types():
    """No function of the package returns ``tuple[Any, ...]``: a result of several values names them."""
    found = []
    for path in sorted((ROOT / "fmp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is not None:
                if ast.unparse(node.returns).replace(" ", "") == "tuple[Any,...]":
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not found, found


def test_torch_compare_fills_its_rows_through_the_core(monkeypatch):
    torch = pytest.importorskip("torch")
    import fmp.torch
    from fmp.torch._fx._explain import _compare as torch_compare

    calls = []

    def counted(records, jobs, rules, makers, row=None, framework="jax"):
        calls.append((len(jobs), framework, all(isinstance(j, _blame.Job) for j in jobs)))
        return _blame.fill_rows(records, jobs, rules, makers, row, framework)

    monkeypatch.setattr(torch_compare, "fill_rows", counted)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    report = fmp.torch.explain_fx(model, (torch.randn(4, 8),), ("cpu", torch.bfloat16), compare=True)
    compared = [r for r in report.records if r.error is not None]
    assert compared and calls == [(len(compared), "torch", True)]
