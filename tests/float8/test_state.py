"""Delayed float8 scaling wherever a matmul lives (scan, checkpoint, inner jit, cond), and misuse of the state
refused: each state's rows are compared with the amaxes of the operands they must hold."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fmp

F32 = jnp.float32
RECIPE = fmp.Float8Recipe("delayed", history_len=4, pow2_scales=False)  # exact scales: history changes results
POL = fmp.Policy("f32", "bf16", "f32", float8=RECIPE)
L, D = 3, 16


def _layers():
    ws = jax.random.normal(jax.random.key(0), (L, D, D), F32) / np.sqrt(D)
    return ws, jax.random.normal(jax.random.key(1), (8, D), F32)


def scanned(ws, x):
    def layer(h, w):
        with jax.named_scope("layer"):
            return jnp.tanh(h @ w), None

    return jax.lax.scan(layer, x, ws)[0]


def unrolled(ws, x):
    h = x
    for i in range(L):
        with jax.named_scope("layer"):
            h = jnp.tanh(h @ ws[i])
    return h


def _train(f, ws, x, st, steps=5):
    def loss(ws, st):
        return jnp.mean(fmp.autocast(f, POL, float8_state=st)(ws, x) ** 2)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    for _ in range(steps):
        _, (g, gs) = step(ws, st)
        ws, st = ws - 0.5 * g, st.update(gs)
    return ws, st


def test_scanned_layers_train_bit_for_bit_like_unrolled_layers():
    ws, x = _layers()
    st_scan, st_loop = fmp.float8_state(scanned, POL)(ws, x), fmp.float8_state(unrolled, POL)(ws, x)
    assert st_scan.amax_history.shape == (L, 3, 4)  # one history per layer
    assert st_scan.sites == tuple(f"dot_general@layer[{i}]" for i in range(L))
    ws_scan, st_scan = _train(scanned, ws, x, st_scan)
    ws_loop, st_loop = _train(unrolled, ws, x, st_loop)
    np.testing.assert_array_equal(np.asarray(ws_scan), np.asarray(ws_loop))
    for i in range(L):  # layer i's rows, in each layout
        np.testing.assert_array_equal(np.asarray(st_scan.amax_history[i]), np.asarray(st_loop.amax_history[i]))
    assert float(jnp.min(st_scan.amax_history)) > 0  # every layer, operand and step recorded
    # and the history is used: current scaling trains to other weights
    ws_now = ws
    grad = jax.jit(jax.grad(lambda w: jnp.mean(fmp.autocast(scanned, "p=f32,c=bf16,o=f32,float8=tensorwise")(w, x) ** 2)))
    for _ in range(5):
        ws_now = ws_now - 0.5 * grad(ws_now)
    assert not np.array_equal(np.asarray(ws_now), np.asarray(ws_scan))


def test_linen_nn_scan_layers_get_one_history_each():
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return jnp.tanh(nn.Dense(D, use_bias=False)(h)), None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            scan = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=L)
            return scan(name="blocks")(x, None)[0]

    ws, x = _layers()
    net = Net()
    params = net.init(jax.random.key(2), x)
    st = fmp.float8_state(net.apply, POL)(params, x)
    assert st.amax_history.shape[0] == L and all(s.endswith(f"[{i}]") for i, s in enumerate(st.sites))
    gs = jax.grad(lambda st: jnp.sum(fmp.autocast(net.apply, POL, float8_state=st)(params, x)))(st)
    kernels = params["params"]["blocks"]["Dense_0"]["kernel"]
    for i in range(L):
        assert float(gs.amax_history[i, 1, 0]) == float(jnp.max(jnp.abs(kernels[i])))
    assert float(gs.amax_history[0, 0, 0]) == float(jnp.max(jnp.abs(x)))


def _net(p, x, pred):
    a = jax.checkpoint(lambda x, w: x @ w)(x, p[0])
    b = jax.jit(lambda x, w: x @ w)(x, p[1])
    c = jax.lax.cond(pred, lambda x: x @ p[2], lambda x: x @ p[3], x)
    d = jnp.einsum("ij,jk->ik", x, p[4])
    return a + b + c + d


def test_checkpoint_jit_cond_and_einsum_sites_record_their_operands_amax():
    ws, x = _layers()
    p = [ws[0], ws[1], ws[2], 2.0 * ws[2], 3.0 * ws[0]]
    pred = jnp.array(True)
    st = fmp.float8_state(_net, POL)(p, x, pred)
    assert len(st.sites) == 5 and st.sites[2].endswith("[branch 0]") and st.sites[3].endswith("[branch 1]")
    rep = fmp.explain(_net, POL, float8_state=st)(p, x, pred)
    assert [r.detail for r in rep.records if r.category == "float8"] == ["delayed"] * 5
    gs = jax.jit(jax.grad(lambda st: jnp.sum(fmp.autocast(_net, POL, float8_state=st)(p, x, pred))))(st)
    h = np.asarray(gs.amax_history[..., 0])
    w_of_row = [p[0], p[1], p[3], p[2], p[4]]  # cond branch 0 is the false branch
    for row, w in enumerate(w_of_row):
        if row == 2:  # the branch not taken: no amax (update keeps its history)
            assert not h[row].any()
            continue
        assert h[row, 0] == float(jnp.max(jnp.abs(x))) and h[row, 1] == float(jnp.max(jnp.abs(w)))
        assert h[row, 2] == 1.0  # the output gradient of a sum
    assert not st.update(gs).amax_history[2].any()


def test_while_loop_float8_sites_warn_that_they_run_current_scaling():
    ws, x = _layers()

    def f(w, x):
        return jax.lax.while_loop(lambda c: c[1] < 2, lambda c: (jnp.tanh(c[0] @ w), c[1] + 1), (x, 0))[0]

    st = fmp.Float8State.zeros([], RECIPE)
    with pytest.warns(UserWarning, match="while_loop body .* current"):
        fmp.autocast(f, POL, float8_state=st)(ws[0], x)


def _mm(x, w):
    with jax.named_scope("dense"):
        return x @ w


def _mm_other(x, w):
    with jax.named_scope("proj"):
        return x @ w


def test_delayed_policy_without_state_warns_and_explain_does_not_say_delayed():
    ws, x = _layers()
    with pytest.warns(UserWarning, match="no float8_state was given"):
        fmp.autocast(_mm, POL)
    rep = fmp.explain(_mm, POL)(x, ws[0])
    assert [r.detail for r in rep.records if r.category == "float8"] == ["tensorwise (no state)"]


def test_state_misuse_is_refused_naming_the_fix():
    ws, x = _layers()
    st = fmp.float8_state(_mm, POL)(x, ws[0])
    with pytest.raises(ValueError, match="needs a policy with float8=delayed"):
        fmp.autocast(_mm, "p=f32,c=bf16,o=f32,float8=tensorwise", float8_state=st)
    with pytest.raises(ValueError, match="another function.*'dot_general@proj'"):
        fmp.autocast(_mm_other, POL, float8_state=st)(x, ws[0])
    with pytest.raises(ValueError, match="runs more float8 matmuls"):
        fmp.autocast(lambda x, w: _mm(_mm(x, w), w), POL, float8_state=st)(x, ws[0])
    two = fmp.float8_state(lambda x, w: _mm(_mm(x, w), w), POL)(x, ws[0])
    with pytest.raises(ValueError, match="has 2 float8 sites but the function runs 1"):
        fmp.autocast(_mm, POL, float8_state=two)(x, ws[0])
    longer = fmp.Float8State.zeros(st.sites, fmp.Float8Recipe("delayed", history_len=8, pow2_scales=False))
    with pytest.raises(ValueError, match="8 steps of amax history .* history_len=4"):
        fmp.autocast(_mm, POL, float8_state=longer)

    def twice(st):
        f = fmp.autocast(_mm, POL, float8_state=st)
        return jnp.sum(f(x, ws[0])) + jnp.sum(f(x, ws[1]))

    with pytest.raises(ValueError, match="already used by another autocast call"):
        jax.grad(twice)(st)


def test_grad_scaler_leaves_the_state_gradient_unscaled():
    ws, x = _layers()
    st = fmp.float8_state(_mm, POL)(x, ws[0])

    def loss(w, st):
        return jnp.mean(fmp.autocast(_mm, POL, float8_state=st)(x, w) ** 2)

    plain = jax.grad(loss, argnums=1)(ws[0], st).amax_history
    _, (_, scaled), finite, _ = fmp.value_and_grad(loss, fmp.GradScaler(init_scale=2.0**16), argnums=(0, 1))(ws[0], st)
    assert bool(finite)
    h = scaled.amax_history
    assert float(h[0, 0, 0]) == float(jnp.max(jnp.abs(x))) and float(h[0, 1, 0]) == float(jnp.max(jnp.abs(ws[0])))
    # the gradient-side amax is that of the scaled gradient the next step quantises
    assert float(h[0, 2, 0]) == float(plain[0, 2, 0]) * 2.0**16


def test_shard_map_records_the_global_amax_with_and_without_vma_checks():
    from _helpers.common import run_with_devices

    out = run_with_devices(
        """
        from functools import partial
        import jax, jax.numpy as jnp, numpy as np, fmp
        from jax.sharding import Mesh, PartitionSpec as P
        mesh = Mesh(np.array(jax.devices()), ("d",))
        pol = "p=f32,c=bf16,o=f32,float8=delayed"
        x = jax.random.normal(jax.random.key(0), (16, 8)) * jnp.arange(1, 17, dtype=jnp.float32)[:, None]
        w = jax.random.normal(jax.random.key(1), (8, 4))
        f = lambda x, w: x @ w
        st = fmp.float8_state(f, pol)(x, w)
        sq = lambda y: jnp.mean(y.astype(jnp.float32) ** 2)
        want = jax.jit(jax.grad(lambda st: sq(fmp.autocast(f, pol, float8_state=st)(x, w))))(st).amax_history
        assert float(want[0, 0, 0]) == float(jnp.max(jnp.abs(x)))
        for vma in (True, False):
            @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("d")), out_specs=P(), check_vma=vma)
            def inside(st, x):  # a replicated state inside shard_map
                return jax.lax.pmean(sq(fmp.autocast(f, pol, float8_state=st)(x, w)), "d")
            sm = lambda x, w: jax.shard_map(f, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d"), check_vma=vma)(x, w)
            outside = lambda st: sq(fmp.autocast(sm, pol, float8_state=st)(x, w))  # shard_map inside autocast
            for got in (jax.jit(jax.grad(inside))(st, x), jax.jit(jax.grad(outside))(st)):
                np.testing.assert_array_equal(np.asarray(got.amax_history), np.asarray(want))
        print("global amax ok")
        """,
        timeout=240,
    )
    assert "global amax ok" in out
