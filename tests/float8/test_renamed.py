"""The old ``fp8`` spellings keep working for one release: each warns with its ``float8`` name and gives what the
new name gives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import fmp

DELAYED = "p=f32,c=bf16,o=f32,float8=delayed"


def _f(w, x):
    return x @ w


W, X = jnp.linspace(-1.0, 1.0, 8).reshape(4, 2), jnp.linspace(0.5, 2.0, 12).reshape(3, 4)


def _renamed(new: str):
    return pytest.warns(DeprecationWarning, match=rf"is deprecated .*use {new}")


def test_policy_fp8_argument_and_attribute():
    new = fmp.Policy("f32", "bf16", "f32", float8="rowwise")
    with _renamed(r"Policy\(float8=...\)"):
        old = fmp.Policy("f32", "bf16", "f32", fp8="rowwise")
    assert old == new and hash(old) == hash(new) and str(old) == str(new)
    with _renamed(r"Policy\.float8"):
        assert new.fp8 == new.float8 == fmp.Float8Recipe("rowwise")
    with pytest.raises(TypeError, match="pass Policy\\(float8=...\\) only"):  # both names: which one?
        fmp.Policy("f32", "bf16", "f32", float8="rowwise", fp8="rowwise")


def test_policy_string_fp8_key():
    with _renamed("float8="):
        old = fmp.get_policy("p=f32,c=bf16,o=f32,fp8=delayed")
    assert old == fmp.get_policy(DELAYED)
    assert str(old) == "params=float32,compute=bfloat16,output=float32,float8=delayed"  # the new spelling
    with pytest.warns(DeprecationWarning, match=r"fp8= \(in 'fp8=delayed'\) is deprecated .*use float8="):
        fmp.get_policy("fp8=delayed")  # the warning names the spec it read


def test_autocast_explain_and_float8_step_fp8_state():
    optax = pytest.importorskip("optax")
    import fmp.optax

    state = fmp.float8_state(_f, DELAYED)(W, X)
    new = fmp.autocast(_f, DELAYED, float8_state=state)(W, X)
    with _renamed(r"autocast\(float8_state=...\)"):
        old = fmp.autocast(_f, DELAYED, fp8_state=state)(W, X)
    assert jnp.array_equal(old, new)
    with _renamed(r"autocast\(float8_state=...\)"):  # the decorator form too
        deco = fmp.autocast(policy=DELAYED, fp8_state=state)(_f)(W, X)
    assert jnp.array_equal(deco, new)

    labels = [r.detail for r in fmp.explain(_f, DELAYED, float8_state=state)(W, X).records if r.category == "float8"]
    with _renamed(r"explain\(float8_state=...\)"):
        rep = fmp.explain(_f, DELAYED, fp8_state=state)(W, X)
    assert [r.detail for r in rep.records if r.category == "float8"] == labels and labels

    def loss(w, st):
        return fmp.autocast(_f, DELAYED, float8_state=st)(w, X).sum()

    opt = optax.sgd(0.1)
    grads = jax.grad(loss, (0, 1))(W, state)
    want = fmp.optax.float8_step(opt, grads, opt.init(W), W, float8_state=state)
    with _renamed(r"float8_step\(float8_state=...\)"):
        got = fmp.optax.float8_step(opt, grads, opt.init(W), W, fp8_state=state)
    assert jax.tree.all(jax.tree.map(jnp.array_equal, got, want))
    with pytest.raises(TypeError, match="expects an fmp.Float8State, got NoneType"):
        fmp.optax.float8_step(opt, grads, opt.init(W), W)
