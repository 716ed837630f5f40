"""fmp.explain(compare=True) inside while loops, fori loops and cond: one row per equation, runs counted."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fmp

K = jax.random.split(jax.random.key(1), 4)
X = jax.random.normal(K[0], (16, 32))
W = jax.random.normal(K[1], (32, 32)) / 6


def _plain_rows(rep):
    return [(r.op, r.category) for r in rep.records]


@pytest.mark.parametrize("static", [True, False])
def test_fori_loop_rows_are_aggregated(static):
    # static bounds make a scan, traced bounds a while loop: both give one row per equation
    def f(x, n):
        return jax.lax.fori_loop(0, 4 if static else n, lambda i, h: jnp.tanh(h @ W), x).sum()

    n = jnp.int32(4)
    rep = fmp.explain(f, compare=True)(X, n)
    assert _plain_rows(rep) == _plain_rows(fmp.explain(f)(X, n))
    (mm,) = [r for r in rep.records if r.op == "dot_general"]
    assert mm.iterations == 4 and 0 < mm.added_error_mean <= mm.added_error < 2**-8
    exact = fmp.explain(f, "float32", compare=True)(X, n)
    assert all(r.error == 0.0 for r in exact.records if r.error is not None)


def test_while_loop_counts_iterations_and_compares_its_predicate():
    def f(x):
        def body(c):
            i, h = c
            return i + 1, jnp.tanh(h @ W) + 0.1

        return jax.lax.while_loop(lambda c: (c[0] < 7) & (c[1].sum() < 1e9), body, (0, x))[1].sum()

    rep = fmp.explain(f, compare=True)(X)
    assert _plain_rows(rep) == _plain_rows(fmp.explain(f)(X))
    (mm,) = [r for r in rep.records if r.op == "dot_general"]
    assert mm.iterations == 7 and 0 < mm.added_error < 2**-8
    lts = [r for r in rep.records if r.op == "lt"]  # the condition is tested once more than the body runs
    assert lts and all(r.iterations == 8 and r.flips == 0 for r in lts)


def test_while_loop_that_stops_at_another_iteration_flips_its_predicate():
    # s + s/3 in bfloat16 steps: the two runs cross 100 at different iterations
    rules = fmp.DEFAULT_RULES.derive(lower_precision=["add"])

    def f(x):
        body = lambda s: (s[0] + s[1], s[1], s[2] + 1)  # noqa: E731
        return jax.lax.while_loop(lambda s: s[0] < 100.0, body, (x, x / 3, 0))

    x = jnp.float32(1.0)
    trips = int(f(x)[2]), int(fmp.autocast(f, rules=rules)(x)[2])
    assert trips[0] != trips[1]
    rep = fmp.explain(lambda x: f(x)[0], rules=rules, compare=True)(x)
    (lt,) = [r for r in rep.records if r.op == "lt"]
    assert lt.flips == 1 and lt.iterations == min(trips) + 1  # tested where both ran, and where one stopped
    assert f"the loop ran {trips[1]} iterations under the policy, {trips[0]} as written" in lt.detail
    (add,) = [r for r in rep.records if r.op == "add" and r.out_after == ("bfloat16",)]
    assert add.error > 0


def test_cond_rows_per_branch_with_times_taken():
    def f(x, w):
        def step(h, _):
            h = jax.lax.cond(h.sum() > 0, lambda h: jnp.tanh(h @ w), lambda h: jnp.sin(h @ w) - 0.5, h)
            return h, None

        return jax.lax.scan(step, x, None, length=6)[0].sum()

    rep = fmp.explain(f, compare=True)(X, W)
    assert _plain_rows(rep) == _plain_rows(fmp.explain(f)(X, W))
    mms = [r for r in rep.records if r.op == "dot_general"]
    assert len(mms) == 2  # one per branch
    ref = np.asarray(X)
    taken = []
    for _ in range(6):
        taken.append(ref.sum() > 0)
        ref = np.tanh(ref @ W) if taken[-1] else np.sin(ref @ W) - 0.5
    assert sorted(r.iterations for r in mms) == sorted([sum(taken), 6 - sum(taken)])
    assert all(0 < r.added_error < 2**-8 for r in mms if r.iterations)


def test_cond_branch_not_taken_has_no_errors():
    def f(x):
        return jax.lax.cond(x.sum() > 1e9, jnp.exp, lambda x: jnp.tanh(x @ W), x).sum()

    rep = fmp.explain(f, compare=True)(X)
    (exp,) = [r for r in rep.records if r.op == "exp"]
    (mm,) = [r for r in rep.records if r.op == "dot_general"]
    assert exp.iterations == 0 and exp.error is None and exp.suggestion is None
    assert mm.iterations == 1 and mm.error > 0


def test_cond_taken_differently_flips_its_predicate_and_says_so():
    # the predicate rounds differently in bfloat16: each run takes its own branch. The policy's branch is
    # compared on the reference inputs, its rows name both branches; the output's reference is the other's
    x = jnp.full((4, 8), 1.0 + 2.0**-10)

    def f(x, w):
        s = (x @ w).sum()
        return jax.lax.cond(s > 32.0, jnp.sin, jnp.cos, s)

    rep = fmp.explain(f, compare=True)(x, jnp.eye(8))
    (gt,) = [r for r in rep.records if r.op == "gt"]
    assert gt.flips == 1
    (sin,), (cos,) = ([r for r in rep.records if r.op == op] for op in ("sin", "cos"))
    taken, other = (cos, sin) if cos.iterations else (sin, cos)
    assert taken.iterations == 1 and other.iterations == 0 and other.error is None
    assert taken.detail.endswith("under the policy, 1 as written" if taken is cos else "under the policy, 0 as written")


def test_a_linear_solve_is_refused_not_misreported():
    def f(x):
        matvec = lambda v: 2.0 * v  # noqa: E731
        return jax.lax.custom_linear_solve(matvec, x, lambda _, b: b / 2.0).sum()

    with pytest.raises(NotImplementedError, match="does not yet compare inside 'custom_linear_solve'"):
        fmp.explain(f, compare=True)(X)
    assert fmp.explain(f)(X).records  # without compare the dtypes are still reported
