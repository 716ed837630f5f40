"""fmp.explain(compare=True, grads=True): each gradient leaf and each backward op against the reference."""

import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fmp

K = jax.random.split(jax.random.key(1), 6)
X = jax.random.normal(K[0], (16, 32))
W = jax.random.normal(K[1], (32, 32)) / 6
PARAMS = {"w": W, "b": jnp.zeros(32)}


def mlp(p, x):
    with jax.named_scope("dense"):
        h = jnp.tanh(x @ p["w"] + p["b"])
    return jnp.mean(h**2)


def apply(fix: str, rules=None) -> dict:
    """The keyword argument a suggestion names, built by running its code."""
    scope = {"fmp": fmp, "rules": rules}
    exec(fix, scope)  # noqa: S102 - the suggestion is code written for the user to paste
    return {k: scope[k] for k in ("overrides", "rules") if k in fix.split("=", 1)[0]}


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_grad_errors_are_jax_grad_of_autocast_against_jax_grad():
    rep = fmp.explain(mlp, compare=True, grads=True)(PARAMS, X)
    ref = jax.jit(jax.grad(mlp))(PARAMS, X)
    got = jax.jit(jax.grad(fmp.autocast(mlp)))(PARAMS, X)  # as users train: compiled
    assert set(rep.grad_errors) == {"['b']", "['w']"}
    for key in ("b", "w"):
        e = rep.grad_errors[f"['{key}']"]
        p, r = np.asarray(got[key], np.float64), np.asarray(ref[key], np.float64)
        assert e.error == pytest.approx(rel(p, r), rel=1e-6)
        assert e.cosine == pytest.approx(np.vdot(p, r) / np.linalg.norm(p) / np.linalg.norm(r), abs=1e-12)
        assert 0 < e.error < 2**-6 and not e.nonfinite and e.underflow is None  # bfloat16: no range to check
    assert rep.to_dict()["grads"]["errors"]["['w']"]["error"] == rep.grad_errors["['w']"].error


def test_float32_policy_reports_exactly_zero():
    rep = fmp.explain(mlp, "float32", compare=True, grads=True)(PARAMS, X)
    assert all(e.error == 0.0 and e.cosine == pytest.approx(1.0) for e in rep.grad_errors.values())
    assert rep.grad_rows and all(r.error == 0.0 and r.added_error == 0.0 for r in rep.grad_rows)
    assert all(r.suggestion is None for r in rep.grad_rows)


def test_backward_rows_compare_with_the_reference_backward():
    # the lifted run of the policy's backward is the reference backward: the row that makes the gradient
    # of w carries the leaf's error against jax.grad of the program as written
    rep = fmp.explain(mlp, compare=True, grads=True)(PARAMS, X)
    assert {r.scope for r in rep.grad_rows} >= {"dense"} and all(r.category == "backward" for r in rep.grad_rows)
    matmuls = [r for r in rep.grad_rows if r.op == "dot_general"]
    assert len(matmuls) == 1 and matmuls[0].in_after == ("bfloat16", "bfloat16")
    assert matmuls[0].in_before == ("float32", "float32") and 0 < matmuls[0].added_error < 2**-8
    last = [r for r in rep.grad_rows if r.out_after == ("float32",) and r.in_after == ("bfloat16",)]
    assert any(r.error == pytest.approx(rep.grad_errors["['w']"].error, rel=1e-4) for r in last)
    assert rep.worst(1, grads=True)[0].added_error == max(r.added_error for r in rep.grad_rows)


def test_argnums_and_keyword_arguments():
    def loss(w, x, *, b):
        return mlp({"w": w, "b": b}, x)

    rep = fmp.explain(loss, compare=True, grads=True, argnums=(0, 1))(W, X, b=PARAMS["b"])
    assert set(rep.grad_errors) == {"[0]", "[1]"}
    got = jax.jit(lambda w, x: jax.grad(fmp.autocast(loss), 1)(w, x, b=PARAMS["b"]))(W, X)
    want = rel(got, jax.jit(lambda w, x: jax.grad(loss, 1)(w, x, b=PARAMS["b"]))(W, X))
    assert rep.grad_errors["[1]"].error == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("body", ["jit", "checkpoint", "scan"])
def test_backward_of_nested_bodies(body):
    def f(w, x):
        if body == "jit":
            return jax.jit(lambda x, w: jnp.tanh(x @ w))(x, w).sum()
        if body == "checkpoint":
            return jax.checkpoint(lambda x, w: jnp.tanh(x @ w))(x, w).sum()
        return jax.lax.scan(lambda h, x: (jnp.tanh(x + h @ w), None), jnp.zeros(32), x[:3])[0].sum()

    rep = fmp.explain(f, compare=True, grads=True)(W, X)
    want = rel(jax.jit(jax.grad(fmp.autocast(f)))(W, X), jax.jit(jax.grad(f))(W, X))
    assert rep.grad_errors[""].error == pytest.approx(want, rel=1e-6)
    ops = {r.op for r in rep.grad_rows}
    assert ("scan" if body == "scan" else "dot_general") in ops  # a loop's backward is one row
    exact = fmp.explain(f, "float32", compare=True, grads=True)(W, X)
    assert all(r.error == 0.0 for r in exact.grad_rows) and exact.grad_errors[""].error == 0.0


def test_float16_underflow_at_scale_and_the_scale_that_keeps_it():
    def tiny(w, x):
        return 1e-4 * jnp.mean(jnp.tanh(x @ w))  # each output's cotangent is 1e-4/512: subnormal in float16

    unscaled = fmp.explain(tiny, "mixed_float16", compare=True, grads=True, loss_scale=1.0)(W, X)
    e = unscaled.grad_errors[""]
    assert unscaled.grads.loss_scale == 1.0 and e.error > 0.1  # subnormals keep too few bits of the gradient
    assert e.underflow + e.subnormal == 1.0
    assert any(r.underflow == 1.0 for r in unscaled.grad_rows)
    g = np.abs(np.asarray(jax.grad(tiny)(W, X), np.float64))
    lost = [np.linalg.norm(g[g * s < 2.0**-14]) / np.linalg.norm(g) for s in (e.scale_needed, e.scale_needed / 2)]
    assert lost[0] <= 2**-11 < lost[1]  # the smallest scale that keeps the gradient to float16 precision
    assert unscaled.grads.scale_needed >= e.scale_needed  # the backward's own values are smaller still
    text = str(unscaled)
    assert "at loss scale 2^0 underflows" in text and "100.0% below float16's normal range" in text
    scaled = fmp.explain(tiny, "mixed_float16", compare=True, grads=True)(W, X)  # GradScaler's 2**16
    s = scaled.grad_errors[""]
    assert scaled.grads.loss_scale == 2.0**16 and s.underflow == 0.0 and s.subnormal < 0.01 and s.error < 2**-8
    assert all((r.underflow or 0.0) < 0.01 for r in scaled.grad_rows)
    assert scaled.grads.scale_needed <= 2.0**16 <= scaled.grads.scale_max and "holds every value" in str(scaled)
    scaler = fmp.GradScaler(init_scale=2.0**40)  # too large: the backward overflows
    over = fmp.explain(tiny, "mixed_float16", compare=True, grads=True, loss_scale=scaler)(W, X)
    assert over.grads.loss_scale == 2.0**40 and over.grad_errors[""].nonfinite and "overflows" in str(over)


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(8, (3, 3), use_bias=False)(x)
        return nn.relu(nn.BatchNorm(use_running_average=False)(x))


def test_planted_batchnorm_variance_in_bfloat16_is_named_and_fixed():
    # a rule table that computes BatchNorm's statistics in bfloat16: on inputs far from zero, E[x^2] - E[x]^2
    # cancels and the gradients of every layer are far off; the backward culprit names the fix
    rules = fmp.DEFAULT_RULES.derive(lower_precision=["square", "reduce_sum"])
    x = jax.random.normal(K[3], (8, 6, 6, 3)) + 4.0
    y = jax.random.normal(K[4], (8, 6, 6, 8))
    net = Net()
    variables = jax.jit(net.init)(K[5], x)

    def loss(params, x, y):
        out, _ = net.apply({"params": params, "batch_stats": variables["batch_stats"]}, x, mutable=["batch_stats"])
        return jnp.mean(out * y)

    rep = fmp.explain(loss, rules=rules, compare=True, grads=True)(variables["params"], x, y)
    assert rep.grad_errors["['BatchNorm_0']['scale']"].error > 0.5
    culprits = [r for r in rep.worst(3, grads=True) if r.suggestion]
    assert culprits and culprits[0].scope == "Net/BatchNorm_0"
    assert culprits[0].suggestion == 'overrides={"Net/BatchNorm_0": "float32"}'
    fix = apply(culprits[0].suggestion)
    grads = jax.jit(jax.grad(fmp.autocast(loss, rules=rules, **fix)))(variables["params"], x, y)
    ref = jax.jit(jax.grad(loss))(variables["params"], x, y)
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        key = jax.tree_util.keystr(path)
        fixed = rel(g, ref[path[0].key][path[1].key])
        assert fixed < rep.grad_errors[key].error / 4 and fixed < 0.05, key
    assert rel(grads["Conv_0"]["kernel"], ref["Conv_0"]["kernel"]) < rep.grad_errors["['Conv_0']['kernel']"].error / 10
    assert "['BatchNorm_0']['scale']" in str(rep)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="pass compare=True"):
        fmp.explain(mlp, grads=True)
    with pytest.raises(TypeError, match="argnums"):
        fmp.explain(mlp, compare=True, grads=True, argnums="0")
    with pytest.raises(ValueError, match="loss_scale"):
        fmp.explain(mlp, compare=True, grads=True, loss_scale=0.0)
    with pytest.raises(TypeError, match="loss_scale"):
        fmp.explain(mlp, compare=True, grads=True, loss_scale="big")
    with pytest.raises(ValueError, match="grads=True"):
        _ = fmp.explain(mlp, compare=True)(PARAMS, X).grad_errors


def test_debugging_guide_gradient_example_runs():
    page = (pathlib.Path(__file__).parents[2] / "docs" / "guides" / "debugging.md").read_text()
    section = page.split("### In the gradients", 1)[1]
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(block, "debugging.md", "exec"), {"__name__": "docs"})  # noqa: S102


def test_the_widened_run_treats_the_float16_rounding_mark_as_the_identity():
    from fmp._autocast._explain._grads import _Runs

    x = jnp.linspace(1.1e-7, 3.3e-7, 8).reshape(1, 8)  # float16 subnormal range: its grid would move them
    closed = jax.make_jaxpr(fmp.autocast(lambda x, w: x @ w, "mixed_float16"))(x, jnp.eye(8))
    (out,) = _Runs(jnp.float32, (), fmp.DEFAULT_RULES, 1.0, True).lifted_eval(
        closed.jaxpr, closed.consts, [x, jnp.eye(8)]
    )
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x))
