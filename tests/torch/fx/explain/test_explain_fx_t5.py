"""A T5-style encoder in torch whose last two ``wo`` projections overflow float16: after the report's own fix,
its rows say what ran (``override``, float32, from the values) and its summary counts it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from _helpers.t5 import low_share_of_rows, torch_model  # noqa: E402

import fmp  # noqa: E402
import fmp.torch  # noqa: E402

POLICY = ("cpu", torch.float16)
pytestmark = pytest.mark.xdist_group("explain_fx_t5")  # its module fixtures once (tests/conftest.py)


@pytest.fixture(scope="module")
def t5():
    return torch_model()


@pytest.fixture(scope="module")
def fixed(t5):
    model, ids = t5
    rep = fmp.torch.explain_fx(model, (ids,), POLICY, compare=True)
    fix = rep.suggested()
    assert fix == {"overrides": {"blocks.1.ff.wo": "float32", "blocks.2.ff.wo": "float32"}}
    return fix, fmp.torch.explain_fx(model, (ids,), POLICY, compare=True, **fix)


def test_overridden_rows_read_override_with_float32_and_keep_their_line(fixed):
    _, rep = fixed
    first, *last = [r for r in rep.records if r.op == "aten::linear" and r.scope.endswith(".wo")]
    assert (first.category, first.out_after) == ("lower_precision", ("float16",))
    for r in last:
        assert (r.category, r.in_after, r.out_after) == ("override", ("float32", "float32"), ("float32",))
        assert r.detail == "float32 by overrides, rule lower_precision"
        assert r.source == first.source and r.source.startswith("tests/_helpers/t5.py:")
        after = rep.records[r.index + 1]  # the residual add reads the float32 output
        assert after.op == "aten::add.Tensor" and after.in_after == ("float32", "float32")
    assert rep.needs_fix == []


def test_summary_counts_what_ran(fixed):
    _, rep = fixed
    s = rep.summary
    assert s["low_precision_flop_share"] == pytest.approx(low_share_of_rows(rep))
    assert s["low_precision_flop_share"] < 1.0
    assert s["float32_islands"] == 2


def test_every_row_has_the_dtypes_the_program_computes(t5, fixed):
    model, ids = t5
    fix, rep = fixed
    gm = fmp.torch.autocast_fx(model, (ids,), POLICY, **fix)
    ran = []

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
                name = n.target._schema.name
                key = name if n.target._overloadname == "default" else f"{name}.{n.target._overloadname}"
                ran.append((key, tuple(str(t.dtype).removeprefix("torch.") for t in [out] if t.is_floating_point())))
            return out

    with torch.no_grad():
        Recorder(gm).run(ids)
    rows = [(r.op, r.out_after) for r in rep.records]
    left = iter(ran)
    assert all(any(e == r for e in left) for r in rows)
    linear = [e for e in ran if e[0] == "aten::linear"]
    assert linear == [(r.op, r.out_after) for r in rep.records if r.op == "aten::linear"]


def test_an_op_moved_by_rules_reads_override(t5):
    model, ids = t5
    rules = fmp.DEFAULT_RULES.derive(framework="torch", float32=["aten::gelu"])
    rows = [r for r in fmp.torch.explain_fx(model, (ids,), POLICY, rules=rules).records if r.op == "aten::gelu"]
    assert rows and all(r.category == "override" and r.out_after == ("float32",) for r in rows)
    assert rows[0].detail == "float32 by rules, default unlisted"


def test_bfloat16_states_the_output_error_against_the_baseline(t5):
    model, ids = t5
    rep = fmp.torch.explain_fx(model, (ids,), ("cpu", torch.bfloat16), compare=True)
    assert 0.003 < rep.baseline_error < rep.output_error < 4 * rep.baseline_error  # the model's conditioning
    second = " ".join(line.strip() for line in rep.verdict.splitlines()[2:])
    assert second.startswith(f"output error {rep.output_error:.1e} vs float32; baseline {rep.baseline_error:.1e}")
    assert "the model's own sensitivity at bfloat16" in second and str(rep).startswith(rep.verdict)
