"""``fmp.explain(compare=True)`` as one compiled program, beside the op-by-op comparison it stands for.

A call without loops, branches or float8 runs the whole comparison as one compiled program; every other
call (and a call whose statistics need the arrays themselves) goes op by op. Both must report the same
numbers (up to float32 rounding: XLA compiles the reference a little differently), and the same rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fmp
from fmp._autocast._explain import _compiled


def _op_by_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_compiled, "run", lambda *args: None)


def _builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    built: list[int] = []
    build = _compiled._build

    def counted(*args):
        built.append(1)
        return build(*args)

    monkeypatch.setattr(_compiled, "_build", counted)
    return built


def _block(p, x):
    h = x @ p["w1"] + p["b1"]
    h = jax.nn.gelu(h, approximate=True)
    s = jax.nn.softmax((h @ p["w2"]) / 8.0, axis=-1)
    return jnp.mean(jnp.square(s @ p["w3"] - x))


def _params():
    k = jax.random.split(jax.random.key(0), 5)
    return (
        {
            "w1": jax.random.normal(k[0], (64, 256)) / 8,
            "b1": jax.random.normal(k[1], (256,)) / 10,
            "w2": jax.random.normal(k[2], (256, 256)) / 16,
            "w3": jax.random.normal(k[3], (256, 64)) / 16,
        },
        jax.random.normal(k[4], (512, 64)),
    )


FIELDS = ("error", "added_error", "max_abs_error", "ref_max")


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_the_compiled_comparison_reports_what_the_op_by_op_one_does(policy, monkeypatch):
    params, x = _params()
    built = _builds(monkeypatch)
    compiled = fmp.explain(_block, policy, compare=True)(params, x)
    assert built, "the call should have run as one compiled program"
    with monkeypatch.context() as m:
        _op_by_op(m)
        op_by_op = fmp.explain(_block, policy, compare=True)(params, x)
    assert len(compiled.records) == len(op_by_op.records)
    for a, b in zip(compiled.records, op_by_op.records, strict=True):
        assert (a.op, a.in_after, a.out_after, a.suggestion, a.nonfinite, a.flips) == (
            b.op,
            b.in_after,
            b.out_after,
            b.suggestion,
            b.nonfinite,
            b.flips,
        )
        for f in FIELDS:
            u, v = getattr(a, f), getattr(b, f)
            if u is None or v is None:
                assert u is v, (a.index, a.op, f)
            else:  # float32 rounding apart, no more
                assert abs(u - v) <= 1e-2 * max(abs(u), abs(v)) + 1e-6, (a.index, a.op, f, u, v)
    assert compiled.verdict == op_by_op.verdict


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_rounding_before_a_reduction_is_measured(dtype, monkeypatch):
    # XLA CPU's YNNPACK reductions drop a round trip to bfloat16 fused into them: a statistic computed
    # that way would report a low-precision tanh as exact
    rules = fmp.DEFAULT_RULES.derive(lower_precision=["tanh"])
    x = jax.random.normal(jax.random.key(1), (8, 128, 256))
    u = {"bfloat16": 2.0**-8, "float16": 2.0**-11}[dtype]
    got = []
    for op_by_op in (False, True):
        with monkeypatch.context() as m:
            if op_by_op:
                _op_by_op(m)
            rep = fmp.explain(jnp.tanh, f"mixed_{dtype}", rules=rules, compare=True)(x)
        (row,) = [r for r in rep.records if r.op == "tanh"]
        assert row.out_after == (dtype,)
        assert 0.05 * u < row.added_error < u, row.added_error
        got.append(row.added_error)
    assert got[0] == pytest.approx(got[1], rel=1e-3)


def test_an_op_alone_sees_a_constant_as_the_policy_run_did(monkeypatch):
    # gelu's 0.044715 * x**3 and 1 + tanh(...) run in bfloat16 under the policy (their constants follow the
    # other input); the op run alone on the reference inputs must too, so each adds bfloat16's rounding
    def f(x, w):
        return jnp.sum(jax.nn.gelu(x @ w, approximate=True))

    x = jax.random.normal(jax.random.key(0), (64, 128))
    w = jax.random.normal(jax.random.key(1), (128, 128)) / 11
    for op_by_op in (False, True):
        with monkeypatch.context() as m:
            if op_by_op:
                _op_by_op(m)
            rep = fmp.explain(f, "mixed_bfloat16", compare=True)(x, w)
        rows = [r for r in rep.records if r.op in ("mul", "add") and r.out_after == ("bfloat16",)]
        assert len(rows) == 6
        # only the multiplication by 0.5 is exact
        assert sorted(r.added_error > 2.0**-10 for r in rows) == [False] + [True] * 5, [r.added_error for r in rows]


def test_a_repeated_call_runs_its_program_again_and_a_new_constant_makes_a_new_one(monkeypatch):
    built = _builds(monkeypatch)
    w = {"w": jnp.eye(64) / 4}

    def f(x):
        return jnp.mean(jnp.tanh(x @ w["w"]))

    x = jax.random.normal(jax.random.key(2), (256, 64))
    explain = fmp.explain(f, "mixed_bfloat16", compare=True)
    first, again = explain(x), explain(x)
    assert len(built) == 1
    assert [r.error for r in first.records] == [r.error for r in again.records]
    w["w"] = jnp.eye(64) * 8  # a closed-over array: the program's constant changed
    changed = explain(x)
    assert len(built) == 2
    dots = [r for r in changed.records if r.op == "dot_general"]
    assert first.records[[r.op for r in first.records].index("dot_general")].ref_max == pytest.approx(
        float(jnp.max(jnp.abs(x))) / 4
    )
    assert dots[0].ref_max == pytest.approx(8 * float(jnp.max(jnp.abs(x))))


def test_loops_and_non_finite_values_go_op_by_op(monkeypatch):
    built = _builds(monkeypatch)

    def scanned(x):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ c.T @ c), None), x, None, length=3)[0].sum()

    rep = fmp.explain(scanned, "mixed_bfloat16", compare=True)(jnp.eye(16) / 2)
    assert not built and any(r.iterations == 3 for r in rep.records)

    def overflows(x, w):
        return jnp.sum(jnp.tanh(x @ w / 1e4))

    x = 20.0 + jnp.abs(jax.random.normal(jax.random.key(3), (64, 512)))
    w = 20.0 + jnp.abs(jax.random.normal(jax.random.key(4), (512, 64)))  # x @ w > 512 * 400: past float16's 65504
    rep = fmp.explain(overflows, "mixed_float16", compare=True)(x, w)
    assert len(built) == 1  # compiled, then run op by op: its statistics needed the arrays
    (row,) = rep.needs_fix
    assert row.op == "dot_general" and row.added_error == np.inf and row.ref_max > 65504


def test_keys_and_large_closed_over_arrays(monkeypatch):
    built = _builds(monkeypatch)

    def f(x, key):
        return jnp.mean(jnp.tanh(x @ x.T) * jax.random.normal(key, (32, 32)))

    x = jax.random.normal(jax.random.key(5), (32, 64))
    rep = fmp.explain(f, "mixed_bfloat16", compare=True)(x, jax.random.key(6))  # a typed key argument
    assert len(built) == 1 and any(r.op == "dot_general" for r in rep.records)

    big = jnp.ones((64, 70_000)) / 64  # 17 MB closed over: compiled in, it would slow the compilation

    def g(x):
        return jnp.mean(jnp.tanh(x @ big))

    rep = fmp.explain(g, "mixed_bfloat16", compare=True)(x)
    assert len(built) == 1 and any(r.op == "dot_general" and r.error for r in rep.records)
