"""fmp.explain(compare=True) on loop and branch shapes real code has: the same rows as without compare, the
loop run as the rewrite runs it, and no fix suggested for an op that already runs in float32."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fmp

K = jax.random.split(jax.random.key(7), 4)
X = jax.random.normal(K[0], (16, 32))
W = jax.random.normal(K[1], (32, 32)) / 6


def _rows(rep):
    return [(r.op, r.category, r.in_after, r.out_after) for r in rep.records]


def test_switch_rows_match_explain_without_compare():
    # the branches disagree on the output dtype (sin stays bfloat16, exp runs in float32): the rewrite pins
    # the output in every branch, one cast row each, whichever branch runs
    def f(i, x):
        return jax.lax.switch(i, [lambda x: jnp.sin(x @ W), lambda x: jnp.exp(x @ W), lambda x: x @ W + x], x)

    for i in range(3):
        rep = fmp.explain(f, compare=True)(jnp.int32(i), X)
        assert _rows(rep) == _rows(fmp.explain(f)(jnp.int32(i), X))
        (taken,) = {r.index for r in rep.records if r.op == "dot_general" and r.iterations == 1}
        assert taken == [r.index for r in rep.records if r.op == "dot_general"][i]


def test_scan_with_a_cond_whose_branch_changes_between_iterations():
    def f(x):
        def body(h, xi):
            h = jax.lax.cond(xi.sum() > 0, lambda h: jnp.sin(h @ W), lambda h: h * 0.5, h)
            return h + xi, h.sum()

        return jax.lax.scan(body, jnp.zeros(32), x)

    rep = fmp.explain(f, compare=True)(X)
    assert _rows(rep) == _rows(fmp.explain(f)(X))
    taken = int(jnp.sum(X.sum(1) > 0))
    assert 0 < taken < 16
    runs = {r.op: r.iterations for r in rep.records if r.op in ("sin", "mul")}
    assert runs == {"sin": taken, "mul": 16 - taken}


def test_a_loop_literal_carry_is_run_as_the_rewrite_runs_it():
    # the loop's initial 0.0 is a literal of the program: the rewrite traces the body with it as a float32
    # carry, so the add runs in float32 in every iteration, the first one included
    m, n = jax.random.uniform(K[2], (32, 64)) * 0.03, jax.random.uniform(K[3], (64, 32)) * 0.03

    def f(m, n):
        body = lambda c: (c[0] + (m @ n)[0, 0], c[1] + 1)  # noqa: E731
        return jax.lax.while_loop(lambda c: c[1] < 50, body, (0.0, 0))

    rep = fmp.explain(f, compare=True)(m, n)
    assert _rows(rep) == _rows(fmp.explain(f)(m, n))
    (add,) = [r for r in rep.records if r.op == "add" and r.in_after]
    assert add.in_after == ("float32", "float32") and add.iterations == 50
    got, want = np.float64(fmp.autocast(f)(m, n)[0]), np.float64(f(m, n)[0])
    assert add.error == pytest.approx(abs(got - want) / want, rel=1e-3)


def test_a_float32_carry_writer_is_not_charged_the_loop_error():
    # the carry's error comes from the bfloat16 matmul; the tanh writing it runs in float32 already, so
    # moving it to float32 fixes nothing: no suggestion, no charge
    def f(x, n):
        return jax.lax.fori_loop(0, n, lambda i, h: jnp.tanh(h @ W + x[i % 16]), jnp.zeros(32))

    rep = fmp.explain(f, compare=True)(X, jnp.int32(10))
    (tanh,) = [r for r in rep.records if r.op == "tanh"]
    assert tanh.out_after == ("float32",)
    assert tanh.suggestion is None and "compounded" not in tanh.detail
    assert tanh.added_error < 2**-8


def test_a_while_loop_that_never_runs_lists_its_body():
    # a fori_loop with traced bounds and no iterations: the body's rows are listed (iterations 0), as
    # explain without compare lists them
    def f(x, n):
        return jax.lax.fori_loop(0, n, lambda i, h: jnp.tanh(h @ W + x[i % 16]), jnp.zeros(32))

    rep = fmp.explain(f, compare=True)(X, jnp.int32(0))
    assert _rows(rep) == _rows(fmp.explain(f)(X, jnp.int32(0)))
    (mm,) = [r for r in rep.records if r.op == "dot_general"]
    assert mm.iterations == 0 and mm.error is None and mm.suggestion is None


@pytest.mark.parametrize("loop", ["scan", "while", "none"])
def test_an_op_in_a_loop_that_magnifies_its_inputs_names_their_maker_in_every_iteration(loop):
    # angles rounded to bfloat16 by a matmul outside the loop, their cos taken one chunk per iteration: the
    # worst chunk (the largest angles, the last iteration) names the matmul, and moving it fixes the cos
    pos = jnp.arange(2048.0).reshape(8, 256, 1) * jnp.ones((1, 1, 64)) / 64
    freq = jnp.eye(64)[:, :32] * 2.0

    def f(pos, freq, n):
        ang = pos @ freq
        if loop == "scan":
            return jax.lax.scan(lambda c, a: (c + jnp.cos(a).sum(), None), jnp.float32(0.0), ang)[0]
        if loop == "while":
            return jax.lax.fori_loop(0, n, lambda i, c: c + jnp.cos(ang[i]).sum(), jnp.float32(0.0))
        return jnp.cos(ang[7]).sum()  # a slice only moves the rounded angles: the matmul rounded them

    n = jnp.int32(8)
    rep = fmp.explain(f, compare=True)(pos, freq, n)
    (cos,) = [r for r in rep.records if r.op == "cos"]
    assert cos.iterations == (1 if loop == "none" else 8) and cos.error > 16 * cos.added_error
    # the matmul that rounded the angles, by its source line: no other matmul moves
    assert re.fullmatch(r'overrides=\{"tests/explain/test_compare_review\.py:\d+:\d+": "float32"\}', cos.suggestion)
    fixed = fmp.explain(f, compare=True, **rep.suggested())(pos, freq, n)
    assert [r.error for r in fixed.records if r.op == "cos"] == [0.0]


def test_torch_a_slice_of_rounded_angles_is_looked_through_to_the_matmul():
    # the angles are rounded by the matmul in module "0"; module "1" slices them and takes their cos: the
    # fix is module "0" in float32 (module "1" in float32 would slice and cos the same rounded angles)
    torch = pytest.importorskip("torch")
    import fmp.torch

    class Angles(torch.nn.Module):
        def forward(self, x):
            pos = torch.arange(x.shape[0], dtype=torch.float32)
            return pos[:, None] @ (1.0 / (10000.0 ** (torch.arange(32).float() / 32)))[None, :]

    class Use(torch.nn.Module):
        def forward(self, a):
            return a[:, :16].cos().sum(0)

    model, x = torch.nn.Sequential(Angles(), Use()), torch.randn(2048, 32)
    rep = fmp.torch.explain_fx(model, (x,), ("cpu", torch.bfloat16), compare=True)
    top = rep.worst(1)[0]
    assert top.op == "aten::cos" and top.suggestion == 'overrides={"0": "float32"}'
    fixed = fmp.torch.explain_fx(model, (x,), ("cpu", torch.bfloat16), compare=True, overrides={"0": "float32"})
    assert [r.error for r in fixed.records if r.op == "aten::cos"][0] < 1e-6
