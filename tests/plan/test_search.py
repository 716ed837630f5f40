"""The search over measured per-site errors, on synthetic measurements: the default rule, budgets, order."""

from __future__ import annotations

import math

import pytest

from fmp._plan._device import device_of
from fmp._plan._formats import FORMATS, formats_of
from fmp._plan._plan import make_plan
from fmp._plan._search import Measured, Search, candidates, policy_and_overrides
from fmp._plan._sites import Site

IDEAL = device_of({"peak": {"float32": 67e12, "bfloat16": 989e12, "float8": 1979e12}, "bandwidth": 1e18})
BIG = (4096, 8192, 8192)  # float8 pays for it on an H100 by torchao's rule
FMTS = formats_of(("float8", "bfloat16", "float32"))


def _sites(n):
    return [Site(f"layer{i}", (BIG,)) for i in range(n)]


def _measure(own, coupling=0.0, log=None):
    """A program whose sites add ``own[site][format]`` each, in quadrature, plus ``coupling`` times their
    product with the next site's (errors that combine worse than alone)."""

    def run(assignment):
        if log is not None:
            log.append(dict(assignment))
        errs = [own[k].get(f.name, 0.0) if f.name != "float32" else 0.0 for k, f in assignment.items()]
        e = math.sqrt(sum(x * x for x in errs)) + coupling * sum(
            a * b for a, b in zip(errs[:-1], errs[1:], strict=True)
        )
        return Measured(e, e, None, any(math.isinf(x) for x in errs))

    return run


def _own(n, planted=None):
    own = {f"layer{i}": {"float8": 0.03 + 0.001 * i, "bfloat16": 0.002 + 0.0001 * i} for i in range(n)}
    own.update(planted or {})
    return own


def _plan(n, own, budget=None, coupling=0.0, device=IDEAL, log=None):
    return make_plan(
        _sites(n),
        _measure(own, coupling, log),
        budget=budget,
        formats=FMTS,
        device=device,
        grads=True,
        framework="jax",
    )


def test_default_rule_moves_only_the_sites_that_stand_out():
    own = _own(6, {"layer2": {"float8": 0.5, "bfloat16": 0.003}, "layer4": {"float8": 0.4, "bfloat16": 0.2}})
    plan = _plan(6, own)
    assert plan.formats == {
        "layer0": "float8", "layer1": "float8", "layer2": "bfloat16", "layer3": "float8", "layer4": "float32",
        "layer5": "float8",
    }  # fmt: skip
    assert plan.budget == plan.error  # the default's budget is what it measures
    assert "float8 stands out" in plan.rows[2].why or "> 4u" in plan.rows[2].why
    assert plan.policy == "mixed_float8"
    assert plan.overrides == {"layer2": "mixed_bfloat16", "layer4": "float32"}


def test_overflow_and_flips_move_a_site_whatever_its_error():
    own = _own(3, {"layer1": {"float8": math.inf, "bfloat16": 0.002}})
    assert _plan(3, own).formats["layer1"] == "bfloat16"
    search = Search(
        [candidates(s, FMTS, IDEAL, True) for s in _sites(2)], lambda a: Measured(0.01, 0.01, None, False, 3)
    )
    search.measure_sites()
    assert search.default()[0]["layer0"].name == "float32"


def test_a_looser_budget_never_gives_a_costlier_plan():
    own = _own(6, {"layer2": {"float8": 0.5, "bfloat16": 0.003}, "layer4": {"float8": 0.2, "bfloat16": 0.05}})
    budgets = [1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.06, 0.1, 0.3, 1.0]
    times = []
    for b in budgets:
        plan = _plan(6, own, budget=b, coupling=2.0)
        assert plan.error <= b == plan.budget
        times.append(plan.predicted_time)
    assert times == sorted(times, reverse=True)
    assert times[0] > times[-1]


def test_the_plan_backs_off_the_worst_site_first_and_verifies_the_whole():
    own = _own(4, {"layer3": {"float8": 0.3, "bfloat16": 0.003}})
    log = []
    plan = _plan(4, own, budget=0.08, coupling=5.0, log=log)
    assert plan.formats["layer3"] != "float8"
    whole = [a for a in log if all(f.name != "float32" for f in a.values())]
    assert whole, "the chosen plan was run as a whole"
    assert plan.error <= 0.08


def test_an_unmeetable_budget_says_what_the_most_precise_plan_measures():
    own = _own(2)

    def floor(assignment):  # every plan keeps an error of 1e-3 (ops outside the sites)
        m = _measure(own)(assignment)
        return Measured(m.error + 1e-3, m.error + 1e-3)

    with pytest.raises(ValueError, match=r"no plan meets it; the most precise one .* measures 0.001"):
        make_plan(_sites(2), floor, budget=1e-4, formats=FMTS, device=IDEAL, grads=True, framework="jax")


def test_the_same_measurements_give_the_same_plan():
    own = _own(5, {"layer1": {"float8": 0.3, "bfloat16": 0.003}})
    assert _plan(5, own, budget=0.05) == _plan(5, own, budget=0.05)
    assert _plan(5, own) == _plan(5, own)


def test_policy_and_overrides_name_the_quantised_format_most_sites_have():
    f8, bf, f32 = FORMATS["float8"], FORMATS["bfloat16"], FORMATS["float32"]
    assert policy_and_overrides({"a": bf, "b": f32}) == ("mixed_bfloat16", {"b": "float32"})
    policy, over = policy_and_overrides({"a": f8, "b": f8, "c": FORMATS["float8_rowwise"], "d": bf})
    assert policy == "mixed_float8"
    assert over == {"c": FORMATS["float8_rowwise"].policy, "d": "mixed_bfloat16"}


def test_no_site_is_an_error():
    with pytest.raises(ValueError, match="nothing to plan"):
        make_plan([], _measure({}), budget=None, formats=FMTS, device=IDEAL, grads=True, framework="jax")
