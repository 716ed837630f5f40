"""What a failing ``assert_precision`` shows: under pytest the message only (every ``fmp.testing`` helper hides
its frame); with ``grads=True`` a count of the leaves above the bound and the five worst; a leaf with a tiny
reference gradient judged by absolute error."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from _helpers.common import ROOT

import fmp.testing
from fmp.testing import assert_precision


def test_a_pytest_failure_shows_the_message_and_no_fmp_source(tmp_path):
    test = tmp_path / "test_model.py"
    test.write_text(
        textwrap.dedent(
            """
            import jax.numpy as jnp
            from fmp.testing import assert_precision

            def test_overflow():
                params = {"w": jnp.linspace(-1.0, 1.0, 64).reshape(8, 8) * 1e3}

                def loss(params, x):
                    return jnp.sum(x @ params["w"])

                assert_precision(loss, "mixed_float16", params, jnp.ones((4, 8)) * 1e3)
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "E       AssertionError: 1 op needs a fix (float16 unit roundoff" in out
    assert "E       fix: overrides=" in out and "E       output error inf vs float32" in out
    # no line of fmp's own source, and no repr of the arguments (the parameters' arrays)
    assert "fmp/" not in out and "fmp\\" not in out, out
    assert "report = explain(" not in out and "Array(" not in out and "__tracebackhide__" not in out, out


@pytest.mark.parametrize("name", fmp.testing.__all__)
def test_every_assert_helper_hides_its_frame_from_pytest(name):
    # the argument checks fail before any tracing: pytest's own filter must drop fmp.testing's frame
    bad = {"assert_precision": ("mixed_bfloat16", {"max_error": "big"}), "assert_plan": ({}, {})}
    second, kwargs = bad[name]
    with pytest.raises(TypeError, match=name) as err:
        getattr(fmp.testing, name)(jnp.tanh, second, jnp.ones(2), **kwargs)
    ours = str(ROOT / "fmp" / "testing.py")
    assert ours in [str(entry.path) for entry in err.traceback]
    assert ours not in [str(entry.path) for entry in err.traceback.filter(err)]


def _attention():
    k = jax.random.split(jax.random.key(0), 5)
    params = {n: jax.random.normal(kk, (16, 16)) / 4 for n, kk in zip(("wq", "wk", "wv"), k, strict=False)}
    params["bk"] = jax.random.normal(k[3], (16,))  # a key bias: softmax ignores it, its exact gradient is 0

    def loss(p, x):
        q, keys = x @ p["wq"], x @ p["wk"] + p["bk"]
        return jnp.mean((jax.nn.softmax(q @ keys.T / 4, axis=-1) @ (x @ p["wv"])) ** 2)

    return loss, params, jax.random.normal(k[4], (8, 16))


def test_a_tiny_reference_gradient_is_judged_by_absolute_error_and_the_message_says_so():
    loss, params, x = _attention()
    rep = assert_precision(loss, "mixed_bfloat16", params, x, max_error=2e-2, grads=True)
    assert rep.grad_errors["['bk']"].error > 1.0  # relative to a gradient of rounding noise
    with pytest.raises(AssertionError) as err:
        assert_precision(loss, "mixed_bfloat16", params, x, max_error=1e-6, grads=True)
    lines = str(err.value).splitlines()
    assert "4 of 4 gradient leaves exceed 1e-06; worst: ['wq']" in "\n".join(lines)
    (bk,) = [line for line in lines if line.startswith("  ['bk']: error ")]
    assert "tiny reference gradient" in bk and "judged by absolute error over the gradient's norm" in bk


def test_many_leaves_over_the_bound_are_counted_and_the_five_worst_shown():
    k = jax.random.split(jax.random.key(1), 9)
    params = {f"w{i}": jax.random.normal(k[i], (8, 8)) / 3 for i in range(8)}
    x = jax.random.normal(k[8], (4, 8))

    def loss(p, x):
        for i in range(8):
            x = jnp.tanh(x @ p[f"w{i}"])
        return jnp.mean(x**2)

    with pytest.raises(AssertionError) as err:
        assert_precision(loss, "mixed_bfloat16", params, x, max_error=1e-6, grads=True)
    text = str(err.value)
    assert "8 of 8 gradient leaves exceed 1e-06; worst: " in text
    assert sum(line.startswith("  ['w") for line in text.splitlines()) == 5
    assert "  ... and 3 more (report.grad_errors has every leaf)" in text
