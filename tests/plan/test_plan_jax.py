"""fmp.plan on a small model with planted sensitive sites, measured in JAX."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import planted as P

import fmp
from fmp._autocast._explain._plan import Runner
from fmp._plan._device import device_of
from fmp._plan._formats import formats_of
from fmp._plan._search import Search, candidates
from fmp._plan._sites import sites_of
from fmp.testing import assert_plan


@pytest.fixture(scope="module")
def params():
    return {k: jnp.asarray(v) for k, v in P.weights().items()}


@pytest.fixture(scope="module")
def default_plan(params):
    x0, x1 = jnp.asarray(P.batch(0)), jnp.asarray(P.batch(1))
    return fmp.plan(P.jax_loss, params, x0, batches=[x1], device=P.IDEAL)


@pytest.mark.xdist_group("plan_jax")  # default_plan once (tests/conftest.py)
def test_planted_sites_stay_out_of_float8_and_alike_sites_take_it(default_plan):
    got = default_plan.formats
    assert [got[k] for k in P.ALIKE] == ["float8"] * len(P.ALIKE)
    assert all(got[k] in ("bfloat16", "float32") for k in P.PLANTED), got
    assert got["router"] == "float32"  # its argmax flips in bfloat16 too
    rows = {r.site: r for r in default_plan.rows}
    assert rows["head"].errors["float8"] > 10 * rows["mlp0"].errors["float8"]
    assert rows["head"].why.startswith("float8 ")


@pytest.mark.xdist_group("plan_jax")  # default_plan once (tests/conftest.py)
def test_the_plan_runs_under_autocast_and_meets_its_budget(default_plan, params):
    plan = default_plan
    assert plan.error <= plan.budget and plan.grad_error is not None
    assert plan.policy == "mixed_float8"
    assert plan.overrides == {"attn": "float32", "router": "float32", "head": "mixed_bfloat16"}
    x = jnp.asarray(P.batch(0))
    rep = fmp.explain(P.jax_loss, plan.policy, overrides=plan.overrides)(params, x)
    f8 = {r.scope for r in rep.records if r.category == "float8"}
    assert f8 == set(P.ALIKE)
    loss = fmp.autocast(P.jax_loss, plan.policy, overrides=plan.overrides)(params, x)
    assert bool(jnp.isfinite(loss))


@pytest.mark.xdist_group("plan_jax")  # default_plan once (tests/conftest.py)
def test_a_held_back_batch_stays_within_the_budget(default_plan, params):
    assert_plan(P.jax_loss, default_plan, params, jnp.asarray(P.batch(7)))


@pytest.mark.xdist_group("plan_jax")  # default_plan once (tests/conftest.py)
def test_assert_plan_names_the_site_that_exceeds_its_share(default_plan, params):
    broken = dict(params)
    w = np.array(P.weights()["mlp2"])
    w[:, 3] *= 1e6  # one output channel sets the float8 scale: the rest of mlp2's weight flushes to zero
    broken["mlp2"] = jnp.asarray(w)
    with pytest.raises(AssertionError, match=r"site 'mlp2' \(float8\) adds .* above its share"):
        assert_plan(P.jax_loss, default_plan, broken, jnp.asarray(P.batch(0)))


def test_budgets_order_the_plans_by_cost(params):
    # the search fmp.plan runs, on one set of measurements for several budgets
    x0, x1 = jnp.asarray(P.batch(0)), jnp.asarray(P.batch(1))
    device, fmts = device_of(P.IDEAL), formats_of(("float8", "bfloat16", "float32"))
    sites = sites_of(fmp.explain(P.jax_loss, "mixed_float8")(params, x0).records)
    runner = Runner(P.jax_loss, [(params, x0), (params, x1)], False, 0, None)
    search = Search([candidates(s, fmts, device, False) for s in sites], runner)
    search.measure_sites()
    held = Runner(P.jax_loss, [(params, jnp.asarray(P.batch(9)))], False, 0, None)
    times = []
    for budget in (3e-3, 1e-2, 3e-2, 0.1, 0.3):
        chosen, got = search.within(budget)
        assert got.error <= budget
        assert held(chosen).error <= 1.5 * budget  # a batch the plan never saw
        times.append(sum(c.times[c.chain.index(chosen[c.site.key])] for c in search.cands.values()))
    assert times == sorted(times, reverse=True) and times[0] > times[-1]


def test_tiny_gemms_stay_in_bfloat16_on_h100(params):
    plan = fmp.plan(P.jax_loss, params, jnp.asarray(P.batch(0)), grads=False)
    assert set(plan.formats.values()) <= {"bfloat16", "float32"}
    why = {r.site: r.why for r in plan.rows}
    assert all("float8: does not pay (tensorwise: K <= 4096 and N <= 1024)" in why[k] for k in P.ALIKE)
    assert "float8: does not pay (K or N not a multiple of 16)" in why["router"]  # 8 experts
    assert plan.policy == "mixed_bfloat16"


def test_bad_arguments_name_them(params):
    x = jnp.asarray(P.batch(0))
    with pytest.raises(ValueError, match=r"plan\(budget=...\) must be finite and > 0"):
        fmp.plan(P.jax_loss, params, x, budget=-1.0)
    with pytest.raises(TypeError, match=r"plan\(batches=...\) expects a sequence"):
        fmp.plan(P.jax_loss, params, x, batches=x)
    with pytest.raises(TypeError, match="must return a scalar loss"):
        fmp.plan(lambda p, x: x @ p["mlp0"], params, x)
    with pytest.raises(ValueError, match="nothing to plan"):
        fmp.plan(lambda x: jnp.sum(jnp.tanh(x)), x, grads=False)
    with pytest.raises(TypeError, match="assert_plan"):
        assert_plan(P.jax_loss, {"mlp0": "float8"}, params, x)


def test_a_plan_without_gradients_prices_the_forward_only(params):
    x = jnp.asarray(P.batch(0))
    fwd = fmp.plan(P.jax_loss, params, x, grads=False, device="b200")
    assert fwd.grad_error is None
    assert jax.tree_util.tree_structure(fwd.formats) is not None
    assert fwd.device["name"] == "b200"


def test_block_scaled_formats_plug_in(params):
    b200 = {**P.IDEAL, "peak": {**P.IDEAL["peak"], "mxfp8": 4500e12, "nvfp4": 9000e12}}
    fmts = ("nvfp4", "mxfp8", "bfloat16", "float32")
    plan = fmp.plan(P.jax_loss, params, jnp.asarray(P.batch(0)), device=b200, formats=fmts, grads=False)
    assert plan.policy == "mixed_nvfp4"
    assert plan.formats["head"] in ("bfloat16", "float32")  # its outlier channel: nvfp4 and mxfp8 stand out
    assert sum(f == "nvfp4" for f in plan.formats.values()) >= len(P.ALIKE)
