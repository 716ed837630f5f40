"""Planted precision defects: each is found by fmp.explain(compare=True), ranked first, and fixed by its suggestion."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers.common import near_tied_router

import fmp

K = jax.random.split(jax.random.key(2), 6)


def apply(fix: str, rules=None) -> dict:
    """The keyword argument a suggestion names, built by running its code."""
    scope = {"fmp": fmp, "rules": rules}
    exec(fix, scope)  # noqa: S102 - the suggestion is code written for the user to paste
    return {k: scope[k] for k in ("overrides", "rules") if k in fix.split("=", 1)[0]}


def _row(rep, op):
    (row,) = [r for r in rep.records if r.op == op and r.category != "cast"]
    return row


def test_log_softmax_with_exp_and_log_moved_to_bfloat16_ranks_first_and_is_fixed():
    # a log-softmax written without the max shift: exp of logits near 40 in bfloat16 rounds its inputs by
    # up to 1/8, 13% of each exp (with the shift, exp's inputs are small and bfloat16 costs one rounding)
    rules = fmp.DEFAULT_RULES.derive(lower_precision=["exp", "log"])
    logits = 30.0 + 4.0 * jax.random.normal(K[0], (64, 512))
    labels = jax.random.randint(K[1], (64,), 0, 512)

    def xent(logits, labels):
        logp = logits - jnp.log(jnp.exp(logits).sum(-1, keepdims=True))
        return -jnp.take_along_axis(logp, labels[:, None], axis=1).mean()

    rep = fmp.explain(xent, rules=rules, compare=True)(logits, labels)
    top = rep.worst(1)[0]
    assert top.op == "exp" and top.suggestion.startswith('overrides={"tests/explain/test_compare_planted.py:')
    fix = apply(top.suggestion)
    fixed = fmp.explain(xent, rules=rules, compare=True, **fix)(logits, labels)
    assert _row(fixed, "exp").added_error == 0.0 and _row(fixed, "exp").error == 0.0 < top.error


def test_a_million_values_accumulated_in_bfloat16_are_found_and_fixed():
    # one step of c + x in bfloat16 rounds once (its own error per step is the unit roundoff), but a
    # thousand steps lose the addends once the carry is large: the loop's compounding is charged to the add
    rules = fmp.DEFAULT_RULES.derive(lower_precision=["add"])
    xs = jax.random.uniform(K[2], (1000, 1000))

    def total(xs):
        return jax.lax.scan(lambda c, x: (c + x, None), jnp.zeros(1000), xs)[0].sum()

    rep = fmp.explain(total, rules=rules, compare=True)(xs)
    top = rep.worst(1)[0]
    assert top.op == "add" and top.iterations == 1000
    assert top.added_error_mean < 2**-8 < 0.1 < top.added_error  # each step is fine; the loop is not
    assert top.error_mean < top.error and "compounded through the carry" in top.detail
    (final,) = [r for r in rep.records if r.op == "reduce_sum"]
    want = float(np.sum(np.asarray(xs, np.float64)))
    got = float(fmp.autocast(total, rules=rules)(xs))
    assert final.error == pytest.approx(abs(got - want) / want, rel=1e-3) and final.error > 0.1
    assert re.fullmatch(r'overrides=\{"tests/explain/test_compare_planted\.py:\d+:\d+": "float32"\}', top.suggestion)
    fixed = fmp.explain(total, rules=rules, compare=True, **apply(top.suggestion))(xs)
    assert _row(fixed, "add").added_error == 0.0 and _row(fixed, "reduce_sum").error < 1e-5


def test_a_bfloat16_reduction_loses_only_its_final_rounding():
    # a reduce_sum of 10^6 values in bfloat16: XLA accumulates a reduction in float32 and rounds the
    # result once, so explain reports one rounding and suggests nothing
    rules = fmp.DEFAULT_RULES.derive(lower_precision=["reduce_sum"])
    x = jax.random.uniform(K[3], (10**6,))
    rep = fmp.explain(jnp.sum, rules=rules, compare=True)(x)
    row = _row(rep, "reduce_sum")
    assert row.added_error < 2**-8 and row.suggestion is None
    got, want = float(fmp.autocast(jnp.sum, rules=rules)(x)), float(np.sum(np.asarray(x, np.float64)))
    assert abs(got - want) / want < 2**-8


def test_float16_activation_overflow_is_first_and_fixed():
    x = jax.random.uniform(K[4], (8, 16), minval=1.0, maxval=2.0)
    w = jnp.full((16, 16), 20.0)

    def f(x, w):
        with jax.named_scope("mlp"):
            h = x @ w  # about 480: fine in float16
        return jnp.log(jnp.exp(h / 32.0).sum()) + (h * h).mean()  # h*h about 2e5: inf in float16

    rep = fmp.explain(f, "mixed_float16", compare=True)(x, w)
    top = rep.worst(1)[0]
    assert top.nonfinite and top.op == "mul"
    fix = apply(top.suggestion)
    assert not any(r.nonfinite for r in fmp.explain(f, "mixed_float16", compare=True, **fix)(x, w).records)
    assert jnp.isinf(fmp.autocast(f, "mixed_float16")(x, w))
    assert jnp.allclose(fmp.autocast(f, "mixed_float16", **fix)(x, w), f(x, w), rtol=1e-2)


def _rotary(x, inv_freq, hand_cast=False):
    pos = jnp.arange(x.shape[0], dtype=jnp.float32)
    with jax.named_scope("rotary"):
        if hand_cast:  # a bfloat16 einsum written by hand: part of the program as written
            angles = jnp.einsum("t,f->tf", pos.astype(jnp.bfloat16), inv_freq.astype(jnp.bfloat16))
        else:
            angles = jnp.einsum("t,f->tf", pos, inv_freq)
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).sum(0)


def test_rotary_angles_in_bfloat16_at_position_2047_rank_first_and_are_fixed():
    # autocast keeps an einsum that contracts nothing in its input dtype; a rule table that runs it in
    # bfloat16 (uncontracted=[]) rounds position 2047 to 2048. The angles' relative error is one rounding
    # (the einsum's added error), but an angle off by 1 rad makes cos and sin wrong: they magnify their
    # inputs' error, rank first, and name the einsum's scope as the fix
    rules = fmp.DEFAULT_RULES.derive(uncontracted=[])
    x = jax.random.normal(K[5], (2048, 64))
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(32, dtype=jnp.float32) / 32))
    rep = fmp.explain(_rotary, rules=rules, compare=True)(x, inv_freq)
    mm, top = _row(rep, "dot_general"), rep.worst(1)[0]
    assert "rotary" in mm.scope and mm.out_after == ("bfloat16",) and mm.added_error < 2**-8
    assert top.op in ("cos", "sin") and top.error > 0.1 > top.added_error
    assert top.suggestion == f'overrides={{"{mm.scope}": "float32"}}'
    assert "rotary" in str(rep).split("fmp precision report")[0].split("fix:")[1].splitlines()[0]
    fixed = fmp.explain(_rotary, rules=rules, compare=True, **apply(top.suggestion))(x, inv_freq)
    assert _row(fixed, "dot_general").added_error == 0.0 and _row(fixed, "cos").error < 1e-3
    assert not any(r.suggestion for r in fixed.records)


def test_a_bfloat16_cast_written_by_hand_is_the_reference():
    # the reference is the program as written: a cast the user wrote rounds in both runs, so explain
    # reports no error for it (compare against a float32 version of the function to see it)
    x = jax.random.normal(K[5], (2048, 64))
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(32, dtype=jnp.float32) / 32))
    rep = fmp.explain(lambda x, f: _rotary(x, f, hand_cast=True), compare=True)(x, inv_freq)
    assert _row(rep, "dot_general").error == 0.0 and _row(rep, "dot_general").suggestion is None


def test_top_k_router_flips_are_found_and_fixed():
    route, x, w = near_tied_router()
    rep = fmp.explain(route, compare=True)(x, w)
    top = rep.worst(1)[0]
    assert top.op == "top_k" and top.flips > 0
    assert top.suggestion == 'overrides={"router": "float32"}'
    fixed = fmp.explain(route, compare=True, **apply(top.suggestion))(x, w)
    assert all(r.flips == 0 for r in fixed.records)
