"""jnp's jitted helpers kept as calls: the same decisions and numbers as inlining every one of them."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import load_bench

import fmp
from fmp._autocast import _args, _helpers
from fmp._autocast._provenance import is_inline_call

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
        logits, upd = cnn.apply({"params": params, **{k: v for k, v in vc.items() if k != "params"}}, x, mutable=["batch_stats"])
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
        # a fresh function each time: JAX caches the trace of a function it has seen
        flat[keep] = _flat(jax.make_jaxpr(jax.value_and_grad(fmp.autocast(fn, rules=rules)))(p, x).jaxpr, [])
        vals[keep] = jax.jit(jax.value_and_grad(fmp.autocast(fn, rules=rules)))(p, x)
    # every equation (casts included) has the same primitive and dtypes, in the same order
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
