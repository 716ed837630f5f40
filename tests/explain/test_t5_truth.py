"""A T5-style encoder in flax whose last two ``wo`` projections overflow float16: after the report's own fix,
its rows say what ran (``override``, float32) and its summary counts it."""

from __future__ import annotations

import jax
import pytest
from _helpers.t5 import flax_model, low_share_of_rows
from jax.extend.core import jaxprs_in_params

import fmp

LOW = ("bfloat16", "float16")

pytestmark = pytest.mark.xdist_group("t5_truth")  # its module fixtures once (tests/conftest.py)


@pytest.fixture(scope="module")
def t5():
    return flax_model()


@pytest.fixture(scope="module")
def fixed(t5):
    apply, params, ids = t5
    rep = fmp.explain(apply, "mixed_float16", compare=True)(params, ids)
    fix = rep.suggested()
    assert fix == {"overrides": {"Encoder/block_1/ff/wo": "float32", "Encoder/block_2/ff/wo": "float32"}}
    return fix, fmp.explain(apply, "mixed_float16", compare=True, **fix)(params, ids)


def _wo(rep):
    return [r for r in rep.records if r.op == "dot_general" and r.scope.endswith("/wo")]


def test_overridden_rows_read_override_with_float32_and_keep_their_line(fixed):
    _, rep = fixed
    first, *last = _wo(rep)
    assert (first.category, first.out_after) == ("lower_precision", ("float16",))
    for r in last:
        assert (r.category, r.in_after, r.out_after) == ("override", ("float32", "float32"), ("float32",))
        assert r.detail == "float32 by overrides, rule lower_precision"
        assert r.source == first.source and r.source.startswith("tests/_helpers/t5.py:")
    assert rep.needs_fix == []


def test_summary_counts_what_ran(fixed):
    _, rep = fixed
    s = rep.summary
    assert s["low_precision_flop_share"] == pytest.approx(low_share_of_rows(rep))
    assert s["low_precision_flop_share"] < 1.0
    islands = [r for r in rep.records if r.category in ("float32", "override") and r.out_after == ("float32",)]
    assert s["float32_islands"] >= 2 and {r.scope for r in islands} >= {
        "Encoder/block_1/ff/wo",
        "Encoder/block_2/ff/wo",
    }


def _equations(jaxpr):
    for eqn in jaxpr.eqns:
        bodies = list(jaxprs_in_params(eqn.params))
        if bodies:
            for body in bodies:
                yield from _equations(body)
        else:
            yield eqn


def test_every_row_has_the_dtypes_the_program_computes(t5, fixed):
    apply, params, ids = t5
    fix, rep = fixed
    closed = jax.make_jaxpr(fmp.autocast(apply, "mixed_float16", **fix))(params, ids)
    ran = [
        (e.primitive.name, tuple(v.aval.dtype.name for v in e.outvars if v.aval.dtype.name in (*LOW, "float32")))
        for e in _equations(closed.jaxpr)
    ]
    # the rows are the program's equations in order (the program also holds helpers no row stands for, and
    # a user cast to the dtype a value already has is no equation)
    rows = [
        (r.op, r.out_after)
        for r in rep.records
        if r.category != "statistic" and not (r.category == "user_cast" and r.in_after == r.out_after)
    ]
    left = iter(ran)
    assert all(any(e == r for e in left) for r in rows)
    assert [e for e in ran if e[0] == "dot_general"] == [
        (r.op, r.out_after) for r in rep.records if r.op == "dot_general"
    ]


def test_an_op_moved_by_rules_reads_override(t5):
    apply, params, ids = t5
    rules = fmp.DEFAULT_RULES.derive(float32=["tanh"])
    rows = [r for r in fmp.explain(apply, "mixed_float16", rules=rules)(params, ids).records if r.op == "tanh"]
    assert rows and all(r.category == "override" and r.out_after == ("float32",) for r in rows)
    assert rows[0].detail == "float32 by rules, default unlisted"


def test_bfloat16_states_the_output_error_against_the_baseline(t5):
    apply, params, ids = t5
    rep = fmp.explain(apply, "mixed_bfloat16", compare=True)(params, ids)
    assert 0.003 < rep.baseline_error < rep.output_error < 4 * rep.baseline_error  # the model's conditioning
    second = " ".join(line.strip() for line in rep.verdict.splitlines()[2:])
    assert second.startswith(f"output error {rep.output_error:.1e} vs float32; baseline {rep.baseline_error:.1e}")
    assert "the model's own sensitivity at bfloat16" in second and str(rep).startswith(rep.verdict)
