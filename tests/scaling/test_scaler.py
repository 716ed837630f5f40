"""fmp.GradScaler, all_finite, select_tree, nonfinite_leaves: semantics, jit behaviour, torch bit-exactness."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fmp

F32_TINY = float(np.finfo(np.float32).tiny)


# --- construction and validation ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "exc", "name"),
    [
        ({"init_scale": 0.0}, ValueError, "init_scale"),
        ({"init_scale": float("inf")}, ValueError, "init_scale"),
        ({"init_scale": "1"}, TypeError, "init_scale"),
        ({"growth_factor": 1.0}, ValueError, "growth_factor"),
        ({"backoff_factor": 1.0}, ValueError, "backoff_factor"),
        ({"backoff_factor": 0.0}, ValueError, "backoff_factor"),
        ({"growth_interval": 0}, ValueError, "growth_interval"),
        ({"growth_interval": 2.0}, TypeError, "growth_interval"),
        ({"min_scale": -1.0}, ValueError, "min_scale"),
        ({"min_scale": 4.0, "max_scale": 2.0}, ValueError, "min_scale"),
        ({"enabled": 1}, TypeError, "enabled"),
        ({"dynamic": "yes"}, TypeError, "dynamic"),
    ],
)
def test_invalid_hparams_name_the_argument(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        fmp.GradScaler(**kwargs)


def test_defaults_match_torch():
    s = fmp.GradScaler()
    assert (s.init_scale, s.growth_factor, s.backoff_factor, s.growth_interval) == (2.0**16, 2.0, 0.5, 2000)
    assert s.loss_scale.dtype == jnp.float32 and s.loss_scale.shape == ()
    assert s.growth_tracker.dtype == jnp.int32 and s.growth_tracker.shape == ()
    assert float(s.loss_scale) == 65536.0 and int(s.growth_tracker) == 0


def test_pytree_leaves_and_static_fields_survive_jit():
    s = fmp.GradScaler(3.0, 1.5, 0.25, 7, min_scale=0.5, max_scale=1e6, dynamic=True)
    leaves, treedef = jax.tree.flatten(s)
    assert len(leaves) == 3  # loss_scale, growth_tracker, consecutive_overflows
    out = jax.jit(lambda x: x)(s)
    for field in ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled", "min_scale"):
        assert getattr(out, field) == getattr(s, field), field
    assert (out.max_scale, out.dynamic) == (1e6, True)
    assert jax.tree.structure(out) == treedef


# --- scale / unscale ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("dtype", "out_dtype"),
    [(jnp.float16, jnp.float32), (jnp.bfloat16, jnp.float32), (jnp.float32, jnp.float32), (jnp.int32, jnp.float32)],
)
def test_scale_is_float32(dtype, out_dtype):
    s = fmp.GradScaler(init_scale=2.0**16)
    out = jax.jit(fmp.GradScaler.scale)(s, jnp.asarray(60000, dtype) if dtype != jnp.bfloat16 else jnp.ones((), dtype))
    assert out.dtype == out_dtype
    assert bool(jnp.isfinite(out))  # a float16 60000 scaled by 2**16 does not overflow


def test_scale_tree_and_disabled_passthrough():
    tree = {"a": jnp.ones(2, jnp.bfloat16), "b": [jnp.float32(2.0)]}
    out = fmp.GradScaler(init_scale=4.0).scale(tree)
    assert out["a"].dtype == jnp.float32 and float(out["b"][0]) == 8.0
    disabled = fmp.GradScaler(enabled=False)
    assert disabled.scale(tree) is tree
    assert disabled.unscale(tree) is tree
    assert disabled.update(jnp.array(False)) is disabled
    with pytest.raises(TypeError, match="float or integer"):
        fmp.GradScaler().scale(jnp.array(True))


@pytest.mark.parametrize("scale", [3.0, 65536.0, 1.1**7, 0.3**5, 7.0e-30, 1.0e37])
def test_unscale_uses_torchs_reciprocal(scale):
    torch = pytest.importorskip("torch")
    s = fmp.GradScaler(init_scale=float(np.float32(scale)))
    inv_torch = torch.tensor(float(np.float32(scale)), dtype=torch.float32).double().reciprocal().float()
    g = jnp.array([1.0, -3.0, 12345.678], jnp.float32)
    out = jax.jit(fmp.GradScaler.unscale)(s, g)
    expected = torch.tensor(np.asarray(g)) * inv_torch
    np.testing.assert_array_equal(np.asarray(out), expected.numpy())


def test_denormal_reciprocal_is_flushed_on_cpu():
    # The documented difference: XLA CPU flushes float32 denormals; 1/3e38 is one, torch keeps it.
    out = fmp.GradScaler(init_scale=3.0e38).unscale(jnp.ones(1))
    assert float(out[0]) in (0.0, float(np.float32(1 / np.float32(3.0e38))))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_unscale_keeps_grad_dtype(dtype):
    s = fmp.GradScaler(init_scale=1024.0)
    out = s.unscale({"g": jnp.full((3,), 512, dtype), "i": jnp.arange(3)})
    assert out["g"].dtype == dtype and out["i"].dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out["g"], np.float32), 0.5)


# --- update ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("finite", "scale", "tracker"), [(True, 8.0, 1), (False, 4.0, 0)])
def test_update_under_jit(finite, scale, tracker):
    s = fmp.GradScaler(init_scale=8.0, growth_interval=2)
    new = jax.jit(fmp.GradScaler.update)(s, jnp.array(finite))
    assert float(new.loss_scale) == scale and int(new.growth_tracker) == tracker
    jax.lax.cond(True, lambda: s, lambda: new)  # structure, dtypes and static fields did not drift
    assert new.loss_scale.dtype == jnp.float32 and new.growth_tracker.dtype == jnp.int32


def test_update_does_not_recompile():
    step = jax.jit(lambda s, finite: s.update(finite))  # a fresh function: jit caches are shared per function
    s = fmp.GradScaler(init_scale=8.0, growth_interval=2)
    for finite in (True, True, False, True):
        s = step(s, jnp.array(finite))
    assert step._cache_size() == 1
    assert float(s.loss_scale) == 8.0  # 8 -> grow at 2nd -> 16 -> back off -> 8


def test_growth_never_reaches_inf_and_tracker_resets():
    s = fmp.GradScaler(init_scale=3.0e38, growth_interval=1)
    new = s.update(jnp.array(True))
    assert float(new.loss_scale) == float(np.float32(3.0e38)) and int(new.growth_tracker) == 0


def test_new_scale_sets_the_scale_and_keeps_the_tracker():
    s = fmp.GradScaler(init_scale=8.0).update(jnp.array(True))
    new = jax.jit(lambda s: s.update(new_scale=3.3))(s)
    assert float(new.loss_scale) == float(np.float32(3.3)) and int(new.growth_tracker) == 1
    with pytest.raises(TypeError, match="finite"):
        s.update()
    with pytest.raises(TypeError, match="finite"):
        s.update(jnp.array([True, False]))
    with pytest.raises(TypeError, match="finite"):
        s.update(jnp.float32(1.0))


def test_min_max_clamps():
    s = fmp.GradScaler(init_scale=4.0, growth_interval=1, min_scale=2.0, max_scale=8.0)
    for _ in range(3):
        s = s.update(jnp.array(False))
    assert float(s.loss_scale) == 2.0
    for _ in range(5):
        s = s.update(jnp.array(True))
    assert float(s.loss_scale) == 8.0


def test_static_scaler_keeps_scale_but_reports():
    s = fmp.GradScaler.static(128.0)
    assert not s.dynamic
    for finite in (False, True, False):
        s = jax.jit(fmp.GradScaler.update)(s, jnp.array(finite))
    assert float(s.loss_scale) == 128.0
    _, _, finite, _ = fmp.value_and_grad(lambda w: jnp.sum(w * jnp.inf), s)(jnp.ones(2))
    assert not bool(finite)


# --- bit-for-bit against torch --------------------------------------------------------------------------------------
HPARAMS = [
    # init, growth, backoff, interval
    (2.0**16, 2.0, 0.5, 3),
    (3.3, 1.1, 0.3, 2),
    (1000.0, 1.7, 0.9, 1),
    (0.1, 3.0, 0.77, 5),
    (3.0e38, 2.0, 0.5, 2),
]


def _fmp_trajectory(hp, found):
    init, gf, bf, gi = hp
    s = fmp.GradScaler(init_scale=init, growth_factor=gf, backoff_factor=bf, growth_interval=gi)

    def body(s, f):
        s = s.update(jnp.logical_not(f))
        return s, (s.loss_scale, s.growth_tracker)

    _, (scales, trackers) = jax.jit(lambda s, fs: jax.lax.scan(body, s, fs))(s, jnp.asarray(found))
    return np.asarray(scales), np.asarray(trackers)


@pytest.mark.parametrize("hp", HPARAMS)
def test_update_rule_bit_exact_with_torch_kernel(hp):
    torch = pytest.importorskip("torch")
    init, gf, bf, gi = hp
    rng = np.random.default_rng(HPARAMS.index(hp))
    # Drive torch's own kernel with random overflow flags, steered so the scale stays in float32's
    # normal range (XLA CPU flushes denormals, the one documented difference); then replay the flags.
    scale = torch.full((), init, dtype=torch.float32)
    tracker = torch.zeros((), dtype=torch.int32)
    found, torch_scales, torch_trackers = [], [], []
    for _ in range(1000):
        f = bool(rng.random() < 0.3)
        if scale.item() < 1e-30:
            f = False
        elif scale.item() > 1e30 and init < 1e30:
            f = True
        torch._amp_update_scale_(scale, tracker, torch.full((), float(f)), gf, bf, gi)
        found.append(f)
        torch_scales.append(scale.numpy().copy())
        torch_trackers.append(tracker.item())
    assert 50 < sum(found) < 950  # both kinds of step occur many times
    scales, trackers = _fmp_trajectory(hp, np.array(found))
    np.testing.assert_array_equal(scales.view(np.uint32), np.array(torch_scales, np.float32).view(np.uint32))
    np.testing.assert_array_equal(trackers, torch_trackers)
    assert len(set(scales.tolist())) > 10  # the trajectory actually moved


def test_update_rule_bit_exact_with_torch_gradscaler_api():
    torch = pytest.importorskip("torch")
    init, gf, bf, gi = 3.3, 1.1, 0.3, 2
    found = np.random.default_rng(0).random(200) < 0.3
    scales, trackers = _fmp_trajectory((init, gf, bf, gi), found)
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.0)
    ts = torch.amp.GradScaler("cpu", init_scale=init, growth_factor=gf, backoff_factor=bf, growth_interval=gi)
    for i, f in enumerate(found):
        opt.zero_grad()
        ts.scale(p.sum()).backward()
        if f:
            p.grad[1] = float("inf") if i % 2 else float("nan")
        ts.step(opt)
        ts.update()
        assert np.float32(ts.get_scale()).view(np.uint32) == scales[i].view(np.uint32), i
        assert ts.state_dict()["_growth_tracker"] == trackers[i], i


# --- all_finite / select_tree / nonfinite_leaves --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("bad", [None, float("inf"), float("-inf"), float("nan")])
def test_all_finite(dtype, bad):
    g = jnp.ones((4, 3), dtype)
    if bad is not None:
        g = g.at[2, 1].set(bad)
    tree = {"g": g, "ints": jnp.arange(3), "empty": jnp.zeros((0,), dtype)}
    assert bool(jax.jit(fmp.all_finite)(tree)) is (bad is None)


def test_all_finite_edge_cases():
    assert bool(fmp.all_finite({})) and bool(fmp.all_finite([jnp.arange(4)]))
    # finite values whose sum overflows are still finite (elementwise check, not sum-based like apex)
    assert bool(fmp.all_finite(jnp.full((4,), 60000.0, jnp.float16)))


def test_select_tree():
    a, b = {"w": jnp.array([1.0, -0.0])}, {"w": jnp.array([2.0, 3.0])}
    out = jax.jit(fmp.select_tree)(jnp.array(True), a, b)
    np.testing.assert_array_equal(np.asarray(out["w"]).view(np.uint32), np.asarray(a["w"]).view(np.uint32))
    assert float(fmp.select_tree(jnp.array(False), a, b)["w"][0]) == 2.0
    with pytest.raises(ValueError, match="structure"):
        fmp.select_tree(jnp.array(True), a, [b])
    with pytest.raises(TypeError, match="dtype"):
        fmp.select_tree(jnp.array(True), a, {"w": jnp.ones(2, jnp.bfloat16)})
    with pytest.raises(TypeError, match="pred"):
        fmp.select_tree(jnp.ones(2, bool), a, b)


def test_nonfinite_leaves():
    g = {"dense": {"w": jnp.ones(3), "b": jnp.array([jnp.nan])}, "emb": [jnp.ones(2), jnp.array([0.0, -jnp.inf])]}
    assert fmp.nonfinite_leaves(g) == ["['dense']['b']", "['emb'][1]"]
    assert fmp.nonfinite_leaves({"w": jnp.ones(2)}) == []


@pytest.mark.parametrize("grad_dtype", [jnp.float32, jnp.bfloat16])
def test_post_gradient_step_needs_no_tree_sized_temporary(grad_dtype):
    # check + unscale + conditional SGD + scale update compile to passes over the inputs, with no
    # temporary the size of the tree (a bf16 check once materialised a float32 copy of the grads)
    params = {"w": jnp.ones((512, 512)), "b": jnp.ones((512,))}
    grads = jax.tree.map(lambda p: p.astype(grad_dtype), params)

    def step(params, scaler, grads):
        finite = fmp.all_finite(grads)
        g = scaler.unscale(grads)
        new = jax.tree.map(lambda p, g: p - 0.1 * g.astype(p.dtype), params, g)
        return fmp.select_tree(finite, new, params), scaler.update(finite)

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, fmp.GradScaler(), grads).compile()
    tree_bytes = sum(x.nbytes for x in jax.tree.leaves(grads))
    assert compiled.memory_analysis().temp_size_in_bytes < tree_bytes // 10


@pytest.mark.parametrize("bad_leaf", [None, 0, 17, 29])
def test_all_finite_many_small_leaves_of_mixed_dtypes(bad_leaf):
    # small leaves are checked together, one kernel per dtype; big ones one by one
    dtypes = [jnp.float32, jnp.bfloat16, jnp.float16]
    tree = [jnp.ones((7, 3), dtypes[i % 3]) for i in range(30)] + [jnp.ones((200, 100))]
    if bad_leaf is not None:
        tree[bad_leaf] = tree[bad_leaf].at[2, 1].set(jnp.nan)
    assert bool(jax.jit(fmp.all_finite)(tree)) is (bad_leaf is None)
    tree[-1] = tree[-1].at[5, 5].set(jnp.inf)
    assert not bool(fmp.all_finite(tree))
