"""fmp.testing.assert_precision: passes on a healthy model, fails naming the worst op, bounds gradients."""

from __future__ import annotations

import re

import jax.numpy as jnp
import pytest
from _helpers.common import ROOT

import fmp
from fmp.testing import assert_precision


def _mlp(p, x):
    return jnp.mean(jnp.tanh(x @ p["w"]) ** 2)


_P = {"w": jnp.eye(8) / 4}
_X = jnp.linspace(-2.0, 2.0, 32).reshape(4, 8)


def test_it_returns_the_report_of_a_healthy_model():
    rep = assert_precision(_mlp, "mixed_bfloat16", _P, _X, max_error=1e-2, grads=True)
    assert rep.compared and rep.needs_fix == [] and set(rep.grad_errors) == {"['w']"}


def test_an_overflow_fails_naming_the_line_the_error_and_the_fix():
    def loss(x):
        return jnp.sum(x @ x.T)  # |x @ x.T| up to 1e6: past float16's 65504

    with pytest.raises(AssertionError) as err:
        assert_precision(loss, "mixed_float16", _X * 1e3)
    msg = str(err.value)
    assert msg.startswith("1 op needs a fix (float16 unit roundoff")
    assert re.search(
        r"worst op: #\d+ dot_general at tests/explain/test_testing\.py:\d+:\d+ \(.*loss\): added error inf", msg
    )
    assert "output: relative error inf" in msg
    assert "\nfix: " in msg


def test_max_error_bounds_the_output():
    with pytest.raises(AssertionError, match=r"output: relative error \d\.\d+e-0\d > max_error 1\.0e-06"):
        assert_precision(_mlp, "mixed_bfloat16", _P, _X, max_error=1e-6)


def test_grads_bound_each_gradient_leaf():
    rep = assert_precision(_mlp, "mixed_bfloat16", _P, _X, max_error=1e-2)
    assert rep.grads is None
    out = float(abs(fmp.autocast(_mlp, "mixed_bfloat16")(_P, _X) - _mlp(_P, _X)) / _mlp(_P, _X))
    grad_error = fmp.explain(_mlp, "mixed_bfloat16", compare=True, grads=True)(_P, _X).grad_errors["['w']"].error
    bound = (out + grad_error) / 2 if grad_error > out else None
    if bound is None:
        pytest.skip("the gradient is not worse than the output on this machine")
    assert_precision(_mlp, "mixed_bfloat16", _P, _X, max_error=bound)
    with pytest.raises(AssertionError, match=r"1 of 1 gradient leaves exceed .*; worst: \['w'\] "):
        assert_precision(_mlp, "mixed_bfloat16", _P, _X, max_error=bound, grads=True)


def test_bad_arguments():
    with pytest.raises(TypeError, match="rules= and overrides="):
        assert_precision(_mlp, "mixed_bfloat16", _P, _X, loss_scale=2.0)
    with pytest.raises(ValueError, match="max_error"):
        assert_precision(_mlp, "mixed_bfloat16", _P, _X, max_error=-1.0)


def test_the_debugging_guide_test_runs():
    pytest.importorskip("flax")
    page = (ROOT / "docs" / "guides" / "debugging.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "assert_precision(" in b]
    scope: dict = {}
    exec(compile(code, "debugging.md", "exec"), scope)  # noqa: S102 - the page's own code
    scope["test_block_keeps_its_precision_in_bfloat16"]()
