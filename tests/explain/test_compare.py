"""fmp.explain(compare=True): per-op errors against the program as written, planted defects, suggestions."""

import functools
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fmp

K = jax.random.split(jax.random.key(0), 6)
X = jax.random.normal(K[0], (16, 32))
W = jax.random.normal(K[1], (32, 32)) / 6


def mlp(x, w):
    return jnp.tanh(x @ w).sum()


def apply(fix: str, rules=None) -> dict:
    """The keyword argument a suggestion names, built by running its code."""
    scope = {"fmp": fmp, "rules": rules}
    exec(fix, scope)  # noqa: S102 - the suggestion is code written for the user to paste
    return {k: scope[k] for k in ("overrides", "rules") if k in fix.split("=", 1)[0]}


def test_same_rows_as_without_compare():
    plain = fmp.explain(mlp)(X, W)
    cmp = fmp.explain(mlp, compare=True)(X, W)
    assert [(r.op, r.category, r.in_after, r.out_after) for r in cmp.records] == [
        (r.op, r.category, r.in_after, r.out_after) for r in plain.records
    ]
    assert not plain.compared and all(r.error is None and r.suggestion is None for r in plain.records)
    assert cmp.compared and cmp.to_dict()["compared"]


def test_zero_error_op_reports_zero():
    rep = fmp.explain(mlp, "float32", compare=True)(X, W)
    ops = [r for r in rep.records if r.category != "cast"]
    assert ops and all(r.error == 0.0 and r.added_error == 0.0 and r.sqnr_db == math.inf for r in ops)
    assert all(r.suggestion is None and not r.nonfinite and r.flips == 0 for r in ops)


def test_error_is_the_relative_l2_against_float32():
    rep = fmp.explain(lambda x, w: x @ w, compare=True)(X, W)
    (row,) = [r for r in rep.records if r.op == "dot_general"]
    want = np.asarray(X @ W, np.float64)
    got = np.asarray(jnp.matmul(X.astype(jnp.bfloat16), W.astype(jnp.bfloat16)), np.float64)
    assert row.error == pytest.approx(np.linalg.norm(got - want) / np.linalg.norm(want), rel=1e-6)
    assert row.added_error == pytest.approx(row.error)  # its inputs are exact: all its error is its own
    assert 0 < row.error < 2**-8 and row.suggestion is None  # bfloat16 roundoff: nothing to fix


def test_inherited_error_is_not_added_error():
    rep = fmp.explain(mlp, compare=True)(X, W)
    (tanh,) = [r for r in rep.records if r.op == "tanh"]
    (total,) = [r for r in rep.records if r.op == "reduce_sum"]
    assert tanh.error > 0 and total.error > 0
    assert total.added_error == 0.0  # a float32 sum of the policy's values adds nothing by itself


@jax.custom_vjp
def _sin_mm(x, w):
    return jnp.sin(x @ w)


_sin_mm.defvjp(lambda x, w: (_sin_mm(x, w), (x, w)), lambda res, g: (g @ res[1].T, res[0].T @ g))

BODIES = {
    "jit": jax.jit(lambda x, w: jax.nn.relu(x @ w)),
    "checkpoint": jax.checkpoint(lambda x, w: jnp.tanh(x @ w)),
    "custom_jvp": lambda x, w: jax.nn.gelu(x @ w),
    "custom_vjp": _sin_mm,
}


@pytest.mark.parametrize("name", sorted(BODIES))
def test_nested_bodies_are_compared(name):
    body = BODIES[name]
    rep = fmp.explain(lambda x, w: body(x, w).sum(), compare=True)(X, W)
    (mm,) = [r for r in rep.records if r.op == "dot_general"]
    assert 0 < mm.added_error < 2**-8
    exact = fmp.explain(lambda x, w: body(x, w).sum(), "float32", compare=True)(X, W)
    assert all(r.error == 0.0 for r in exact.records if r.error is not None)


@pytest.mark.parametrize("reverse", [False, True])
def test_scan_rows_are_aggregated_over_iterations(reverse):
    xs = jax.random.normal(K[2], (5, 16, 32))

    def rnn(xs, w):
        def step(h, x):
            h = jnp.tanh(x + h @ w)
            return h, h.mean()

        h, ys = jax.lax.scan(step, jnp.zeros((16, 32)), xs, reverse=reverse)
        return h.sum() + ys.sum()

    rep = fmp.explain(rnn, compare=True)(xs, W)
    plain = fmp.explain(rnn)(xs, W)
    assert [(r.op, r.category) for r in rep.records] == [(r.op, r.category) for r in plain.records]
    (mm,) = [r for r in rep.records if r.op == "dot_general"]
    assert mm.iterations == 5 and 0 < mm.added_error_mean <= mm.added_error < 2**-8
    assert mm.error_mean <= mm.error
    exact = fmp.explain(rnn, "float32", compare=True)(xs, W)
    assert all(r.error == 0.0 for r in exact.records if r.error is not None)


def test_traced_arguments_refused():
    with pytest.raises(TypeError, match="outside jit"):
        jax.jit(lambda x, w: fmp.explain(mlp, compare=True)(x, w).records)(X, W)


def test_worst_needs_compare():
    with pytest.raises(ValueError, match="compare=True"):
        fmp.explain(mlp)(X, W).worst()


# planted defects: each is found, ranked first, and fixed by the suggestion


def test_planted_exp_in_bfloat16_ranks_first_and_the_suggestion_fixes_it():
    rules = fmp.DEFAULT_RULES.derive(lower_precision=["exp"])
    x = jax.random.uniform(K[2], (8, 64), maxval=60.0)

    def f(x, w):
        return jnp.exp(x).sum() + jnp.tanh(X @ w).sum()

    rep = fmp.explain(f, rules=rules, compare=True)(x, W)
    top = rep.worst(1)[0]
    assert top.op == "exp" and top.added_error > 4 * 2**-8
    # outside any scope: the op's own source location, not every exp of the program
    assert re.fullmatch(r'overrides=\{"tests/explain/test_compare\.py:\d+:\d+": "float32"\}', top.suggestion)
    text = str(rep)
    assert text.index("exp") < text.index("fmp precision report") and "fix: overrides=" in text
    fixed = fmp.explain(f, rules=rules, compare=True, **apply(top.suggestion))(x, W)
    (exp,) = [r for r in fixed.records if r.op == "exp"]
    assert exp.added_error == 0.0 and exp.in_after == ("float32",)
    ref = f(x, W)
    assert abs(fmp.autocast(f, rules=rules, **apply(top.suggestion))(x, W) - ref) < abs(
        fmp.autocast(f, rules=rules)(x, W) - ref
    )


def test_a_bfloat16_sum_reports_its_rounding_honestly():
    # XLA accumulates a bfloat16 reduction in a wider type: 10^5 values lose only the final rounding,
    # which explain reports without crying wolf
    rules = fmp.DEFAULT_RULES.derive(lower_precision=["reduce_sum"])
    x = jax.random.uniform(K[3], (10**5,))
    rep = fmp.explain(jnp.sum, rules=rules, compare=True)(x)
    (row,) = [r for r in rep.records if r.op == "reduce_sum"]
    got, want = float(jnp.sum(x.astype(jnp.bfloat16), dtype=jnp.bfloat16)), float(np.sum(np.asarray(x, np.float64)))
    assert row.added_error == pytest.approx(abs(got - float(jnp.sum(x))) / abs(float(jnp.sum(x))), rel=1e-6)
    assert row.added_error < 2**-8 and row.suggestion is None
    assert abs(got - want) / want < 2**-8


def test_planted_float16_overflow_is_first_and_fixed():
    x = jax.random.uniform(K[4], (8, 16), minval=1.0, maxval=2.0)
    w = jnp.full((16, 16), 20.0)

    def f(x, w):
        h = x @ w  # about 480: fine in float16
        return jnp.sqrt(h * h + 1.0).mean()  # an activation h*h about 2e5: inf in float16

    rep = fmp.explain(f, "mixed_float16", compare=True)(x, w)
    top = rep.worst(1)[0]
    assert top.nonfinite and top.added_error == math.inf and top.op == "mul"
    downstream = [r for r in rep.records if r.nonfinite and r is not top]
    assert downstream and all(r.suggestion is None for r in downstream)  # they only inherit the inf
    assert re.fullmatch(r'overrides=\{"tests/explain/test_compare\.py:\d+:\d+": "float32"\}', top.suggestion)
    fix = apply(top.suggestion)
    assert not any(r.nonfinite for r in fmp.explain(f, "mixed_float16", compare=True, **fix)(x, w).records)
    assert jnp.isinf(fmp.autocast(f, "mixed_float16")(x, w))
    assert jnp.allclose(fmp.autocast(f, "mixed_float16", **fix)(x, w), f(x, w), rtol=1e-2)


def test_planted_router_flips_found_and_fixed():
    x = jax.random.normal(K[5], (256, 32))
    w = jax.random.normal(K[1], (32, 1)) + 1e-3 * jax.random.normal(K[2], (32, 8))  # near-tied experts

    def route(x, w):
        with jax.named_scope("router"):
            logits = x @ w
        return jax.lax.top_k(logits, 2)[1]

    rep = fmp.explain(route, compare=True)(x, w)
    (top_k,) = [r for r in rep.records if r.op == "top_k"]
    assert top_k.flips > 0 and top_k in rep.worst(2)
    assert top_k.suggestion == 'overrides={"router": "float32"}'  # where the logits lost their precision
    fixed = fmp.explain(route, compare=True, **apply(top_k.suggestion))(x, w)
    assert all(r.flips == 0 for r in fixed.records)
    assert jnp.array_equal(fmp.autocast(route, **apply(top_k.suggestion))(x, w), route(x, w))


def test_comparison_flags_only_policy_nonfinite():
    # an inf the program as written has too is not an overflow of the policy
    f = functools.partial(jnp.multiply, jnp.inf)
    rep = fmp.explain(lambda x: f(x) + 1.0, compare=True)(X)
    assert not any(r.nonfinite for r in rep.records)


def test_debugging_guide_example_runs():
    page = (pathlib.Path(__file__).parents[2] / "docs" / "guides" / "debugging.md").read_text()
    section = page.split("## Where is precision lost?", 1)[1]
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(block, "debugging.md", "exec"), {"__name__": "docs"})  # noqa: S102


def test_statistics_agree_in_numpy_and_compiled():
    from fmp._autocast._explain import _stats as cs
    from fmp._report._compare import combine

    r = jax.random.normal(K[0], (1 << 17,)) * 1e20  # squares beyond float32: the sums are scaled
    p = (r * (1 + 1e-3 * jax.random.normal(K[1], r.shape))).at[5].set(jnp.inf).at[6].set(jnp.nan)
    r = r.at[6].set(jnp.nan)  # a NaN in both runs is no difference
    small = jax.random.normal(K[2], r.shape)  # plain sums of squares on the device
    pairs = [
        (p, r),
        (p.at[5].set(r[5]), r),
        (small.astype(jnp.bfloat16), small),
        (small, small),
        ((small * 1e-30).astype(jnp.bfloat16), small * 1e-30),
    ]
    plain = [cs._plain(cs._plain_sums(a, b, jnp.float32), jnp.float32) for a, b in pairs]
    assert plain == [False, False, True, True, False]  # non-finite, squares over float32, ..., squares flushed
    for a, b in pairs:
        dev = cs.output_stats([a], [b])
        host = combine([cs.JAX_OPS.parts(a, b)])
        assert dev[0] == pytest.approx(host[0], rel=1e-4) and dev[2] == pytest.approx(host[2], rel=1e-6)
        assert dev[3] == host[3] and dev[5] == pytest.approx(host[5], rel=1e-6)  # the largest reference value
    err, _, _, nonfinite, _, _ = cs.output_stats([p.at[5].set(r[5])], [r])
    assert not nonfinite and err == pytest.approx(1e-3, rel=0.05)
    assert cs.output_stats([p], [r])[3] and cs.output_stats([p], [r])[0] == math.inf


def test_compare_with_a_delayed_float8_state_is_refused_naming_the_way_out():
    f = lambda x, w: jnp.tanh(x @ w).sum()  # noqa: E731
    x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
    policy = "p=f32,c=bf16,o=f32,float8=delayed"
    state = fmp.float8_state(f, policy)(x, w)
    with pytest.raises(NotImplementedError, match="does not take float8_state yet: compare without it"):
        fmp.explain(f, policy, compare=True, float8_state=state)(x, w)
