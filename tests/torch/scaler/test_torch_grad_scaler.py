"""fmp.torch.GradScaler against torch.amp.GradScaler: misuse, update rule, state dict, pickling, protocols."""

from __future__ import annotations

import inspect
import pickle
import warnings

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fmp.torch  # noqa: E402
from fmp._core import _scaler_rule  # noqa: E402
from fmp.torch._scaler._grad_scaler import TORCH_OPS  # noqa: E402

IMPLS = {"torch": torch.amp.GradScaler, "fmp": fmp.torch.GradScaler}


def _outcome(fn):
    """(exception type, message) of fn(), or ("ok", repr(result))."""
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - we compare whatever torch raises
        return type(e), str(e)
    return "ok", repr(out)


def _opt(dtype=torch.float32, grad=True):
    p = torch.nn.Parameter(torch.ones(3, dtype=dtype))
    if grad:
        p.grad = torch.full((3,), 2.0, dtype=dtype)
    return torch.optim.SGD([p], lr=0.1)


def _scaled(cls, **kw):
    s = cls("cpu", **kw)
    s.scale(torch.ones(()))
    return s


# each misuse: a function of the scaler class that performs it
MISUSES = {
    "unscale_before_scale": lambda cls: cls("cpu").unscale_(_opt()),
    "step_before_scale": lambda cls: cls("cpu").step(_opt()),
    "update_before_scale": lambda cls: cls("cpu").update(),
    "check_inf_before_scale": lambda cls: cls("cpu")._check_inf_per_device(_opt()),
    "scale_bad_leaf": lambda cls: cls("cpu").scale([torch.ones(1), 3]),
    "unscale_twice": lambda cls: [s := _scaled(cls), o := _opt(), s.unscale_(o), s.unscale_(o)],
    "unscale_after_step": lambda cls: [s := _scaled(cls), o := _opt(), s.step(o), s.unscale_(o)],
    "fp16_grads": lambda cls: _scaled(cls).unscale_(_opt(torch.float16)),
    "closure_kwarg": lambda cls: _scaled(cls).step(_opt(), closure=lambda: 0.0),
    "step_twice": lambda cls: [s := _scaled(cls), o := _opt(), s.step(o), s.step(o)],
    "no_inf_checks_opt": lambda cls: _scaled(cls).step(_opt(grad=False)),
    "no_inf_checks_update": lambda cls: _scaled(cls).update(),
    "new_scale_numel": lambda cls: _scaled(cls).update(torch.ones(2)),
    "new_scale_requires_grad": lambda cls: _scaled(cls).update(torch.ones((), requires_grad=True)),
    "new_scale_device": lambda cls: _scaled(cls).update(torch.ones((), device="meta")),
    "new_scale_int": lambda cls: _scaled(cls).update(3),
    "empty_state_dict": lambda cls: cls("cpu").load_state_dict({}),
    "missing_key": lambda cls: cls("cpu").load_state_dict({"scale": 2.0}),
    "pickle_mid_iteration": lambda cls: [s := _scaled(cls), s.unscale_(_opt()), pickle.dumps(s)],
    "growth_factor": lambda cls: cls("cpu", growth_factor=1.0),
    "backoff_factor": lambda cls: cls("cpu", backoff_factor=1.0),
    "disabled_get_growth_factor": lambda cls: cls("cpu", enabled=False).get_growth_factor(),
    "disabled_get_backoff_factor": lambda cls: cls("cpu", enabled=False).get_backoff_factor(),
    "disabled_get_growth_interval": lambda cls: cls("cpu", enabled=False).get_growth_interval(),
}


@pytest.mark.parametrize("name", sorted(MISUSES))
def test_misuse_raises_like_torch(name):
    expected = _outcome(lambda: MISUSES[name](IMPLS["torch"]))
    got = _outcome(lambda: MISUSES[name](IMPLS["fmp"]))
    assert expected[0] is not "ok", f"{name} does not raise in torch: the test is wrong"  # noqa: F632
    assert got == expected


def test_fp16_grad_leaves_stage_ready():
    for cls in IMPLS.values():
        s, o = _scaled(cls), _opt(torch.float16)
        with pytest.raises(ValueError):
            s.unscale_(o)
        o.param_groups[0]["params"][0].grad = None
        s.unscale_(o)  # still READY: a second unscale_ is allowed


def test_positional_closure_is_forwarded_like_torch():
    for cls in IMPLS.values():
        s, o = _scaled(cls), _opt()
        calls = []
        s.step(o, lambda _c=calls: _c.append(1) or 0.0)
        assert calls == [1]


def test_cuda_scaler_without_cuda_warns_and_disables():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    records = {}
    for name, cls in IMPLS.items():
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            s = cls()
        records[name] = [(x.category, str(x.message)) for x in w]
        assert not s.is_enabled() and s.get_scale() == 1.0 and s.state_dict() == {}
        x = torch.ones(2)
        assert s.scale(x) is x
    assert records["fmp"] == records["torch"] and records["torch"]


def test_legacy_cuda_amp_scaler_warns_like_torch():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    records = []
    for cls in (torch.cuda.amp.GradScaler, fmp.torch.cuda.amp.GradScaler):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            s = cls(init_scale=8.0)
        records.append([(x.category, str(x.message)) for x in w])
        assert not s.is_enabled()
    assert records[0] == records[1] and len(records[0]) == 2


def test_meta_device_is_accepted():
    s = fmp.torch.GradScaler("meta")
    x = s.scale(torch.ones((), device="meta"))
    assert x.device.type == "meta" and s._scale.device.type == "meta"
    p = torch.nn.Parameter(torch.ones(2, device="meta"))
    p.grad = torch.ones(2, device="meta")
    s.unscale_(torch.optim.SGD([p], lr=0.1))  # no host sync, so meta works here


def test_scale_nested_containers_like_torch():
    for cls in IMPLS.values():
        s = cls("cpu", init_scale=4.0)
        out = s.scale([torch.ones(1), (torch.ones(1, dtype=torch.bfloat16), [torch.ones(1, dtype=torch.float64)])])
        assert isinstance(out, list) and isinstance(out[1], tuple) and isinstance(out[1][1], list)
        assert out[1][0].dtype == torch.bfloat16 and out[1][1][0].dtype == torch.float64
        gen = s.scale(t for t in [torch.ones(1)])
        assert type(gen) is map and next(gen).item() == 4.0
        assert s.scale(torch.arange(2)).dtype == torch.float32


def test_state_dict_and_getters_match_torch():
    seqs = {}
    for name, cls in IMPLS.items():
        s = cls("cpu", init_scale=128, growth_factor=1.5, backoff_factor=0.25, growth_interval=3)
        before = (s.get_scale(), s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval())
        s.scale(torch.ones(()))
        o = _opt()
        s.step(o)
        s.update()
        s.set_growth_interval(5)
        s.set_growth_factor(3.0)
        s.set_backoff_factor(0.125)
        seqs[name] = (before, s.state_dict(), s.is_enabled())
    assert seqs["fmp"][1] == seqs["torch"][1]
    assert seqs["fmp"][0] == seqs["torch"][0] and seqs["fmp"][2] is True
    assert seqs["fmp"][1]["_growth_tracker"] == 1


def test_load_state_dict_crosses_both_ways_and_into_fmp_format():
    t = torch.amp.GradScaler("cpu", growth_interval=2)
    t.scale(torch.ones(()))
    t.step(_opt())
    t.update()
    f = fmp.torch.GradScaler("cpu")
    f.load_state_dict(t.state_dict())
    assert f.state_dict() == t.state_dict()
    f.scale(torch.ones(()))  # live tensors made from the loaded values
    assert f._growth_tracker.item() == 1 and f.get_scale() == 65536.0
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(f.state_dict())
    assert back.state_dict() == f.state_dict()
    # the shared format: exactly what fmp._core's make/parse produce
    assert _scaler_rule.parse_state_dict(f.state_dict()) == f.state_dict()
    assert list(f.state_dict()) == list(_scaler_rule.STATE_DICT_KEYS)


def test_bad_state_dict_changes_nothing():
    f = fmp.torch.GradScaler("cpu", init_scale=8.0)
    with pytest.raises(KeyError):
        f.load_state_dict({"scale": 2.0, "growth_factor": 3.0})
    assert f.get_scale() == 8.0 and f.get_growth_factor() == 2.0


def test_pickle_roundtrip_like_torch():
    states = []
    for cls in IMPLS.values():
        s = cls("cpu", growth_interval=2)
        s.scale(torch.ones(()))
        s.step(_opt())
        s.update()
        s2 = pickle.loads(pickle.dumps(s))
        assert s2._scale is None
        s2.scale(torch.ones(()))
        states.append(s2.state_dict())
    assert states[0] == states[1]


def test_sparse_grads_like_torch():
    results = []
    for cls in IMPLS.values():
        s = cls("cpu", init_scale=2.0**15)
        s.scale(torch.ones(()))
        i = torch.tensor([[0, 0, 1]])
        p16 = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
        p16.grad = torch.sparse_coo_tensor(
            i, torch.tensor([40000.0, 40000.0, 1.0], dtype=torch.float16), (3,), check_invariants=True
        )
        p32 = torch.nn.Parameter(torch.zeros(3))
        p32.grad = torch.sparse_coo_tensor(i, torch.tensor([2.0**15, 2.0**15, 1.0]), (3,), check_invariants=True)
        o32 = torch.optim.SGD([p32], lr=1.0)
        s.unscale_(o32)
        o16 = torch.optim.SGD([p16], lr=1.0)
        found16 = s._check_inf_per_device(o16)
        results.append(
            (
                p32.grad._values().tolist(),
                p32.grad.is_coalesced(),
                p16.grad.is_coalesced(),
                [f.item() for f in found16.values()],
            )
        )
    assert results[0] == results[1]
    assert results[0][3] == [1.0]  # fp16 duplicates overflow once coalesced


def test_fused_optimizer_protocol_matches_torch():
    seen = {}
    for name, cls in IMPLS.items():
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(4))
        opt = torch.optim.Adam([p], lr=0.1, fused=True)
        assert opt._step_supports_amp_scaling
        s = cls("cpu", init_scale=8.0)
        opt.grad_scale = torch.tensor(3.0)
        record = []
        original = opt.step

        def spy(*a, _o=opt, _orig=original, _r=record, **k):
            _r.append((float(_o.grad_scale), float(_o.found_inf)))
            return _orig(*a, **k)

        opt.step = spy
        (s.scale((p * p).sum())).backward()
        s.step(opt)
        s.update()
        seen[name] = (record, p.detach().clone(), p.grad.clone(), hasattr(opt, "found_inf"), s.get_scale())
    assert seen["fmp"][0] == seen["torch"][0] == [(24.0, 0.0)]
    assert torch.equal(seen["fmp"][1], seen["torch"][1]) and torch.equal(seen["fmp"][2], seen["torch"][2])
    assert seen["fmp"][3] is seen["torch"][3] is False and seen["fmp"][4] == seen["torch"][4]


def test_grad_scaler_kwarg_optimizer_warns_like_torch():
    class Opt(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None, grad_scaler=None):
            self.got = grad_scaler
            return None

    records = []
    for cls in IMPLS.values():
        s = _scaled(cls)
        o = Opt([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            s.step(o)
        assert o.got is s
        records.append(([(x.category, str(x.message)) for x in w], _outcome(s.update)))
    assert records[0] == records[1]
    assert records[0][1][1] == "No inf checks were recorded prior to update."


def test_signature_matches_torch():
    ours = inspect.signature(fmp.torch.GradScaler.__init__).parameters
    theirs = inspect.signature(torch.amp.GradScaler.__init__).parameters
    assert [(n, p.default) for n, p in theirs.items()] == [(n, p.default) for n, p in ours.items()][: len(theirs)]
    for method in ("scale", "unscale_", "step", "update", "state_dict", "load_state_dict", "get_scale"):
        assert list(inspect.signature(getattr(torch.amp.GradScaler, method)).parameters) == list(
            inspect.signature(getattr(fmp.torch.GradScaler, method)).parameters
        )


# --- the update rule: fmp's shared rule is bit-identical to torch._amp_update_scale_ ---------------------------

_f32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


@settings(max_examples=300, deadline=None)
@given(
    scale=_f32,
    tracker=st.integers(0, 40),
    found=st.booleans(),
    gf=st.floats(1.0001, 5.0),
    bf=st.floats(0.01, 0.9999),
    interval=st.integers(1, 40),
)
def test_update_rule_is_bit_identical_to_torch_kernel(scale, tracker, found, gf, bf, interval):
    s_ref = torch.tensor(scale, dtype=torch.float32)
    t_ref = torch.tensor(tracker, dtype=torch.int32)
    torch._amp_update_scale_(s_ref, t_ref, torch.tensor(float(found)), gf, bf, interval)
    s, t = _scaler_rule.update_scale(
        torch.tensor(scale, dtype=torch.float32),
        torch.tensor(tracker, dtype=torch.int32),
        torch.tensor(found),
        growth_factor=gf,
        backoff_factor=bf,
        growth_interval=interval,
        ops=TORCH_OPS,
    )
    assert s.dtype == torch.float32 and t.dtype == torch.int32
    assert torch.equal(s.view(torch.int32), s_ref.view(torch.int32)) or (s.isnan() and s_ref.isnan())
    assert torch.equal(t, t_ref)


@pytest.mark.parametrize(
    ("scale", "gf", "bf", "seq"),
    [(3.0, 1.1, 0.3, [0, 0, 1, 0, 0, 0, 1]), (3e38, 2.0, 0.5, [0, 0, 0]), (1e-44, 2.0, 0.5, [1, 1])],
)
def test_scaler_trajectory_matches_torch(scale, gf, bf, seq):
    traj = {}
    for name, cls in IMPLS.items():
        s = cls("cpu", init_scale=scale, growth_factor=gf, backoff_factor=bf, growth_interval=2)
        s.scale(torch.ones(()))
        out = []
        for bad in seq:
            p = torch.nn.Parameter(torch.ones(1))
            p.grad = torch.tensor([float("inf") if bad else 1.0])
            s.step(torch.optim.SGD([p], lr=0.1))
            s.update()
            out.append((s._scale.view(torch.int32).item(), s._growth_tracker.item()))
        traj[name] = out
    assert traj["fmp"] == traj["torch"]


def test_update_new_scale_like_torch():
    for cls in IMPLS.values():
        s = _scaled(cls)
        s.update(3.3)
        assert s.get_scale() == torch.tensor(3.3).item()
        s.update(torch.tensor(3.3, dtype=torch.float64))
        assert s.get_scale() == pytest.approx(3.2999999523, abs=1e-9)


def test_tracker_beyond_interval_never_grows_like_torch():
    out = []
    for cls in IMPLS.values():
        s = _scaled(cls, growth_interval=10)
        for _ in range(6):
            s.step(_opt())
            s.update()
        s.set_growth_interval(2)
        for _ in range(3):
            s.step(_opt())
            s.update()
        out.append(s.state_dict())
    assert out[0] == out[1] and out[0]["scale"] == 2.0**16 and out[0]["_growth_tracker"] == 9


def test_unscale_makes_no_host_sync(monkeypatch):
    s = _scaled(fmp.torch.GradScaler)
    o = _opt()

    def boom(self):
        raise AssertionError("host sync in unscale_/update")

    monkeypatch.setattr(torch.Tensor, "item", boom)
    s.unscale_(o)
    monkeypatch.undo()
    s.step(o)
    monkeypatch.setattr(torch.Tensor, "item", boom)
    s.update()


def test_grads_on_two_devices_are_bucketed_like_torch():
    keys = []
    for cls in IMPLS.values():
        s = _scaled(cls, init_scale=4.0)
        a = torch.nn.Parameter(torch.ones(2))
        a.grad = torch.full((2,), 8.0)
        b = torch.nn.Parameter(torch.ones(2, device="meta"))
        b.grad = torch.ones(2, device="meta")
        c = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
        c.grad = torch.full((2,), 8.0, dtype=torch.float64)
        opt = torch.optim.SGD([a, b, c], lr=0.1)
        s.unscale_(opt)
        found = s._found_inf_per_device(opt)
        keys.append(
            (sorted(str(d) for d in found), found[torch.device("cpu")].item(), a.grad.tolist(), c.grad.tolist())
        )
    assert keys[0] == keys[1] and keys[0][0] == ["cpu", "meta"] and keys[0][2] == [2.0, 2.0]


def test_torch_ops_adapter_isfinite_and_mul_f64():
    x = torch.tensor([0.0, 1.0, -float("inf"), float("inf"), float("nan"), 3.4028235e38, -1e-45])
    assert torch.equal(TORCH_OPS.isfinite(x), torch.isfinite(x))
    s = torch.tensor(3.0)
    assert TORCH_OPS.mul_f64(s, 1.1).dtype == torch.float32
    assert TORCH_OPS.mul_f64(s, 1.1).item() == torch.tensor(3.0 * 1.1, dtype=torch.float64).float().item()


def test_checkpoint_crosses_to_the_jax_grad_scaler():
    import fmp as fmp_root

    if not hasattr(fmp_root, "GradScaler"):
        pytest.skip("the JAX fmp.GradScaler is built in another branch; this runs once both are merged")
    s = fmp.torch.GradScaler("cpu", init_scale=3.0, growth_factor=1.1, backoff_factor=0.3, growth_interval=3)
    s.scale(torch.ones(()))
    for bad in (False, True, False, False):
        p = torch.nn.Parameter(torch.ones(1))
        p.grad = torch.tensor([float("inf") if bad else 1.0])
        s.step(torch.optim.SGD([p], lr=0.1))
        s.update()
    d = s.state_dict()
    jax_scaler = fmp_root.GradScaler.from_state_dict(d)
    assert jax_scaler.state_dict() == d
    back = fmp.torch.GradScaler("cpu")
    back.load_state_dict(jax_scaler.state_dict())
    assert back.state_dict() == d


@settings(max_examples=40, deadline=None)
@given(
    seq=st.lists(st.sampled_from([0, 1, 2]), min_size=1, max_size=10),
    init=st.floats(1e-30, 3e38),
    gf=st.floats(1.0001, 4.0),
    bf=st.floats(0.01, 0.9999),
    interval=st.integers(1, 4),
)
def test_whole_scaler_trajectory_property(seq, init, gf, bf, interval):
    # 0: finite grads, 1: inf, 2: NaN; scale bits and tracker equal torch's after every update
    out = {}
    for name, cls in IMPLS.items():
        s = cls("cpu", init_scale=init, growth_factor=gf, backoff_factor=bf, growth_interval=interval)
        s.scale(torch.ones(()))
        traj = []
        for kind in seq:
            p = torch.nn.Parameter(torch.ones(2))
            p.grad = torch.tensor([1.0, (1.0, float("inf"), float("nan"))[kind]])
            opt = torch.optim.SGD([p], lr=0.1)
            s.step(opt)
            s.update()
            traj.append((s._scale.view(torch.int32).item(), s._growth_tracker.item(), p.detach().tolist()))
        out[name] = (traj, s.state_dict())
    assert out["fmp"] == out["torch"]
