"""Higher-order primitives, custom derivatives, nested regions, overrides and explain."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers.common import run_with_devices
from _helpers.jaxprs import in_dtypes, rewritten
from jax.sharding import PartitionSpec as P

import fmp
from fmp._autocast._engine import _jax_internals

W = jnp.eye(4) * 0.5 + 0.01
X = jnp.linspace(-0.5, 1.0, 16).reshape(4, 4)
BF = ("bfloat16", "bfloat16")


def _jit(x, w):
    return jax.jit(lambda a, b: jnp.tanh(a @ b))(x, w)


def _scan(x, w):
    return jax.lax.scan(lambda c, xi: (jnp.tanh(c @ w) + xi, c.sum()), x, jnp.ones((3, 4)))


def _while(x, w):
    return jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (jnp.tanh(c[0] @ w), c[1] + 1), (x, 0))[0]


def _fori(x, w):
    return jax.lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c @ w), x)


def _cond(x, w):
    return jax.lax.cond(x.sum() > 0, lambda a: a @ w, lambda a: a * 2.0, x)


def _switch_mixed(x, w):
    # one branch produces bf16 (a dot), the other float32 (an exp): outputs are pinned to float32
    return jax.lax.switch(1, [lambda a: a @ w, lambda a: jnp.exp(a)], x)


def _remat(x, w):
    return jax.checkpoint(lambda a: jnp.sin(a @ w))(x)


def _remat_policy(x, w):
    return jax.checkpoint(lambda a: jnp.sin(a @ w), policy=jax.checkpoint_policies.dots_saveable)(x)


@jax.custom_jvp
def _cjvp(x, w):
    return jnp.tanh(x @ w)


_cjvp.defjvp(lambda p, t: (_cjvp(*p), jnp.full((4, 4), 3.0)))


@jax.custom_vjp
def _cvjp(x, w):
    return jnp.tanh(x @ w)


_cvjp.defvjp(lambda x, w: (_cvjp(x, w), None), lambda _, g: (jnp.full((4, 4), 42.0), jnp.full((4, 4), 7.0)))


def _shard_map(x, w):
    mesh = jax.make_mesh((1,), ("d",))
    body = lambda a, b: jax.lax.psum(a @ b, "d")  # noqa: E731
    return jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P())(x, w)


def _nested_hops(x, w):
    def body(c, _):
        return jax.jit(lambda c: jax.checkpoint(lambda c: _cond(c, w))(c))(c), None

    return jax.lax.scan(body, x, None, length=2)[0]


CASES = {
    "jit": _jit,
    "scan": _scan,
    "while": _while,
    "fori": _fori,
    "cond": _cond,
    "switch_mixed": _switch_mixed,
    "remat": _remat,
    "remat_policy": _remat_policy,
    "custom_jvp": _cjvp,
    "custom_vjp": _cvjp,
    "shard_map": _shard_map,
    "nested": _nested_hops,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_dot_inside_runs_in_compute_dtype(name):
    fn = CASES[name]
    cj = rewritten(fn, X, W)
    dots = in_dtypes(cj, "dot_general")
    assert dots and all(d == BF for d in dots), dots
    out = fmp.autocast(fn)(X, W)
    ref = fn(X, W)
    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        assert o.dtype == r.dtype
        np.testing.assert_allclose(o, r, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("name", ["jit", "scan", "fori", "cond", "remat", "custom_jvp", "shard_map", "nested"])
def test_grads_through_hops_are_float32_and_close(name):
    fn = CASES[name]
    loss = lambda f: lambda x, w: jnp.sum(jax.tree.leaves(f(x, w))[0] ** 2)  # noqa: E731
    g = jax.jit(jax.grad(loss(fmp.autocast(fn)), argnums=(0, 1)))(X, W)
    r = jax.grad(loss(fn), argnums=(0, 1))(X, W)
    for a, b in zip(g, r, strict=True):
        assert a.dtype == jnp.float32
        np.testing.assert_allclose(a, b, rtol=5e-2, atol=5e-2)


def test_custom_vjp_sentinel_survives():
    gx, gw = jax.grad(lambda x, w: fmp.autocast(_cvjp)(x, w).sum(), argnums=(0, 1))(X, W)
    np.testing.assert_array_equal(gx, jnp.full((4, 4), 42.0))
    np.testing.assert_array_equal(gw, jnp.full((4, 4), 7.0))


def test_custom_jvp_rule_still_applies():
    _, t = jax.jvp(fmp.autocast(_cjvp), (X, W), (X, W))
    np.testing.assert_array_equal(t, jnp.full((4, 4), 3.0))


def test_loop_carry_keeps_its_type():
    cj = rewritten(_scan, X, W)
    (scan,) = [e for e in cj.eqns if e.primitive.name == "scan"]
    body = scan.params["jaxpr"]
    assert body.in_avals[1].dtype == body.out_avals[0].dtype == jnp.float32


def test_shard_map_on_eight_devices():
    out = run_with_devices(
        """
        import jax, jax.numpy as jnp, numpy as np, fmp
        from jax.sharding import PartitionSpec as P
        mesh = jax.make_mesh((8,), ("d",))
        jax.set_mesh(mesh)
        def f(x, w):
            return jax.shard_map(lambda a, b: jax.lax.psum(a @ b, "d"), mesh=mesh,
                                 in_specs=(P(None, "d"), P("d", None)), out_specs=P())(x, w)
        from jax.sharding import NamedSharding
        x = jax.device_put(jnp.linspace(-1, 1, 64).reshape(4, 16), NamedSharding(mesh, P(None, "d")))
        w = jax.device_put(jnp.linspace(-1, 1, 16 * 4).reshape(16, 4), NamedSharding(mesh, P("d", None)))
        cj = jax.make_jaxpr(fmp.autocast(f))(x, w)
        (sm,) = [e for e in cj.eqns if e.primitive.name == "shard_map"]
        dots = [e for e in sm.params["jaxpr"].eqns if e.primitive.name == "dot_general"]
        print([v.aval.dtype.name for v in dots[0].invars])
        np.testing.assert_allclose(jax.jit(fmp.autocast(f))(x, w), f(x, w), rtol=3e-2, atol=3e-2)
        print(jax.grad(lambda x: fmp.autocast(f)(x, w).sum())(x).dtype)
        """
    )
    assert out.split() == ["['bfloat16',", "'bfloat16']", "float32"]


# ---------------------------------------------------------------- nested regions


def test_inner_disabled_region_keeps_float32():
    inner = fmp.autocast(lambda a, b: a @ b, enabled=False)
    cj = rewritten(lambda x, w: inner(x @ w, w), X, W)
    assert in_dtypes(cj, "dot_general") == [BF, ("float32", "float32")]


def test_inner_region_with_another_policy():
    inner = fmp.autocast(lambda a, b: a @ b, policy="mixed_float16")
    cj = rewritten(lambda x, w: inner(x, w) + x @ w, X, W)
    assert in_dtypes(cj, "dot_general") == [("float16", "float16"), BF]


def test_inner_region_inside_outer_jit_and_scan():
    inner = fmp.autocast(lambda a: a @ W, enabled=False)

    def f(x):
        return jax.lax.scan(lambda c, _: (jax.jit(inner)(c) + c @ W, None), x, None, length=2)[0]

    cj = rewritten(f, X)
    assert sorted(in_dtypes(cj, "dot_general")) == [BF, ("float32", "float32")]


def test_disabled_region_is_bitwise_the_original():
    f = lambda x, w: jnp.tanh(x @ w).sum()  # noqa: E731
    outer = fmp.autocast(lambda x, w: fmp.autocast(f, enabled=False)(x, w))
    np.testing.assert_array_equal(outer(X, W), f(X, W))


# ---------------------------------------------------------------- overrides


def test_override_by_named_scope():
    def f(x, w):
        with jax.named_scope("LayerNorm"):
            y = jax.jit(lambda a: a @ w)(x)  # the scope reaches into the jit body
        return y + x @ w

    cj = rewritten(f, X, W, overrides={"LayerNorm": "float32"})
    assert in_dtypes(cj, "dot_general") == [("float32", "float32"), BF]


def test_innermost_override_wins():
    def f(x, w):
        with jax.named_scope("Block"), jax.named_scope("attn"):
            return x @ w

    cj = rewritten(f, X, W, overrides={"Block": "float32", "attn": "mixed_float16"})
    assert in_dtypes(cj, "dot_general") == [("float16", "float16")]


# ---------------------------------------------------------------- explain


_MODEL = """
import jax

def loss(x, w):
    return jax.nn.softmax(x @ w).sum()
"""


def test_explain_source_paths_are_short_and_the_full_path_is_kept(tmp_path, monkeypatch):
    """Inside the working directory a row shows the relative path, outside it the file name."""
    import importlib.util

    path = tmp_path / "project" / "pkg" / "model.py"
    path.parent.mkdir(parents=True)
    path.write_text(_MODEL)
    spec = importlib.util.spec_from_file_location("explain_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = fmp.explain(module.loss)
    monkeypatch.chdir(tmp_path / "project")
    (dot,) = report(X, W).filter(op="dot_general").records
    assert dot.source == "pkg/model.py:5:26 (loss)", dot.source
    assert dot.source_full == f"{path}:5:26 (loss)" and dot.to_dict()["source_full"] == dot.source_full
    monkeypatch.chdir(tmp_path)
    assert report(X, W).filter(op="dot_general").records[0].source == "project/pkg/model.py:5:26 (loss)"
    monkeypatch.chdir(tmp_path.parent)
    table = str(report(X, W))
    assert "model.py:5:26 (loss)" in table and str(tmp_path) not in table


def test_short_source():
    from fmp._report._records import short_source

    site = "/usr/lib/python3.11/site-packages/flax/linen/linear.py:80:4 (__call__)"
    assert short_source(site, "/home/me/proj") == "linear.py:80:4 (__call__)"
    assert short_source("/home/me/proj/src/m.py:3 (f)", "/home/me/proj") == "src/m.py:3 (f)"
    assert short_source("/home/me/project2/m.py:3 (f)", "/home/me/proj") == "m.py:3 (f)"  # a prefix, not a parent
    assert short_source("<stdin>:1 (<module>)", "/home/me/proj") == "<stdin>:1 (<module>)"
    assert short_source("", "/home/me/proj") == ""


def test_explain_report():
    def f(x, w):
        h = x @ w
        return jax.nn.softmax(h, axis=-1), jnp.mean(h)

    rep = fmp.explain(f)(X, W)
    ops = {r.op: r for r in rep.records}
    assert ops["dot_general"].in_before == ("float32", "float32")
    assert ops["dot_general"].in_after == BF
    assert ops["dot_general"].out_after == ("bfloat16",)
    assert ops["dot_general"].category == "lower_precision"
    assert ops["dot_general"].flops == 2 * 4 * 4 * 4
    assert "test_hops.py" in ops["dot_general"].source
    assert ops["exp"].out_after == ("float32",) and ops["exp"].category == "float32"
    assert ops["reduce_sum"].in_after == ("float32",)
    s = rep.summary
    assert s["low_precision_flop_share"] == 1.0
    assert s["casts_inserted"] == sum(1 for r in rep.records if r.category == "cast") >= 3
    assert s["float32_islands"] >= 1
    text = str(rep)
    assert "dot_general" in text and "bf16" in text and "casts inserted" in text
    d = rep.to_dict()
    assert d["framework"] == "jax" and d["records"][0]["op"] == rep.records[0].op


def test_explain_nested_and_override_rows():
    inner = fmp.autocast(lambda a: a @ W, enabled=False)
    rep = fmp.explain(lambda x: inner(x) @ W)(X)
    cats = [r.category for r in rep.records if r.op == "dot_general"]
    assert cats == ["nested", "lower_precision"]
    assert rep.summary["low_precision_flop_share"] == pytest.approx(0.5)


def test_explain_does_not_compute():
    calls = []

    def f(x):
        jax.debug.callback(lambda: calls.append(1))
        return x @ x

    fmp.explain(f)(X)
    assert calls == []


def test_custom_vjp_fwd_rule_is_autocast_under_grad():
    @jax.custom_vjp
    def f(x, w):
        return jnp.tanh(x @ w)

    def fwd(x, w):
        y = jnp.tanh(x @ w)
        return y, (y,)

    f.defvjp(fwd, lambda res, g: (g * 2.0, jnp.full((4, 4), 7.0)))
    loss = lambda x, w: fmp.autocast(f)(x, w).sum()  # noqa: E731
    cj = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(X, W)
    assert in_dtypes(cj, "dot_general") == [BF]  # the forward that runs under grad is the fwd rule
    gx, gw = jax.grad(loss, argnums=(0, 1))(X, W)
    np.testing.assert_array_equal(gx, jnp.full((4, 4), 2.0))
    np.testing.assert_array_equal(gw, jnp.full((4, 4), 7.0))


def test_custom_jvp_rule_is_autocast():
    @jax.custom_jvp
    def f(x, w):
        return x @ w

    f.defjvp(lambda p, t: (f(*p), t[0] @ p[1] + p[0] @ t[1]))
    cj = jax.make_jaxpr(lambda x, w: jax.jvp(fmp.autocast(f), (x, w), (x, w)))(X, W)
    assert in_dtypes(cj, "dot_general") and all(d == BF for d in in_dtypes(cj, "dot_general"))


# ---------------------------------------------------------------- loop carries (fixed point)


def _body_carry_dtypes(cj, prim):
    (eqn,) = [e for e in cj.eqns if e.primitive.name == prim]
    if prim == "scan":
        body, (nc, nk) = eqn.params["jaxpr"], _jax_internals.scan_counts(eqn.params)
        return [a.dtype.name for a in body.in_avals[nc : nc + nk]], [a.dtype.name for a in body.out_avals[:nk]]
    body, nb = eqn.params["body_jaxpr"], eqn.params["body_nconsts"]
    return [a.dtype.name for a in body.in_avals[nb:]], [a.dtype.name for a in body.out_avals]


def _bf16_rnn(x, w):
    # the carry enters in bfloat16 (a matmul's result) and the body keeps it bfloat16
    return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x @ w, None, length=3)[0]


def _widening(x, w):
    # the carry enters in bfloat16, but the body returns float32 (exp is a float32 op): it widens
    return jax.lax.scan(lambda c, _: (c + jnp.exp(c), None), x @ w, None, length=2)[0]


def _while_bf16(x, w):
    def body(c):
        h, i = c
        return jnp.tanh(h @ w), i + 1

    return jax.lax.while_loop(lambda c: (c[1] < 3) & (c[0][0, 0] < 10), body, (x @ w, 0))[0]


def test_loop_carry_stays_in_compute_dtype_when_the_body_keeps_it():
    cj = rewritten(_bf16_rnn, X, W)
    assert _body_carry_dtypes(cj, "scan") == (["bfloat16"], ["bfloat16"])
    (scan,) = [e for e in cj.eqns if e.primitive.name == "scan"]
    body_prims = [e.primitive.name for e in scan.params["jaxpr"].eqns]
    assert "convert_element_type" not in body_prims[1:]  # only the weight is cast (once, first)
    cj = rewritten(_while_bf16, X, W)
    assert _body_carry_dtypes(cj, "while") == (["bfloat16", "int32"], ["bfloat16", "int32"])
    for fn in (_bf16_rnn, _while_bf16):
        out = jax.jit(fmp.autocast(fn))(X, W)
        assert out.dtype == jnp.float32  # a float32 output of fn is returned in float32
        np.testing.assert_allclose(out, fn(X, W), rtol=3e-2, atol=3e-2)


def test_loop_carry_widens_to_what_the_body_returns():
    cj = rewritten(_widening, X, W)
    assert _body_carry_dtypes(cj, "scan") == (["float32"], ["float32"])
    np.testing.assert_allclose(fmp.autocast(_widening)(X, W), _widening(X, W), rtol=3e-2, atol=3e-2)


def test_loop_carry_grads_and_explain_rows():
    loss = lambda f: lambda x, w: jnp.sum(f(x, w) ** 2)  # noqa: E731
    g, r = jax.jit(
        lambda x, w: (
            jax.grad(loss(fmp.autocast(_bf16_rnn)), argnums=(0, 1))(x, w),
            jax.grad(loss(_bf16_rnn), argnums=(0, 1))(x, w),
        )
    )(X, W)
    for a, b in zip(g, r, strict=True):
        assert a.dtype == jnp.float32
        np.testing.assert_allclose(a, b, rtol=5e-2, atol=5e-2)
    # the rounds of the fixed point leave one set of rows: one dot outside the loop, one inside
    rep = fmp.explain(_bf16_rnn)(X, W)
    assert len(rep.filter(op="dot_general").records) == 2
    assert len(rep.filter(op="tanh").records) == 1


# ---------------------------------------------------------------- custom_vjp bwd rules run as written


def _vjp_with_dot_bwd(as_written: bool):
    @jax.custom_vjp
    def f(x, w):
        return x @ w

    def bwd(res, g):
        x, w = res
        return g @ w.T, x.T @ g

    rule = fmp.bwd_as_written(bwd) if as_written else bwd
    f.defvjp(lambda x, w: (f(x, w), (x, w)), rule)
    return f


def _bwd_dot_dtypes(f):
    # under grad, the fwd rule's dot is rewritten; the two dots of the bwd rule follow it in the jaxpr
    cj = jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(fmp.autocast(f)(x, w)), argnums=(0, 1)))(X, W)
    return in_dtypes(cj, "dot_general")


def test_custom_vjp_bwd_rule_runs_under_the_policy_unless_marked_as_written():
    dots = _bwd_dot_dtypes(_vjp_with_dot_bwd(False))
    assert dots == [BF] * 3  # the fwd rule and the bwd rule's two dots, under the forward's policy
    dots = _bwd_dot_dtypes(_vjp_with_dot_bwd(True))
    assert dots[0] == BF  # the fwd rule
    assert dots[1:] == [("float32", "float32")] * 2  # the bwd rule, as written


def test_loop_carry_falls_back_to_original_dtypes_if_no_fixed_point(monkeypatch):

    from fmp._autocast._hops import _control

    monkeypatch.setattr(_control, "_MAX_ROUNDS", 1)  # the widening loop needs two rounds
    assert _body_carry_dtypes(rewritten(_widening, X, W), "scan") == (["float32"], ["float32"])
    cj = rewritten(_bf16_rnn, X, W)  # converges in one round
    assert _body_carry_dtypes(cj, "scan") == (["bfloat16"], ["bfloat16"])


def test_each_loop_body_and_cond_branch_is_rewritten_once(monkeypatch):
    from fmp._autocast._engine import _interp

    seen = []
    inner = _interp.transform_closed_uncached

    def counting(closed, *args, **kwargs):
        seen.append(closed)
        return inner(closed, *args, **kwargs)

    monkeypatch.setattr(_interp, "transform_closed_uncached", counting)
    monkeypatch.setattr(_interp, "_CACHE", type(_interp._CACHE)())

    def narrowing(x, w):  # a float32 carry the body returns in bfloat16 (a matmul's result)
        return jax.lax.scan(lambda h, xt: (jnp.tanh(h @ w), None), x[0], x)[0]

    def disagreeing(x, w):  # one branch returns a matmul's bfloat16 result, the other float32
        return jax.lax.cond(x[0, 0] > 0, lambda: x @ w, lambda: x * 2.0)

    for fn in (narrowing, disagreeing):
        seen.clear()
        out = jax.jit(fmp.autocast(fn))(X, W)
        assert out.dtype == jnp.float32 and len(seen) == len({id(c) for c in seen}), fn.__name__
        np.testing.assert_allclose(out, fn(X, W), rtol=3e-2, atol=3e-2)
    rep = fmp.explain(narrowing)(X, W)  # one set of rows, the carry's cast back included
    assert len(rep.filter(op="dot_general").records) == 1 and len(rep.filter(op="tanh").records) == 1
