"""Scale health: the scale stays finite through any run of inf/NaN, clamps, new_scale, overflow alarms and warnings."""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fmp
import fmp.optax


def property_test(n: int, **strategies):
    """A default-suite property test with ``n`` examples, and a ``slow`` copy with ``20 * n`` and longer runs."""

    def deco(fn):
        fast = settings(max_examples=n, deadline=None)(given(**strategies)(fn))
        long = {k: (LONG_EVENTS if v is EVENTS else v) for k, v in strategies.items()}
        slow = pytest.mark.slow(settings(max_examples=20 * n, deadline=None)(given(**long)(fn)))
        return fast, slow

    return deco


# 0: a clean step; 1: inf in one gradient leaf; 2: NaN in one gradient leaf; 3: NaN loss; 4: inf loss
EVENTS = st.lists(st.integers(0, 4), min_size=1, max_size=40)
LONG_EVENTS = st.lists(st.integers(0, 4), min_size=1, max_size=200)
_INJECT = jnp.array([1.0, jnp.inf, jnp.nan, 1.0, 1.0], jnp.float32)
_LOSS_INJECT = jnp.array([0.0, 0.0, 0.0, jnp.nan, jnp.inf], jnp.float32)


def _loss(params, event):
    w = params["w"] * _INJECT[event]  # inf/NaN reaches the gradient of w only
    loss = jnp.sum(w**2) + jnp.sum(params["b"] ** 2)
    return loss + _LOSS_INJECT[event]


def _params():
    return {"w": jnp.array([0.5, -1.0], jnp.float32), "b": jnp.array([0.25], jnp.float32)}


@jax.jit
def _vg_step(params, scaler, event):
    loss, grads, finite, scaler = fmp.value_and_grad(_loss, scaler)(params, event)
    new = jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)
    return fmp.select_tree(finite, new, params), scaler, finite


def _assert_scale_ok(scale):
    s = float(scale)
    assert math.isfinite(s) and s > 0, s


def _value_and_grad_scale_stays_finite(events):
    params, scaler = _params(), fmp.GradScaler(init_scale=2.0**16, growth_interval=3)
    for e in events:
        before = params
        params, scaler, finite = _vg_step(params, scaler, jnp.int32(e))
        _assert_scale_ok(scaler.loss_scale)
        assert bool(finite) == (e in (0, 3, 4))  # a NaN/inf added to the loss leaves the gradients finite
        if not bool(finite):
            assert all(
                np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(before), strict=True)
            )
        assert bool(fmp.all_finite(params))


test_value_and_grad_scale_stays_finite, test_value_and_grad_scale_stays_finite_slow = property_test(25, events=EVENTS)(
    _value_and_grad_scale_stays_finite
)


_OPT = fmp.optax.loss_scaled(optax.sgd(1e-2, momentum=0.9), fmp.GradScaler(init_scale=2.0**16, growth_interval=3))


@jax.jit
def _opt_step(params, state, event):
    scaler = fmp.optax.current_scaler(state)
    grads = jax.grad(lambda p: scaler.scale(_loss(p, event)))(params)
    updates, state = _OPT.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def _loss_scaled_scale_stays_finite(events):
    params = _params()
    state = _OPT.init(params)
    run = 0
    for e in events:
        params, state = _opt_step(params, state, jnp.int32(e))
        sc = fmp.optax.current_scaler(state)
        _assert_scale_ok(sc.loss_scale)
        assert bool(fmp.all_finite(params))
        assert int(sc.consecutive_overflows) == int(state.consecutive_skipped)
        run = run + 1 if int(state.consecutive_skipped) else 0
        assert int(sc.consecutive_overflows) == run


test_loss_scaled_scale_stays_finite, test_loss_scaled_scale_stays_finite_slow = property_test(25, events=EVENTS)(
    _loss_scaled_scale_stays_finite
)


def _torch_facade_scale_stays_finite_and_equals_torch(events):
    torch = pytest.importorskip("torch")
    import fmp.torch

    results = {}
    for name, cls in (("torch", torch.amp.GradScaler), ("fmp", fmp.torch.GradScaler)):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.tensor([0.5, -1.0]))
        opt = torch.optim.SGD([w], lr=0.01)
        scaler = cls("cpu", init_scale=2.0**16, growth_interval=3)
        scales = []
        for e in events:
            opt.zero_grad()
            inject = torch.tensor([1.0, math.inf, math.nan, 1.0, 1.0][e])
            loss = ((w * inject) ** 2).sum() + [0.0, 0.0, 0.0, math.nan, math.inf][e]
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        results[name] = (scales, w.detach().tolist())
    assert results["fmp"] == results["torch"]
    assert all(math.isfinite(s) and s > 0 for s in results["fmp"][0])


test_torch_facade_scale_stays_finite_and_equals_torch, test_torch_facade_scale_stays_finite_and_equals_torch_slow = (
    property_test(10, events=EVENTS)(_torch_facade_scale_stays_finite_and_equals_torch)
)


# --- clamps ---------------------------------------------------------------------------------------------------------
def test_min_scale_is_a_floor_on_backoff():
    s = fmp.GradScaler(init_scale=64.0, min_scale=3.0)
    step = jax.jit(fmp.GradScaler.update)
    scales = []
    for _ in range(6):
        s = step(s, jnp.array(False))
        scales.append(float(s.loss_scale))
    assert scales == [32.0, 16.0, 8.0, 4.0, 3.0, 3.0]  # max(scale * backoff, min_scale)
    s = step(s, jnp.array(True))
    assert float(s.loss_scale) == 3.0 and int(s.growth_tracker) == 1


def test_max_scale_is_a_ceiling_on_growth_and_the_tracker_still_resets():
    s = fmp.GradScaler(init_scale=4.0, growth_interval=1, max_scale=10.0)
    step = jax.jit(fmp.GradScaler.update)
    scales = []
    for _ in range(3):
        s = step(s, jnp.array(True))
        scales.append((float(s.loss_scale), int(s.growth_tracker)))
    assert scales == [(8.0, 0), (10.0, 0), (10.0, 0)]  # min(scale * growth, max_scale)


def test_clamps_apply_at_the_first_update_not_at_init():
    s = fmp.GradScaler(init_scale=1000.0, max_scale=10.0)
    assert float(s.loss_scale) == 1000.0
    assert float(s.update(jnp.array(True)).loss_scale) == 10.0
    with pytest.raises(ValueError, match=r"min_scale \(4.0\) must be <= max_scale \(2.0\)"):
        fmp.GradScaler(min_scale=4.0, max_scale=2.0)
    with pytest.raises(ValueError, match="min_scale must be a finite number > 0 or None, got 0.0"):
        fmp.GradScaler(min_scale=0.0)


def test_without_min_scale_a_long_overflow_run_underflows_to_zero_and_every_step_is_then_skipped():
    s = fmp.GradScaler(init_scale=2.0**16)
    s = jax.jit(lambda s: jax.lax.fori_loop(0, 200, lambda i, s: s.update(jnp.array(False)), s))(s)
    assert float(s.loss_scale) == 0.0 and bool(s.overflow_alarm) and int(s.consecutive_overflows) == 200
    params = _params()
    new_params, s2, finite = _vg_step(params, s, jnp.int32(0))
    # scaled grads are finite zeros but unscaling them would be 0 * inf = NaN: the step is skipped
    assert not bool(finite) and bool(fmp.all_finite(new_params))
    assert float(s2.loss_scale) == 0.0
    with pytest.warns(fmp.ScaleHealthWarning, match="the loss scale is 0.0"):
        assert not fmp.check_scaler_health(s2)
    # with a floor, the same run keeps a usable scale
    s = fmp.GradScaler(init_scale=2.0**16, min_scale=1.0)
    s = jax.jit(lambda s: jax.lax.fori_loop(0, 200, lambda i, s: s.update(jnp.array(False)), s))(s)
    assert float(s.loss_scale) == 1.0


# --- new_scale ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 0.0, -1.0, 0, -3])
def test_jax_update_rejects_a_bad_python_new_scale(bad):
    s = fmp.GradScaler()
    with pytest.raises(ValueError, match="new_scale must be a finite number > 0, got"):
        s.update(new_scale=bad)


def test_jax_update_new_scale_accepts_ints_and_floats_and_rejects_bools_and_arrays_of_other_kinds():
    s = fmp.GradScaler()
    assert float(s.update(new_scale=3).loss_scale) == 3.0
    assert float(s.update(new_scale=0.5).loss_scale) == 0.5
    with pytest.raises(TypeError, match="new_scale must be a float scalar"):
        s.update(new_scale=True)
    with pytest.raises(TypeError, match=r"new_scale must be a float scalar, got float32\[2\]"):
        s.update(new_scale=jnp.ones(2))
    with pytest.raises(TypeError, match=r"new_scale must be a float scalar, got int32\[\]"):
        s.update(new_scale=jnp.int32(2))


def test_a_traced_non_finite_new_scale_is_stored_and_reported_not_used():
    s = jax.jit(lambda s, v: s.update(new_scale=v))(fmp.GradScaler(), jnp.float32(jnp.nan))
    assert math.isnan(float(s.loss_scale))  # documented: a traced value cannot be checked
    params = _params()
    new_params, s2, finite = _vg_step(params, s, jnp.int32(0))
    assert not bool(finite) and bool(fmp.all_finite(new_params))
    with pytest.warns(fmp.ScaleHealthWarning, match="the loss scale is nan"):
        fmp.check_scaler_health(s2)


def test_torch_facade_new_scale_accepts_anything_like_torch():
    torch = pytest.importorskip("torch")
    import fmp.torch

    for value in (math.nan, math.inf, 0.0, -2.0):
        got = []
        for cls in (torch.amp.GradScaler, fmp.torch.GradScaler):
            s = cls("cpu")
            s.scale(torch.ones(()))
            s.update(value)
            got.append(s.get_scale())
        assert str(got[0]) == str(got[1]), (value, got)


# --- the alarm inside jit -------------------------------------------------------------------------------------------
def test_overflow_alarm_under_jit_counts_resets_and_is_state_stable():
    s = fmp.GradScaler(init_scale=2.0**10, max_consecutive_overflows=3)
    traces = []

    @jax.jit
    def step(s, finite):
        traces.append(1)
        return s.update(finite)

    seq = [False, False, True, False, False, False, False]
    got = []
    for f in seq:
        new = step(s, jnp.array(f))
        jax.lax.cond(True, lambda old=s: old, lambda new=new: new)  # structure and dtypes did not drift
        s = new
        got.append((int(s.consecutive_overflows), bool(s.overflow_alarm)))
    assert got == [(1, False), (2, False), (0, False), (1, False), (2, False), (3, True), (4, True)]
    assert len(traces) == 1  # no recompile
    assert s.consecutive_overflows.dtype == jnp.int32 and s.max_consecutive_overflows == 3


def test_loss_scaled_overflow_alarm_under_jit():
    opt = fmp.optax.loss_scaled(optax.sgd(0.1), fmp.GradScaler(init_scale=8.0, max_consecutive_overflows=2))
    params = {"w": jnp.ones(2)}
    state = opt.init(params)
    step = jax.jit(opt.update)
    got = []
    for g in (jnp.inf, jnp.nan, 1.0, jnp.inf, jnp.inf, jnp.inf):
        _, state = step({"w": jnp.full(2, g)}, state, params)
        sc = fmp.optax.current_scaler(state)
        got.append((int(state.consecutive_skipped), bool(sc.overflow_alarm)))
    assert got == [(1, False), (2, True), (0, False), (1, False), (2, True), (3, True)]
    assert step._cache_size() == 1


def test_overflow_count_saturates_and_static_scalers_count_too():
    s = fmp.GradScaler(
        consecutive_overflows=jnp.int32(2**31 - 1), loss_scale=jnp.float32(1.0), growth_tracker=jnp.int32(0)
    )
    assert int(s.update(jnp.array(False)).consecutive_overflows) == 2**31 - 1
    st_ = fmp.GradScaler.static(8.0).update(jnp.array(False))
    assert float(st_.loss_scale) == 8.0 and int(st_.consecutive_overflows) == 1
    off = fmp.GradScaler(enabled=False)
    assert off.update(jnp.array(False)) is off


def test_consecutive_overflows_is_not_in_the_torch_state_dict_but_survives_flax():
    serialization = pytest.importorskip("flax.serialization")
    s = fmp.GradScaler(init_scale=8.0).update(jnp.array(False)).update(jnp.array(False))
    assert sorted(s.state_dict()) == sorted(
        ["scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"]
    )
    assert int(fmp.GradScaler.from_state_dict(s.state_dict()).consecutive_overflows) == 0
    back = serialization.from_bytes(fmp.GradScaler(), serialization.to_bytes(s))
    assert int(back.consecutive_overflows) == 2 and float(back.loss_scale) == 2.0
    # a checkpoint written before the field existed loads with a count of 0
    old = {"loss_scale": np.float32(4.0), "growth_tracker": np.int32(1)}
    back = serialization.from_state_dict(fmp.GradScaler(), old)
    assert int(back.consecutive_overflows) == 0 and int(back.growth_tracker) == 1


def test_max_consecutive_overflows_is_validated():
    with pytest.raises(ValueError, match="max_consecutive_overflows must be an int >= 1, got 0"):
        fmp.GradScaler(max_consecutive_overflows=0)
    with pytest.raises(TypeError, match="max_consecutive_overflows must be an int >= 1, got 2.0"):
        fmp.GradScaler(max_consecutive_overflows=2.0)


# --- the warning outside jit ----------------------------------------------------------------------------------------
def test_check_scaler_health_on_scalers_and_optax_states_names_the_leaves():
    grads = {"dense": {"w": jnp.ones(2), "b": jnp.array([jnp.inf])}}
    s = fmp.GradScaler(max_consecutive_overflows=2)
    assert fmp.check_scaler_health(s, grads)  # healthy: nothing is read but two scalars
    s = s.update(jnp.array(False)).update(jnp.array(False))
    with pytest.warns(fmp.ScaleHealthWarning, match=r"2 non-finite steps in a row \(limit 2\).*\['dense'\]\['b'\]"):
        assert not fmp.check_scaler_health(s, grads)
    opt = optax.chain(
        optax.identity(), fmp.optax.loss_scaled(optax.sgd(0.1), fmp.GradScaler(max_consecutive_overflows=1))
    )
    state = opt.init(grads)
    assert fmp.check_scaler_health(state)
    _, state = opt.update(grads, state, grads)
    with pytest.warns(fmp.ScaleHealthWarning, match="fmp.nonfinite_leaves"):
        assert not fmp.check_scaler_health(state)
    skip = fmp.optax.skip_nonfinite(optax.sgd(0.1))
    sstate = skip.init(grads)
    for _ in range(32):
        _, sstate = skip.update(grads, sstate)
    with pytest.warns(fmp.ScaleHealthWarning, match=r"skip_nonfinite: 32 non-finite steps in a row"):
        fmp.check_scaler_health(sstate)
    assert fmp.check_scaler_health(fmp.GradScaler(enabled=False))
    with pytest.raises(TypeError, match="found 0 scalers and 0 skip states"):
        fmp.check_scaler_health({"w": jnp.ones(2)})
    with pytest.raises(TypeError, match="found 2 scalers"):
        fmp.check_scaler_health([fmp.GradScaler(), fmp.GradScaler()])


def test_torch_facade_warns_once_per_long_run_of_skipped_steps():
    torch = pytest.importorskip("torch")
    import fmp.torch

    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = fmp.torch.GradScaler("cpu", max_consecutive_overflows=3)

    def iteration(bad):
        opt.zero_grad()
        scaler.scale((w * (math.nan if bad else 1.0)).sum()).backward()
        scaler.step(opt)
        scaler.update()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for bad in (True, True, False, True, True):  # runs of 2: no warning
            iteration(bad)
        assert not caught
        iteration(True)  # third in a row
        iteration(True)  # fourth: no second warning for the same run
    assert len(caught) == 1 and caught[0].category is fmp.ScaleHealthWarning
    assert "fmp.torch.GradScaler: 3 non-finite steps in a row (limit 3)" in str(caught[0].message)
    assert "p.grad.isfinite()" in str(caught[0].message)
    with pytest.raises(ValueError, match="max_consecutive_overflows must be an int >= 1, got 0"):
        fmp.torch.GradScaler("cpu", max_consecutive_overflows=0)


def test_nonfinite_leaves_compiles_once_and_a_healthy_check_does_not_scan_the_grads(monkeypatch):
    from fmp._scaling import _finite, _health

    grads = {"w": jnp.ones(3), "b": jnp.array([jnp.nan])}
    assert fmp.nonfinite_leaves(grads) == ["['b']"]
    before = _finite._leaf_flags._cache_size()
    assert fmp.nonfinite_leaves({"w": jnp.ones(3), "b": jnp.array([1.0])}) == []
    assert _finite._leaf_flags._cache_size() == before  # same structure: no new trace

    scans = []
    monkeypatch.setattr(_health, "nonfinite_leaves", lambda g: scans.append(g) or ["['b']"])
    assert fmp.check_scaler_health(fmp.GradScaler(), grads)  # healthy: no scan of the gradients
    assert scans == []
    sick = fmp.GradScaler(max_consecutive_overflows=1).update(jnp.array(False))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not fmp.check_scaler_health(sick, grads)
    assert len(scans) == 1 and "['b']" in str(caught[0].message)
