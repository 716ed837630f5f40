"""A call's policy is worked out once: what the user passed becomes one ``ResolvedPolicy`` at the public
entry, and nothing below parses it again (counted by patching the resolving functions)."""

from __future__ import annotations

import collections

import jax.numpy as jnp
import pytest

import fmp
import fmp.testing
from fmp._autocast import _transform, _wrap
from fmp._autocast._explain import _api
from fmp._resolved import ResolvedPolicy


def _count(monkeypatch, calls, module, name):
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls[name] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


@pytest.fixture
def jax_calls(monkeypatch):
    calls = collections.Counter()
    for module in (_api, _wrap, fmp.testing):
        _count(monkeypatch, calls, module, "configure")
        _count(monkeypatch, calls, module, "check_state")
    _count(monkeypatch, calls, _transform, "get_policy")
    return calls


def _loss(p, x):
    return jnp.mean(jnp.tanh(x @ p["w"]) ** 2)


ARGS = ({"w": jnp.eye(4) / 4}, jnp.linspace(-1.0, 1.0, 8).reshape(2, 4))


def test_explain_resolves_its_policy_once(jax_calls):
    report = fmp.explain(_loss, "mixed_bfloat16", compare=True, grads=True)(*ARGS)
    assert report.grads is not None
    # the gradients run through autocast on the same resolved policy: no second configure or check
    assert jax_calls == {"configure": 1, "get_policy": 1}


def test_autocast_resolves_its_policy_once(jax_calls):
    fmp.autocast(_loss, "mixed_bfloat16")(*ARGS)
    assert jax_calls == {"configure": 1, "get_policy": 1, "check_state": 1}


def test_assert_precision_resolves_its_policy_once(jax_calls):
    # its report (explain, with gradients) and its outputs (autocast) run on one resolved policy
    report = fmp.testing.assert_precision(_loss, "mixed_bfloat16", *ARGS, max_error=1e-1, grads=True)
    assert report.grads is not None
    assert jax_calls == {"configure": 1, "get_policy": 1, "check_state": 1}


def test_the_jax_side_carries_one_resolved_policy():
    resolved = _transform.configure("mixed_float8", overrides={"head": "float32"})
    assert isinstance(resolved, ResolvedPolicy)
    assert (resolved.compute, resolved.output, resolved.label) == ("bfloat16", "float32", "mixed_float8")
    assert resolved.recipe is resolved.policy.float8 and resolved.recipe.scaling == "tensorwise"
    assert resolved.overrides == (("head", fmp.get_policy("float32")),) and resolved.device_type is None


torch = pytest.importorskip("torch")


@pytest.fixture
def torch_calls(monkeypatch):
    import fmp.torch._policy as torch_policy
    from fmp.torch._fx import _api as fx_api
    from fmp.torch._fx import _prepare
    from fmp.torch._fx._explain import _api as fx_explain

    calls = collections.Counter()
    _count(monkeypatch, calls, _prepare, "fx_policy")
    _count(monkeypatch, calls, torch_policy, "get_policy")
    _count(monkeypatch, calls, _prepare, "resolve_policy")  # prepare's own
    for module in (fx_api, fx_explain):  # the graph entries'
        monkeypatch.setattr(module, "resolve_policy", _prepare.resolve_policy)
    return calls


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()), (torch.randn(2, 8),)


@pytest.mark.parametrize("compare", [False, True])
def test_explain_fx_resolves_its_policy_once(torch_calls, compare):
    model, inputs = _model()
    fmp.torch.explain_fx(model, inputs, "mixed_bfloat16", compare=compare)
    assert torch_calls == {"resolve_policy": 1, "fx_policy": 1, "get_policy": 1}


def test_autocast_fx_resolves_its_policy_once(torch_calls):
    model, inputs = _model()
    out = fmp.torch.autocast_fx(model, inputs, "mixed_float8")(*inputs)
    assert out.dtype == torch.float32  # the policy's output dtype, from the same resolution
    assert torch_calls == {"resolve_policy": 1, "fx_policy": 1, "get_policy": 1}


def test_torch_spellings_resolve_without_an_fmp_policy(torch_calls):
    from fmp.torch._fx._prepare import low_dtype, output_dtype, resolve_policy

    model, inputs = _model()
    fmp.torch.autocast_fx(model, inputs, ("cpu", torch.bfloat16))
    assert torch_calls == {"resolve_policy": 1}
    resolved = resolve_policy("cpu")
    assert (resolved.device_type, resolved.compute, resolved.policy, resolved.recipe) == ("cpu", "bfloat16", None, None)
    assert low_dtype(resolved) is torch.bfloat16 and output_dtype(resolved) is None
