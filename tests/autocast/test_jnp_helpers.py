"""jnp's jitted helpers kept as calls: the same decisions and numbers as inlining every one of them."""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers.common import load_bench

import fmp
from fmp._autocast import _args
from fmp._autocast._engine import _interp, _lru
from fmp._autocast._engine._frames import is_inline_call
from fmp._autocast._hops import _helpers

B = load_bench("autocast")


def _flat(jaxpr, out):
    """(primitive, input dtypes, output dtypes) of every equation, with every jit call inlined."""
    for e in jaxpr.eqns:
        if e.primitive.name in ("jit", "pjit"):
            _flat(e.params["jaxpr"].jaxpr, out)
            continue
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            _flat(sub.jaxpr if hasattr(sub, "jaxpr") else sub, out)
        dts = tuple(str(v.aval.dtype) for v in e.invars if hasattr(v.aval, "dtype"))
        out.append((e.primitive.name, dts, tuple(str(v.aval.dtype) for v in e.outvars if hasattr(v.aval, "dtype"))))
    return out


class _CNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(8, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.relu(x)
        x = nn.Dense(10)(x.reshape(x.shape[0], -1))
        return x


def _cases():
    p = B.init_params(jax.random.key(0), d=64, layers=2)
    x = jax.random.normal(jax.random.key(1), (2, 16, 64))
    init, enc_loss = B.linen_encoder(hand=False, layers=2, d=32)
    xe = jax.random.normal(jax.random.key(2), (2, 8, 32))
    cnn = _CNN()
    xc = jax.random.normal(jax.random.key(3), (4, 8, 8, 3))
    vc = cnn.init(jax.random.key(4), xc)
    yc = jnp.arange(4) % 10

    def cnn_loss(params, x):
        logits, upd = cnn.apply(
            {"params": params, **{k: v for k, v in vc.items() if k != "params"}}, x, mutable=["batch_stats"]
        )
        ce = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), yc[:, None], axis=1))
        return ce + 0.0 * jnp.sum(upd["batch_stats"]["BatchNorm_0"]["mean"])

    def mlp_literals(p, x):  # scalar literals into helpers, a bias add, a statistic, a max-subtraction
        h = x @ p["blocks"][0]["w1"] + p["blocks"][0]["b1"]
        h = jax.nn.gelu(h) * 0.5 + 1.0
        h = h - jnp.max(h, axis=-1, keepdims=True)
        return jnp.mean((h - h.mean(-1, keepdims=True)) ** 2)

    return {
        "transformer": (B.loss, p, x, None),
        "transformer, integer_pow float32": (B.loss, p, x, B.F32_POW_RULES),
        "linen encoder": (enc_loss, init(jax.random.key(5), xe), xe, None),
        "linen cnn with batchnorm": (cnn_loss, vc["params"], xc, None),
        "literals and statistics": (mlp_literals, p, x, None),
    }


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
def test_kept_helpers_decide_and_compute_as_inlined(name, monkeypatch):
    fn, p, x, rules = CASES[name]
    flat, vals = {}, {}
    for keep in (False, True):
        monkeypatch.setattr(_helpers, "KEEP_HELPERS", keep)
        monkeypatch.setattr(_interp, "_CACHE", _lru.LRU())  # no body rewritten in the other mode is reused
        # a fresh function each time: JAX caches the trace of a function it has seen
        flat[keep] = _flat(jax.make_jaxpr(jax.value_and_grad(fmp.autocast(fn, rules=rules)))(p, x).jaxpr, [])
        vals[keep] = jax.jit(jax.value_and_grad(fmp.autocast(fn, rules=rules)))(p, x)
    # every equation (casts included) has the same primitive and dtypes, in the same order
    assert flat[True] == flat[False]
    for a, b in zip(jax.tree.leaves(vals[True]), jax.tree.leaves(vals[False]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _float8_policy(**recipe):
    return dataclasses.replace(fmp.get_policy("mixed_bfloat16"), float8=fmp.Float8Recipe(**recipe))


# the float8 recipes whose helpers are kept (delayed scaling numbers its sites and inlines: checked below)
_GALLERY = pytest.mark.gallery
FLOAT8 = {
    "tensorwise": "mixed_float8",
    "rowwise": _float8_policy(scaling="rowwise"),
    "blockwise, float32 output": _float8_policy(scaling="blockwise", block_size=16, output="float32"),
    "activations too": _float8_policy(activations=True),
    "mxfp8": "mixed_mxfp8",
    "nvfp4": "mixed_nvfp4",
}


# a small transformer (its matmuls are jnp helpers: the kept bodies must tell weights from activations) under a
# tensor-scaled and a block-scaled recipe; every other pair in the gallery suite, with the flax models
# (lax.dot_general and convolutions at the top)
_SMALL = (B.loss, B.init_params(jax.random.key(0), d=32, layers=1), jax.random.normal(jax.random.key(1), (2, 8, 32)))
_DEFAULT = ("tensorwise", "mxfp8")
FLOAT8_CASES = [
    *(
        pytest.param("small transformer", r, id=f"{r}-small transformer", marks=() if r in _DEFAULT else _GALLERY)
        for r in FLOAT8
    ),
    *(
        pytest.param(m, r, id=f"{r}-{m}", marks=_GALLERY)
        for m in ("linen encoder", "linen cnn with batchnorm")
        for r in FLOAT8
    ),
]


@pytest.mark.parametrize("model, recipe", FLOAT8_CASES)
def test_kept_helpers_decide_and_compute_as_inlined_under_float8(model, recipe, monkeypatch):
    fn, p, x = _SMALL if model == "small transformer" else CASES[model][:3]
    policy = FLOAT8[recipe]
    flat, vals = {}, {}
    for keep in (False, True):
        monkeypatch.setattr(_helpers, "KEEP_HELPERS", keep)
        monkeypatch.setattr(_interp, "_CACHE", _lru.LRU())  # no body rewritten in the other mode is reused
        flat[keep] = _flat(jax.make_jaxpr(jax.value_and_grad(fmp.autocast(fn, policy)))(p, x).jaxpr, [])
        vals[keep] = jax.jit(jax.value_and_grad(fmp.autocast(fn, policy)))(p, x)
    # the matmuls did run quantised: values in a float8 or float4 format appear
    assert any(d.startswith(("float8", "float4")) for _, _, outs in flat[True] for d in outs)
    assert flat[True] == flat[False]
    for a, b in zip(jax.tree.leaves(vals[True]), jax.tree.leaves(vals[False]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_trace_keeps_helpers_as_calls_only_in_its_own_trace():
    def f(x, w):
        return jnp.tanh(x @ w) * 2.0

    x, w = jnp.ones((2, 3)), jnp.ones((3, 3))
    closed, _, _ = _args.trace(f, (x, w), {})
    names = [e.params["name"] for e in closed.jaxpr.eqns if is_inline_call(e)]
    assert names == ["matmul", "tanh", "multiply"]
    # everywhere else JAX inlines them as usual
    assert not any(is_inline_call(e) for e in jax.make_jaxpr(f)(x, w).jaxpr.eqns)


def test_kept_helper_bodies_are_rewritten_once_and_reused(monkeypatch):
    results = []
    real = _helpers.transform_closed

    def recording(closed, *a, **k):
        out = real(closed, *a, **k)
        results.append(out)
        return out

    monkeypatch.setattr(_helpers, "transform_closed", recording)
    p = B.init_params(jax.random.key(0), d=32, layers=2)
    x = jax.random.normal(jax.random.key(1), (2, 8, 32))
    jax.jit(jax.value_and_grad(fmp.autocast(B.loss))).lower(p, x)
    first = list(results)
    jax.jit(jax.value_and_grad(fmp.autocast(B.loss))).lower(p, x)
    again = results[len(first) :]
    assert len(first) > 10 and len(again) == len(first)
    # a fresh wrapper hands JAX the very same rewritten bodies (so JAX's caches hit)...
    assert all(a is b for a, b in zip(first, again, strict=True))
    # ...and the two identical layers share theirs
    assert len({id(r) for r in first}) < len(first)


def test_folded_constants_are_told_apart_by_their_exact_value():
    # 0.00012345 and 0.000123454 print alike at NumPy's default precision; each function gets its own constant
    x = jnp.full((2, 3), 1000.0)
    for c in (np.float32(0.00012345), np.float32(0.000123454), np.float64(0.1), np.float64(0.1 + 1e-12)):
        got = fmp.autocast(lambda x, c=c: x * c)(x)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(x * c))


def test_a_users_own_inline_function_is_inlined_as_jax_does():
    @functools.partial(jax.jit, inline=True)
    def layer(x, w):
        return x @ w + x

    closed, _, _ = _args.trace(lambda x, w: jnp.tanh(layer(x, w)), (jnp.ones((2, 3)), jnp.ones((3, 3))), {})
    names = [e.params["name"] for e in closed.jaxpr.eqns if is_inline_call(e)]
    assert "layer" not in names and "tanh" in names


def test_hoisted_casts_stay_out_of_nested_regions_and_overrides(monkeypatch):
    x = jax.random.normal(jax.random.key(0), (4, 8))
    w = jax.random.normal(jax.random.key(1), (8, 8))
    inner = fmp.autocast(lambda y, w: jnp.tanh(y @ w))

    def scoped(x, w):
        with jax.named_scope("attn"):
            h = jnp.tanh(x @ w)
        return jnp.sum(h @ w)

    cases = [
        (lambda x, w: inner(x, w).sum(), {}),  # an autocast region inside another
        (scoped, {"overrides": {"attn": "mixed_float16"}}),
    ]
    for fn, kw in cases:
        out = {}
        for keep in (False, True):
            monkeypatch.setattr(_helpers, "KEEP_HELPERS", keep)
            g = fmp.autocast(fn, **kw)
            out[keep] = (_flat(jax.make_jaxpr(jax.grad(g))(x, w).jaxpr, []), jax.jit(jax.grad(g))(x, w))
        assert out[True][0] == out[False][0]
        np.testing.assert_array_equal(np.asarray(out[True][1]), np.asarray(out[False][1]))


def test_rewrite_caches_are_safe_across_threads(monkeypatch):
    from fmp._autocast._engine import (
        _cast,
        _interp,
        _lru,
    )

    # tiny caches: every trace evicts what another thread is about to read
    for mod, name in ((_interp, "_CACHE"), (_cast, "_CAST_CALLS"), (_helpers, "_SPECIAL")):
        monkeypatch.setattr(mod, name, _lru.LRU(1))
    errors = []

    def work(seed):
        try:
            for i in range(40):
                n = 2 + (seed + i) % 2
                jax.make_jaxpr(fmp.autocast(lambda x, w: jnp.tanh(x @ w) * 2.0 + 1.0))(
                    jnp.ones((n, n + 1)), jnp.ones((n + 1, n))
                )
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(repr(e))

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        sys.setswitchinterval(switch)
    assert not errors, errors[:3]


def test_a_value_used_once_is_cast_inside_the_kept_call_and_one_used_twice_at_it(monkeypatch):
    from fmp._autocast._engine import _jax_internals
    from fmp._autocast._engine._jax_internals import _staging

    def f(x, w1, w2):
        return jnp.sum(jnp.tanh(x @ w1) @ w2) + jnp.sum(x @ w2)  # w1 used once; x and w2 twice

    def kept(*args):  # the program as autocast emits it, every inline call (casts too) kept as an equation
        with _jax_internals.keep_inline_calls():
            return fmp.autocast(f)(*args)

    monkeypatch.setattr(_staging, "_jax_own", lambda closed: True)
    top = jax.make_jaxpr(kept)(jnp.ones((2, 4)), jnp.ones((4, 4)), jnp.ones((4, 4))).jaxpr
    x, w1, w2 = top.invars
    # a cast is a jitted helper where it is bound under grad or vmap; a staging trace (this one) gets its equation
    cast_at_top = [
        e.invars[0]
        for e in top.eqns
        if e.primitive.name == "convert_element_type" or (e.primitive.name == "jit" and e.params["name"] == "convert")
    ]
    cast_at_top = [v for v in cast_at_top if v in (x, w1, w2)]
    # x and w2: one cast each, at the top, shared by both their uses; w1: cast inside its matmul's body
    assert cast_at_top == [x, w2] or cast_at_top == [w2, x], cast_at_top
    matmul = next(e for e in top.eqns if e.primitive.name == "jit" and w1 in e.invars)
    assert any(e.primitive.name == "convert_element_type" for e in matmul.params["jaxpr"].jaxpr.eqns)


def _noop_astype(x, w, w2):  # the user's astype is the identity in the rewritten program (h is bfloat16 there)
    h = x @ w
    return jnp.sum(jnp.exp(h)) + jnp.sum(jnp.log1p(jnp.exp(h.astype(jnp.bfloat16)) * 0.37))


def _identity_helper(x, w, w2):  # jnp.real of a real array: a helper whose body returns its input
    h = x @ w
    return jnp.sum(jnp.exp(h)) + jnp.sum(jnp.log1p(jnp.exp(jnp.real(h)) * 0.37))


def _override_elsewhere(x, w, w2):  # an override on one scope; the shared cast of h is in the default scope
    h = x @ w
    a, b = jnp.exp(h), jnp.log1p(jnp.square(h) * 0.37)
    with jax.named_scope("head"):
        o = (a + b) @ w2
    return jnp.sum(o)


def _shared_with_an_override(x, w, w2):  # x is cast in an override scope and used again by a default-scope helper
    with jax.named_scope("attn"):
        h = x @ x.T
    return jnp.sum(jnp.sin(jnp.matmul(h, x)))


@pytest.mark.parametrize(
    "fn, kw",
    [
        (_noop_astype, {}),
        (_identity_helper, {}),
        (_override_elsewhere, {"overrides": {"head": "float32"}}),
        (_shared_with_an_override, {"overrides": {"attn": "mixed_bfloat16"}}),
        (_shared_with_an_override, {"policy": "mixed_float8", "overrides": {"attn": "mixed_bfloat16"}}),
    ],
    ids=["noop-astype", "identity-helper", "override-elsewhere", "shared-with-override", "float8-shared-with-override"],
)
def test_one_value_under_two_names_shares_its_cast_as_inlined(fn, kw, monkeypatch):
    k = jax.random.split(jax.random.key(0), 3)
    x, w, w2 = (
        jax.random.normal(k[0], (8, 16)),
        0.3 * jax.random.normal(k[1], (16, 16)),
        jax.random.normal(k[2], (16, 16)),
    )
    out = {}
    for keep in (False, True):
        monkeypatch.setattr(_helpers, "KEEP_HELPERS", keep)
        monkeypatch.setattr(_interp, "_CACHE", _lru.LRU())  # no body rewritten in the other mode is reused
        g = jax.numpy_dtype_promotion("standard")(fmp.autocast(fn, **kw))
        out[keep] = (
            _flat(jax.make_jaxpr(jax.grad(g, argnums=(0, 1)))(x, w, w2).jaxpr, []),
            jax.jit(jax.grad(g, argnums=(0, 1)))(x, w, w2),
        )
    assert out[True][0] == out[False][0]
    for a, b in zip(jax.tree.leaves(out[True][1]), jax.tree.leaves(out[False][1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_body_the_rules_keep_is_bound_as_written(monkeypatch):
    """A helper body whose every equation the rules keep at its input types is bound as JAX staged it, not
    traced again (a first trace in a process pays only for the bodies that change); the others are rewritten."""
    seen = []
    real = _helpers.transform_closed

    def recording(closed, *a, **k):
        out = real(closed, *a, **k)
        seen.append(([e.primitive.name for e in closed.jaxpr.eqns], out is closed))
        return out

    monkeypatch.setattr(_helpers, "transform_closed", recording)

    def f(x, y, w):
        h = jnp.exp(x - y) * y  # float32 inputs: subtract, exp and multiply run as written
        return jnp.tanh(h @ w), jnp.sum(h)

    def hand(x, y, w):
        h = jnp.exp(x - y) * y
        return jnp.tanh(h.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32), jnp.sum(h)

    x, y, w = (jax.random.normal(jax.random.key(i), (4, 4)) for i in range(3))
    got = jax.jit(fmp.autocast(f))(x, y, w)
    kept = {tuple(names): same for names, same in seen}
    assert kept[("sub",)] and kept[("exp",)] and kept[("mul",)] and kept[("reduce_sum",)]
    assert not kept[("dot_general",)]
    for a, b in zip(got, hand(x, y, w), strict=True):  # eager: XLA's fusion may keep tanh unrounded under jit
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
