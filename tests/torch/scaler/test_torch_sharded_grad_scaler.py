"""fmp.torch.ShardedGradScaler against torch.distributed.fsdp's ShardedGradScaler.

The FSDP1/FSDP2 matrix runs on 2 ranks once per session (the ``dist_results`` fixture); the rest runs in this
process inside a one-rank gloo group.
"""

from __future__ import annotations

import inspect
import pickle
import random
import warnings

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded  # noqa: E402

import fmp  # noqa: E402
import fmp.torch  # noqa: E402

IMPLS = {"torch": TorchSharded, "fmp": fmp.torch.ShardedGradScaler}


@pytest.fixture(scope="module", autouse=True)
def _one_rank_group():
    """unscale_ all-reduces: a one-rank gloo group for the in-process tests."""
    if dist.is_initialized():
        pytest.fail("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


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


MISUSES = {
    "unscale_before_scale": lambda cls: cls("cpu").unscale_(_opt()),
    "step_before_scale": lambda cls: cls("cpu").step(_opt()),
    "update_before_scale": lambda cls: cls("cpu").update(),
    "scale_bad_leaf": lambda cls: cls("cpu").scale([torch.ones(1), 3]),
    "scale_meta_tensor": lambda cls: cls("cpu").scale(torch.ones((), device="meta")),
    "scale_meta_leaf": lambda cls: cls("cpu").scale([torch.ones(1), torch.ones(1, device="meta")]),
    "unscale_twice": lambda cls: [s := _scaled(cls), o := _opt(), s.unscale_(o), s.unscale_(o)],
    "unscale_after_step": lambda cls: [s := _scaled(cls), o := _opt(), s.step(o), s.unscale_(o)],
    "closure_kwarg": lambda cls: _scaled(cls).step(_opt(), closure=lambda: 0.0),
    "step_twice": lambda cls: [s := _scaled(cls), o := _opt(), s.step(o), s.step(o)],
    "no_inf_checks_update": lambda cls: _scaled(cls).update(),
    "new_scale_numel": lambda cls: _scaled(cls).update(torch.ones(2)),
    "new_scale_requires_grad": lambda cls: _scaled(cls).update(torch.ones((), requires_grad=True)),
    "new_scale_device": lambda cls: _scaled(cls).update(torch.ones((), device="meta")),
    "empty_state_dict": lambda cls: cls("cpu").load_state_dict({}),
    "missing_key": lambda cls: cls("cpu").load_state_dict({"scale": 2.0}),
    "pickle_mid_iteration": lambda cls: [s := _scaled(cls), s.unscale_(_opt()), pickle.dumps(s)],
    "growth_factor": lambda cls: cls("cpu", growth_factor=1.0),
    "backoff_factor": lambda cls: cls("cpu", backoff_factor=1.0),
}


@pytest.mark.parametrize("name", sorted(MISUSES))
def test_misuse_raises_like_torch(name):
    expected = _outcome(lambda: MISUSES[name](IMPLS["torch"]))
    got = _outcome(lambda: MISUSES[name](IMPLS["fmp"]))
    assert expected[0] != "ok", f"{name} does not raise in torch: the test is wrong"
    assert got == expected


def test_signature_matches_torch_and_reuses_grad_scaler():
    ours = inspect.signature(fmp.torch.ShardedGradScaler.__init__).parameters
    theirs = inspect.signature(TorchSharded.__init__).parameters
    assert [(n, p.default) for n, p in theirs.items()] == [(n, p.default) for n, p in ours.items()][: len(theirs)]
    assert list(ours)[len(theirs) :] == ["max_consecutive_overflows"]
    for method in ("scale", "unscale_", "step", "update", "state_dict", "load_state_dict", "get_scale"):
        assert list(inspect.signature(getattr(TorchSharded, method)).parameters) == list(
            inspect.signature(getattr(fmp.torch.ShardedGradScaler, method)).parameters
        )
    # a subclass built on GradScaler's machinery, not a copy of it
    assert issubclass(fmp.torch.ShardedGradScaler, fmp.torch.GradScaler)
    for method in ("step", "update", "scale", "state_dict", "load_state_dict", "_check_inf_per_device"):
        assert getattr(fmp.torch.ShardedGradScaler, method) is getattr(fmp.torch.GradScaler, method), method


def test_cuda_scaler_without_cuda_warns_and_disables_like_torch():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the scaler is enabled")
    records = {}
    for name, cls in IMPLS.items():
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            s = cls()
        records[name] = [(x.category, str(x.message)) for x in w]
        assert not s.is_enabled() and s.get_scale() == 1.0 and s.state_dict() == {}
    assert records["fmp"] == records["torch"] and records["torch"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_scale_keeps_the_loss_dtype_like_torch(dtype):
    outs = {}
    for name, cls in IMPLS.items():
        s = cls("cpu", init_scale=3.0)
        single = s.scale(torch.tensor(1.5, dtype=dtype))
        nested = s.scale([torch.ones(2, dtype=dtype), (torch.ones((), dtype=torch.bfloat16),)])
        outs[name] = (single, nested[0], nested[1][0], type(nested[1]))
    for a, b in zip(outs["fmp"][:3], outs["torch"][:3], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert outs["fmp"][0].dtype == dtype  # GradScaler would promote a 0-d float16 loss to float32
    assert outs["fmp"][3] is outs["torch"][3] is tuple


def _loop(cls, opt_name, *, dtype, seed=0, steps=8, inf_steps=(2, 5), state=None, **kw):
    """A small model in ``dtype`` (its gradients too); returns the params after each step, scales, state_dict."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).to(dtype)
    params = list(model.parameters())
    opt = {
        "sgd": lambda: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        "adam": lambda: torch.optim.Adam(params, lr=0.01, eps=1e-4),
        "adam_fused": lambda: torch.optim.Adam(params, lr=0.01, eps=1e-4, fused=True),
    }[opt_name]()
    scaler = cls("cpu", **kw)
    if state is not None:
        scaler.load_state_dict(state)
    snaps, scales = [], []
    for step in range(steps):
        opt.zero_grad()
        x = torch.randn(4, 5, dtype=dtype)
        scaler.scale(model(x).float().pow(2).mean()).backward()
        if step in inf_steps:
            params[0].grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        snaps.append(torch.cat([p.detach().flatten() for p in params]))
        scales.append(scaler.get_scale())
    return torch.stack(snaps), scales, scaler.state_dict()


@pytest.mark.parametrize("opt_name", ["sgd", "adam", "adam_fused"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_gradients_match_torch_bitwise(opt_name, dtype):
    kw = {"init_scale": 2.0**10, "growth_interval": 2, "growth_factor": 1.5, "backoff_factor": 0.3}
    ours = _loop(fmp.torch.ShardedGradScaler, opt_name, dtype=dtype, **kw)
    theirs = _loop(TorchSharded, opt_name, dtype=dtype, **kw)
    assert torch.equal(ours[0], theirs[0])
    assert ours[1] == theirs[1] and ours[2] == theirs[2]
    assert len(set(ours[1])) > 3  # the scale grew and backed off with non-power-of-two factors
    if dtype == torch.float16 and opt_name != "adam_fused":  # GradScaler's unscale_ refuses them (torch.amp's rule)
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
            _loop(fmp.torch.GradScaler, opt_name, dtype=dtype, steps=1, **kw)


def test_cpu_update_multiplies_in_float32_like_torch():
    rng = random.Random(0)
    classes = {**IMPLS, "grad_scaler": fmp.torch.GradScaler}
    for gf, bf in [(1.1, 0.3), (1.37, 0.77), (2.0, 0.5), (1.0001, 0.9999)]:
        flags = [rng.random() < 0.4 for _ in range(40)]
        init = rng.uniform(1.0, 2.0**20)
        scales = {}
        for name, cls in classes.items():
            s = cls("cpu", init_scale=init, growth_factor=gf, backoff_factor=bf, growth_interval=1)
            seq = []
            for inf in flags:
                p = torch.nn.Parameter(torch.ones(2))
                s.scale(torch.ones(()))
                p.grad = torch.tensor([float("inf") if inf else 1.0, 1.0])
                s.step(torch.optim.SGD([p], lr=0.1))
                s.update()
                seq.append(s._scale.clone())
            scales[name] = torch.stack(seq)
        assert torch.equal(scales["fmp"], scales["torch"]), (gf, bf)
        # GradScaler's float64 products (torch._amp_update_scale_) give other bits: the classes really differ
        assert torch.equal(scales["grad_scaler"], scales["torch"]) == (gf == 2.0), (gf, bf)


def test_state_dict_crosses_both_ways_mid_training():
    kw = {"init_scale": 2.0**8, "growth_interval": 3}
    for first, second in [("torch", "fmp"), ("fmp", "torch")]:
        _, _, state = _loop(IMPLS[first], "sgd", dtype=torch.float16, steps=4, inf_steps=(1,), **kw)
        assert state["_growth_tracker"] == 2 and state["scale"] == 2.0**7
        runs = [
            _loop(IMPLS[name], "sgd", dtype=torch.float16, steps=5, inf_steps=(3,), state=state, seed=1)
            for name in (first, second)
        ]
        assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1] and runs[0][2] == runs[1][2]
        # and into the JAX scaler, which reads the same five keys
        assert float(fmp.GradScaler.from_state_dict(runs[1][2]).loss_scale) == runs[1][2]["scale"]


def test_pickle_roundtrip_drops_the_group():
    s = fmp.torch.ShardedGradScaler("cpu", growth_interval=2, process_group=dist.group.WORLD)
    s.scale(torch.ones(()))
    s.step(_opt())
    s.update()
    s2 = pickle.loads(pickle.dumps(s))
    assert s2.process_group is None and s2._scale is None
    assert s2.state_dict() == s.state_dict()


def test_rank_without_gradients_gets_a_flag_like_torch():
    results = []
    for cls in IMPLS.values():
        s = _scaled(cls)
        o = _opt(grad=False)
        s.unscale_(o)
        found = s._found_inf_per_device(o)
        s.step(o)  # GradScaler would raise "No inf checks were recorded for this optimizer."
        s.update()
        results.append(([(d.type, f.shape, f.item()) for d, f in found.items()], s.get_scale()))
    assert results[0] == results[1] == ([("cpu", torch.Size([1]), 0.0)], 65536.0)


def test_sparse_fp16_grads_like_torch():
    results = []
    for cls in IMPLS.values():
        s = _scaled(cls, init_scale=2.0**15)
        i = torch.tensor([[0, 0, 1]])
        p16 = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
        p16.grad = torch.sparse_coo_tensor(
            i, torch.tensor([40000.0, 40000.0, 1.0], dtype=torch.float16), (3,), check_invariants=True
        )
        o16 = torch.optim.SGD([p16], lr=1.0)
        s.unscale_(o16)
        found = s._found_inf_per_device(o16)
        results.append((p16.grad.is_coalesced(), p16.grad._values().tolist(), [f.item() for f in found.values()]))
    assert results[0] == results[1]
    assert results[0][2] == [1.0]  # the fp16 duplicates overflow once coalesced


def test_fused_optimizer_gets_a_flag_like_torch():
    seen = {}
    for name, cls in IMPLS.items():
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(4))
        opt = torch.optim.Adam([p], lr=0.1, fused=True)
        s = cls("cpu", init_scale=8.0)
        record = []
        original = opt.step

        def spy(*a, _o=opt, _orig=original, _r=record, **k):
            _r.append((float(_o.grad_scale), float(_o.found_inf)))
            return _orig(*a, **k)

        opt.step = spy
        for inf in (False, True, False):
            opt.zero_grad()
            s.scale((p * p).sum()).backward()
            if inf:
                p.grad[0] = float("inf")
            s.step(opt)
            s.update()
        seen[name] = (record, p.detach().clone(), float(opt.state[p]["step"]), s.get_scale())
    assert seen["fmp"][0] == seen["torch"][0] == [(8.0, 0.0), (8.0, 1.0), (4.0, 0.0)]
    assert torch.equal(seen["fmp"][1], seen["torch"][1])
    assert seen["fmp"][2:] == seen["torch"][2:] == (2.0, 4.0)


# --- the FSDP matrix on 2 ranks ------------------------------------------------------------------------------


def _torch_is_right(name: str) -> bool:
    wrapper, _, _, opt_name = name.split("/")
    if opt_name == "adam_fused":
        # torch's fused path checks the flag without all-reducing it: right only where FSDP2's DTensor check
        # already reduced it
        return wrapper == "fsdp2"
    return opt_name != "adam_fused_unscale"  # torch's fails there (a (1,) flag against () step counts)


@pytest.mark.xdist_group("processes")  # see tests/conftest.py
def test_fsdp_matrix_matches_torch_bitwise(dist_results):
    r0s, r1s = (r["sharded"] for r in dist_results)
    assert r0s.keys() == r1s.keys()
    # FSDP1 and FSDP2 x bf16/fp16 params x fp32/None reduce x 4 optimizer paths, a float16 FSDP1 model, DDP
    assert len(r0s) == 2 * 2 * 2 * 4 + 4 + 2
    for name, r0 in r0s.items():
        r1 = r1s[name]
        param_dtype = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}[name.split("/")[1]]
        for r in (r0, r1):
            # every rank skips the step where rank 1 alone had the inf, and the scales agree
            assert r["ours"]["skipped"] == [False, True, False, False], name
            assert r["ours"]["scales"] == [256.0, 128.0, 128.0, 256.0], name
            assert r["ours"]["loss_dtypes"] == [param_dtype], name
            assert r["finite"], name
            assert r["ours"]["flags"] == [1.0], name  # one 0/1 flag, whatever the path
            if _torch_is_right(name):
                assert r["equal_steps"] == [True] * 4, name
                assert r["theirs"]["scales"] == r["ours"]["scales"], name
                assert r["theirs"]["state_dict"] == r["ours"]["state_dict"], name
                assert r["theirs"]["loss_dtypes"] == r["ours"]["loss_dtypes"], name
        if name.startswith("fsdp2/") and "fused" not in name:
            # torch's SUM over a flag FSDP2's DTensor check already reduced: 2.0 on every rank
            assert r0["theirs"]["flags"] == r1["theirs"]["flags"] == [2.0], name
        if not _torch_is_right(name) and name.endswith("/adam_fused"):
            # torch 2.13 on FSDP1 and DDP: rank 0 never saw the inf, steps and grows its scale; rank 1 skips
            assert r0["theirs"]["scales"] != r1["theirs"]["scales"], name
        if name.endswith("_unscale"):
            assert "doesn't match the broadcast shape" in r0["theirs_error"], name


def test_grown_scale_that_overflows_is_not_taken():
    """torch's CPU path takes an inf scale (every later step is skipped); fmp keeps _amp_update_scale_'s guard."""
    scales = {}
    for name, cls in IMPLS.items():
        s = cls("cpu", init_scale=2.0**127, growth_interval=1)
        s.scale(torch.ones(()))
        s.step(_opt())
        s.update()
        scales[name] = s.get_scale()
    assert scales == {"torch": float("inf"), "fmp": 2.0**127}


def test_health_warning_names_the_sharded_scaler():
    s = fmp.torch.ShardedGradScaler("cpu", max_consecutive_overflows=2)
    with pytest.warns(fmp.ScaleHealthWarning, match=r"^fmp\.torch\.ShardedGradScaler: 2 non-finite steps in a row"):
        for _ in range(2):
            o = _opt()
            o.param_groups[0]["params"][0].grad[0] = float("nan")
            s.scale(torch.ones(()))
            s.step(o)
            s.update()
