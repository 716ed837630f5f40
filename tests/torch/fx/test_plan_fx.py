"""fmp.torch.plan_fx: the same plan as fmp.plan for the same model."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402
from _helpers import planted as P  # noqa: E402

import fmp  # noqa: E402
import fmp.torch  # noqa: E402


@pytest.fixture(scope="module")
def torch_plan():
    model = P.torch_loss(P.weights())
    x0, x1 = torch.tensor(P.batch(0)), torch.tensor(P.batch(1))
    return fmp.torch.plan_fx(model, (x0,), batches=[x1], device=P.IDEAL)


@pytest.mark.xdist_group("plan_fx")  # torch_plan once (tests/conftest.py)
def test_the_same_model_gets_the_same_plan_in_jax_and_torch(torch_plan):
    params = {k: jnp.asarray(v) for k, v in P.weights().items()}
    jax_plan = fmp.plan(P.jax_loss, params, jnp.asarray(P.batch(0)), batches=[jnp.asarray(P.batch(1))], device=P.IDEAL)
    assert torch_plan.framework == "torch"
    assert torch_plan.formats == jax_plan.formats
    assert [k for k, f in torch_plan.formats.items() if f == "float8"] == list(P.ALIKE)
    assert (torch_plan.policy, torch_plan.overrides) == (jax_plan.policy, jax_plan.overrides)
    for t, j in zip(torch_plan.rows, jax_plan.rows, strict=True):
        assert t.gemm == j.gemm
        if t.site != "attn":  # JAX counts `p @ x` as float8 too: x is an input of the function, as a weight
            assert t.predicted_time == pytest.approx(j.predicted_time)


@pytest.mark.xdist_group("plan_fx")  # torch_plan once (tests/conftest.py)
def test_the_plan_runs_under_autocast_fx(torch_plan):
    model = P.torch_loss(P.weights())
    x = torch.tensor(P.batch(0))
    gm = fmp.torch.autocast_fx(model, (x,), torch_plan.policy, overrides=torch_plan.overrides)
    assert torch.isfinite(gm(x))
    rep = fmp.torch.explain_fx(model, (x,), torch_plan.policy, overrides=torch_plan.overrides)
    assert {r.scope for r in rep.records if r.category == "float8"} == set(P.ALIKE)


def test_tiny_matmuls_stay_out_of_float8_on_h100():
    plan = fmp.torch.plan_fx(P.torch_loss(P.weights()), (torch.tensor(P.batch(0)),), grads=False)
    assert set(plan.formats.values()) <= {"bfloat16", "float32"}
    assert all("float8: does not pay" in r.why for r in plan.rows)


def test_bad_arguments_name_them():
    with pytest.raises(TypeError, match=r"plan_fx\(module, ...\) expects a torch.nn.Module"):
        fmp.torch.plan_fx(lambda x: x, (torch.ones(2),))
    with pytest.raises(TypeError, match="scalar loss"):
        fmp.torch.plan_fx(torch.nn.Linear(32, 32), (torch.ones(4, 32),))
