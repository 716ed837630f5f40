"""Fixes are local and complete: a suggestion selects the culprit (its innermost scope, or its source
location outside any scope), never a whole primitive; ``Report.suggested()`` applies every one at once."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fmp
from fmp._core._scopes import is_location


def _unscoped(x, w1, w2, w3):
    h = x @ w1  # |h| up to ~1e5: past float16's 65504
    g = jnp.tanh(h / 1e4) * 400.0
    y = g @ w2  # overflows again, on its own reference inputs
    z = jnp.tanh(y / 1e5) @ w3  # a healthy matmul: stays in float16
    return jnp.mean(jax.nn.log_softmax(z, -1))


def _scoped(x, w1, w2, w3):
    with jax.named_scope("block/attn"):
        h = x @ w1
        g = jnp.tanh(h / 1e4) * 400.0
    with jax.named_scope("block/mlp"):
        y = g @ w2
    with jax.named_scope("head"):
        z = jnp.tanh(y / 1e5) @ w3
    return jnp.mean(jax.nn.log_softmax(z, -1))


def _inputs():
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.uniform(k[0], (8, 64), minval=0.5, maxval=1.0) * 100.0
    w1 = jax.random.uniform(k[1], (64, 64), minval=0.5, maxval=1.0) * 20.0
    w2 = jax.random.uniform(k[2], (64, 64), minval=0.5, maxval=1.0) * 10.0
    w3 = jax.random.normal(k[3], (64, 16))
    return x, w1, w2, w3


@pytest.mark.parametrize("fn", [_unscoped, _scoped], ids=["unscoped", "scoped"])
def test_suggested_fixes_every_overflow_at_once(fn):
    args = _inputs()
    rep = fmp.explain(fn, "mixed_float16", compare=True)(*args)
    fixes = rep.needs_fix
    assert len(fixes) == 2 and all(r.op == "dot_general" and r.added_error == np.inf for r in fixes)
    assert not any("rules=" in r.suggestion for r in fixes)  # no primitive moved for the whole program
    kwargs = rep.suggested()
    assert list(kwargs) == ["overrides"]
    if fn is _scoped:
        assert kwargs["overrides"] == {"block/attn": "float32", "block/mlp": "float32"}
    else:
        assert len(kwargs["overrides"]) == 2 and all(is_location(k) for k in kwargs["overrides"])
        assert all(k.startswith("tests/report/test_fixes.py:") for k in kwargs["overrides"])
    fixed = fmp.explain(fn, "mixed_float16", compare=True, **kwargs)(*args)
    assert fixed.needs_fix == []
    # the healthy matmul still runs in float16: the fix changed the culprits only
    dots = [r.in_after for r in fixed.records if r.op == "dot_general"]
    assert dots.count(("float16", "float16")) == 1 and dots.count(("float32", "float32")) == 2
    got, want = fmp.autocast(fn, "mixed_float16", **kwargs)(*args), fn(*args)
    assert np.isfinite(got) and abs(float(got) - float(want)) < 1e-3 * abs(float(want))
    broken = float(fmp.autocast(fn, "mixed_float16")(*args))  # tanh(inf) = 1: finite, but wrong
    assert not abs(broken - float(want)) < 1e-2 * abs(float(want))


def test_a_location_key_selects_that_line_only():
    args = _inputs()
    rep = fmp.explain(_unscoped, "mixed_float16", compare=True)(*args)
    key = next(iter(parse_overrides(rep.needs_fix[0].suggestion)))
    only = fmp.explain(_unscoped, "mixed_float16", overrides={key: "float32"})(*args)
    dots = [r for r in only.records if r.op == "dot_general"]
    assert [r.in_after[0] for r in dots] == ["float32", "float16", "float16"]
    # under jit as well: the key is matched while tracing
    assert jax.jit(fmp.autocast(_unscoped, "mixed_float16", overrides={key: "float32"}))(*args).dtype == jnp.float32


def parse_overrides(suggestion: str) -> dict:
    from fmp._report._fixes import parse

    return parse(suggestion)["overrides"]


def test_a_rule_table_fix_names_no_variable_of_the_user():
    rules = fmp.DEFAULT_RULES.derive(lower_precision=["exp", "sin"])
    rep = fmp.explain(jnp.exp, rules=rules, compare=True)(jnp.linspace(0.0, 80.0, 64))
    (row,) = rep.needs_fix
    # jnp.exp called directly has no line of the user's: the rules the report ran under, spelled in full
    if row.source:
        pytest.skip("the op has a source line here")
    assert row.suggestion == 'rules=fmp.DEFAULT_RULES.derive(lower_precision=["sin"], float32=["exp"])'
    fixed = rep.suggested()["rules"]
    assert fixed.category("exp") is fmp.Category.FLOAT32 and fixed.category("sin") is fmp.Category.LOWER_PRECISION


def test_every_overflow_in_one_pass_with_its_size_and_the_rows_that_inherit_it():
    args = _inputs()
    rep = fmp.explain(_unscoped, "mixed_float16", compare=True)(*args)
    first, second = sorted(rep.needs_fix, key=lambda r: r.index)
    # the second matmul overflows on its own reference inputs, though its inputs are already non-finite
    assert second.added_error == np.inf and second.ref_max > 65504
    head = str(rep).split("\n\nfmp precision report", 1)[0]
    for row in (first, second):
        assert f"|x| up to {row.ref_max:.1e}, float16 max 65504" in head
    assert re.search(r"; \d+ ops? downstream inherits? it", head)
    # rows that only inherit the inf are folded into their culprit, not listed one by one
    inheriting = [r for r in rep.records if r.nonfinite and r.suggestion is None]
    assert inheriting and not any(f"\n#{r.index} " in head for r in inheriting)
    assert rep.worst(2) == tuple(rep.needs_fix)


def _attention(params, x):
    """One head whose scores are not scaled, on large activations: float16 rounds scores of ~1e3 to a unit,
    and the softmax's ``exp`` turns that into a large error."""
    with jax.named_scope("attn"):
        q = x @ params["q"]
        k = x @ params["k"]
        v = x @ params["v"]
        scores = q @ k.T
        probs = jax.nn.softmax(scores)  # a line of its own: a location key selects every op of its line
        return probs @ v


def _attention_inputs():
    k = jax.random.split(jax.random.PRNGKey(1), 4)
    params = {n: jax.random.normal(key, (64, 64)) / 8.0 for n, key in zip("qkv", k[:3], strict=True)}
    return params, 8.0 * jax.random.normal(k[3], (64, 64))


def test_a_magnified_error_is_one_fix_for_every_rounding_it_is_made_of():
    params, x = _attention_inputs()
    rep = fmp.explain(_attention, "mixed_float16", compare=True)(params, x)
    (row,) = rep.needs_fix  # the softmax's exp; the sum and the division after it only inherit its error
    assert row.op == "exp" and row.added_error == 0.0 and row.error > 16 * 2**-11
    rows = {r.index: r for r in rep.records}
    charged = [rows[i] for i in row.culprits]
    # every rounding exp magnifies: the q and k products, the scores, the subtraction of the maximum
    assert [r.op for r in charged] == ["dot_general", "dot_general", "dot_general", "sub"]
    # local: the scope "attn" also holds v's matmul, so each key is a source line, never "attn"
    keys = rep.suggested()["overrides"]
    assert len(keys) == 4 and all(is_location(k) for k in keys)
    fixed = fmp.explain(_attention, "mixed_float16", compare=True, **rep.suggested())(params, x)
    assert fixed.needs_fix == []
    matmuls = [r for r in fixed.records if r.op == "dot_general"]
    # q, k and the scores run in float32; v and p @ v stay in float16
    assert [r.out_after[0] for r in matmuls] == ["float32", "float32", "float16", "float32", "float16"]
