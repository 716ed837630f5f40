"""fmp.torch.fp16_utils: the apex fp16_utils contract on CPU (and CUDA when present)."""

from __future__ import annotations

import copy
import math
import pickle
import random

import pytest

torch = pytest.importorskip("torch")

from fmp.torch import fp16_utils  # noqa: E402
from fmp.torch.fp16_utils import (  # noqa: E402
    BN_convert_float,
    DynamicLossScaler,
    FP16_Optimizer,
    FP16Model,
    LossScaler,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
)

D_IN, D_OUT, N = 8, 4, 16


def _data(seed=0, device="cpu", steps=12):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(N, D_IN, generator=g).to(device), torch.randn(N, D_OUT, generator=g).to(device))
        for _ in range(steps)
    ]


def _model(seed=0, device="cpu"):
    torch.manual_seed(seed)
    return torch.nn.Linear(D_IN, D_OUT).to(device).half()


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x.half()).float(), y)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------- the seed's examples, run as written


def test_seed_static_example_trains(capsys):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-1)
    optimizer = FP16_Optimizer(optimizer, static_loss_scale=128.0)
    out = capsys.readouterr().out
    assert "FP16_Optimizer processing param group 0:" in out
    assert "FP16_Optimizer received torch.HalfTensor with torch.Size([4, 8])" in out
    losses = []
    for x, y in _data():
        optimizer.zero_grad()
        loss = _loss(model, x, y)
        optimizer.backward(loss)  # loss.backward() becomes:
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(p.dtype == torch.float16 for p in model.parameters())
    assert optimizer.loss_scale == 128.0
    # the masters are float32, the model holds their half rounding
    masters = optimizer.fp32_from_fp16_groups[0]
    assert all(m.dtype == torch.float32 for m in masters)
    assert all(torch.equal(p, m.half()) for p, m in zip(model.parameters(), masters, strict=True))


def test_seed_dynamic_example_with_args(capsys):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-1)
    optimizer = FP16_Optimizer(optimizer, dynamic_loss_scale=True, dynamic_loss_args={"scale_window": 500})
    assert optimizer.loss_scale == 2.0**16  # apex.amp.scaler default, not DynamicLossScaler's 2**32
    assert optimizer.loss_scaler._scale_seq_len == 500
    losses = []
    for x, y in _data():
        optimizer.zero_grad()
        loss = _loss(model, x, y)
        optimizer.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_loss_scale_is_assignable():
    optimizer = FP16_Optimizer(torch.optim.SGD(_model().parameters(), lr=0.1), static_loss_scale=8.0, verbose=False)
    optimizer.loss_scale = 32.0
    assert optimizer.loss_scale == 32.0


# ---------------------------------------------------------------- bitwise against a hand-written fp32-master loop


class _Mixed(torch.nn.Module):
    """A half linear layer followed by a float32 scale vector: a mix of fp16 and fp32 params."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(D_IN, D_OUT).half()
        self.gain = torch.nn.Parameter(torch.linspace(0.5, 1.5, D_OUT))

    def forward(self, x):
        return self.lin(x.half()).float() * self.gain


def _reference_run(make_opt, scales, data, seed=0, device="cpu"):
    """apex's recipe by hand: fp32 masters, scaled backward, copy + unscale, step, copy back.

    ``scales`` gives the loss scale of each step.
    """
    torch.manual_seed(seed)
    model = _Mixed().to(device)
    half = [model.lin.weight, model.lin.bias]
    masters = [p.detach().clone().float().requires_grad_(True) for p in half]
    opt = make_opt(masters + [model.gain])
    history = []
    for (x, y), scale in zip(data, scales, strict=True):
        for p in [*half, *masters, model.gain]:
            p.grad = None
        loss = torch.nn.functional.mse_loss(model(x), y)
        (loss.float() * scale).backward()
        with torch.no_grad():
            for p, m in zip(half, masters, strict=True):
                m.grad = p.grad.float().mul_(1.0 / scale)
            model.gain.grad.mul_(1.0 / scale)
        opt.step()
        with torch.no_grad():
            for p, m in zip(half, masters, strict=True):
                p.copy_(m)
        history.append(_params(model))
    return history


def _fp16_optimizer_run(make_opt, data, seed=0, device="cpu", **kwargs):
    torch.manual_seed(seed)
    model = _Mixed().to(device)
    optimizer = FP16_Optimizer(make_opt(model.parameters()), verbose=False, **kwargs)
    history = []
    for x, y in data:
        optimizer.zero_grad(set_grads_to_None=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.backward(loss)
        optimizer.step()
        history.append(_params(model))
    return history, optimizer


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("dynamic", [False, True])
def test_matches_hand_written_master_loop_bitwise(name, dynamic):
    data = _data(steps=10)
    make = OPTIMIZERS[name]
    if dynamic:
        # a window of 4 grows the scale twice in 10 steps (2**10 -> 2**11 -> 2**12), never overflowing
        got, opt = _fp16_optimizer_run(
            make, data, dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0**10, "scale_window": 4}
        )
        assert opt.loss_scale == 2.0**12
        scales = [2.0**10] * 4 + [2.0**11] * 4 + [2.0**12] * 2  # the scale each step's backward used
    else:
        got, _ = _fp16_optimizer_run(make, data, static_loss_scale=256.0)
        scales = [256.0] * len(data)
    ref = _reference_run(make, scales, data)
    for a, b in zip(got, ref, strict=True):
        assert _same(a, b)


def test_loss_scale_does_not_change_the_trajectory():
    data = _data(steps=6)
    a, _ = _fp16_optimizer_run(OPTIMIZERS["adam"], data, static_loss_scale=1.0)
    b, _ = _fp16_optimizer_run(OPTIMIZERS["adam"], data, static_loss_scale=1024.0)
    for x, y in zip(a, b, strict=True):
        assert _same(x, y)  # power-of-two scales are exact unless something underflows


def test_master_weights_keep_updates_half_precision_would_lose():
    # lr * grad far below half precision's spacing at 1.0: the fp16 model stalls, the masters do not
    model = torch.nn.Linear(1, 1, bias=False).half()
    with torch.no_grad():
        model.weight.fill_(1.0)
    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=1e-4), verbose=False)
    for _ in range(30):
        optimizer.zero_grad()
        optimizer.backward(model(torch.ones(1, 1, dtype=torch.half)).float().sum())
        optimizer.step()
    master = optimizer.fp32_from_fp16_groups[0][0].item()
    assert master == pytest.approx(1.0 - 30e-4, rel=1e-6)
    assert model.weight.item() == torch.tensor(master).half().item() < 1.0
    plain = torch.ones(1, dtype=torch.half)
    for _ in range(30):
        plain -= 1e-4  # the same updates on half params: every one rounds away
    assert plain.item() == 1.0


# ---------------------------------------------------------------- overflow handling


def _fp32_model_with_grad(values):
    p = torch.nn.Parameter(torch.zeros(len(values)))
    return p, torch.tensor(values, dtype=torch.float32)


def test_elementwise_check_has_no_sum_false_positive():
    # Finite grads whose sum overflows float32: apex's Python fallback (float(g.float().sum()) is inf)
    # called this an overflow and skipped the step; the element-wise check does not.
    grad = torch.tensor([3e38, 3e38, -1.0])
    assert math.isinf(float(grad.float().sum()))  # what apex's check computed
    p = torch.nn.Parameter(torch.zeros(3))
    optimizer = FP16_Optimizer(
        torch.optim.SGD([p], lr=1e-39), dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 1.0}, verbose=False
    )
    p.grad = grad.clone()
    optimizer.update_master_grads()
    assert optimizer.overflow is False
    optimizer.step()
    assert torch.isfinite(p).all() and p[0].item() < 0
    # the exported DynamicLossScaler checks element-wise too
    q = torch.nn.Parameter(torch.zeros(3))
    q.grad = grad.clone()
    assert DynamicLossScaler().has_overflow([q]) is False
    assert DynamicLossScaler._has_inf_or_nan(grad) is False
    q.grad[2] = float("nan")
    assert DynamicLossScaler().has_overflow([q]) is True


def test_dynamic_overflow_skips_step_and_backs_off(capsys):
    model = _model()
    optimizer = FP16_Optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**20, "max_loss_scale": 2.0**24},
        verbose=False,
    )
    before = _params(model)
    masters_before = [m.detach().clone() for m in optimizer.fp32_from_fp16_groups[0]]
    x, y = _data()[0]
    loss = _loss(model, x, y) * 1e4  # scaled grads far beyond float16's 65504
    optimizer.backward(loss)
    assert optimizer.overflow is True
    assert optimizer.loss_scale == 2.0**19  # changed inside backward, as in apex
    assert optimizer.clip_master_grads(1.0) == -1
    with pytest.warns(UserWarning, match="inspect_master_grad_data while in an overflow state"):
        assert optimizer.inspect_master_grad_data() is None
    assert optimizer.step() is None
    assert capsys.readouterr().out == "Gradient overflow.  Skipping step, reducing loss scale to 524288.0\n"
    assert _same(before, _params(model))
    assert _same(masters_before, [m.detach() for m in optimizer.fp32_from_fp16_groups[0]])
    # a clean step afterwards clears the flag and steps
    optimizer.zero_grad()
    optimizer.loss_scale = 1.0
    optimizer.backward(_loss(model, x, y))
    assert optimizer.overflow is False
    assert float(optimizer.clip_master_grads(1e9)) > 0
    optimizer.step()
    assert not _same(before, _params(model))


def test_static_scale_never_checks_overflow():
    # apex contract: a static LossScaler never reports an overflow, so non-finite grads are stepped.
    p = torch.nn.Parameter(torch.zeros(2))
    optimizer = FP16_Optimizer(torch.optim.SGD([p], lr=0.1), static_loss_scale=4.0, verbose=False)
    p.grad = torch.tensor([float("inf"), 4.0])
    optimizer.update_master_grads()
    assert optimizer.overflow is False
    optimizer.step()
    assert p[0].item() == -math.inf and p[1].item() == pytest.approx(-0.1)


def test_half_param_without_grad_gets_no_stale_master_grad():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)).half()
    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    optimizer.backward(model(torch.ones(1, 2, dtype=torch.half)).float().sum())
    assert optimizer.fp32_from_fp16_groups[0][0].grad is not None
    model.zero_grad()  # sets the model grads to None; only the second layer gets a grad below
    optimizer.backward(model[1](torch.ones(1, 2, dtype=torch.half)).float().sum())
    assert optimizer.fp32_from_fp16_groups[0][0].grad is None
    assert optimizer.inspect_master_grad_data()[0][0] is None


# ---------------------------------------------------------------- the scale schedules against apex's formulas


def _apex_dynamic_loss_scaler(init, factor, window, overflows):
    """apex fp16_utils.DynamicLossScaler.update_scale, transcribed as a formula."""
    scale, cur_iter, last = init, 0, -1
    out = []
    for overflow in overflows:
        if overflow:
            scale = max(scale / factor, 1)
            last = cur_iter
        elif (cur_iter - last) % window == 0:
            scale *= factor
        cur_iter += 1
        out.append(float(scale))
    return out


def _apex_amp_scaler(init, window, min_scale, max_scale, overflows):
    """apex.amp.scaler.LossScaler.update_scale (dynamic), transcribed as a formula."""
    scale, unskipped = min(max_scale, init), 0
    out = []
    for overflow in overflows:
        if overflow:
            scale = max(min_scale, scale / 2.0) if min_scale else scale / 2.0
            unskipped = 0
        else:
            unskipped += 1
        if unskipped == window:
            scale = min(max_scale, scale * 2.0)
            unskipped = 0
        out.append(scale)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_dynamic_loss_scaler_matches_apex_formula(seed):
    rng = random.Random(seed)
    window = rng.choice([1, 2, 3, 5])
    overflows = [rng.random() < 0.3 for _ in range(200)]
    scaler = DynamicLossScaler(init_scale=2.0**8, scale_window=window)
    got = []
    for o in overflows:
        scaler.update_scale(o)
        got.append(scaler.loss_scale)
    assert got == _apex_dynamic_loss_scaler(2.0**8, 2.0, window, overflows)
    assert min(got) >= 1.0
    assert scaler.cur_iter == 200
    assert scaler.last_overflow_iter == max((i for i, o in enumerate(overflows) if o), default=-1)


def test_dynamic_loss_scaler_defaults_and_floor():
    s = DynamicLossScaler()
    assert (s.loss_scale, s.scale_factor, s.scale_window) == (2.0**32, 2.0, 1000)
    for _ in range(40):
        s.update_scale(True)
    assert s.loss_scale == 1.0
    assert LossScaler().loss_scale == 1 and LossScaler(4).has_overflow([]) is False


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("min_scale", [None, 0.5])
def test_fp16_optimizer_scaler_matches_apex_amp_formula(seed, min_scale):
    rng = random.Random(seed)
    window = rng.choice([1, 2, 3, 5])
    overflows = [rng.random() < (0.3 if seed % 2 else 0.7) for _ in range(150)]
    p = torch.nn.Parameter(torch.zeros(1))
    optimizer = FP16_Optimizer(
        torch.optim.SGD([p], lr=0.0),
        dynamic_loss_scale=True,
        dynamic_loss_args={
            "init_scale": 2.0**30,  # capped at max_loss_scale
            "scale_factor": 3.0,  # accepted and ignored, as in apex
            "scale_window": window,
            "min_loss_scale": min_scale,
            "max_loss_scale": 2.0**6,
        },
        verbose=False,
    )
    assert optimizer.loss_scale == 2.0**6
    got = []
    for o in overflows:
        p.grad = torch.tensor([float("inf") if o else 1.0])
        optimizer.update_master_grads()
        assert optimizer.overflow is o
        got.append(optimizer.loss_scale)
    assert got == _apex_amp_scaler(2.0**30, window, min_scale, 2.0**6, overflows)


# ---------------------------------------------------------------- closures and multiple losses


def test_closure_step_matches_plain_step():
    data = _data(steps=5)

    def run(use_closure):
        model = _model()
        optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=64.0, verbose=False)
        losses = []
        for x, y in data:
            if use_closure:

                def closure(x=x, y=y):
                    optimizer.zero_grad()
                    loss = _loss(model, x, y)
                    optimizer.backward(loss)
                    return loss

                losses.append(optimizer.step(closure).item())
            else:
                optimizer.zero_grad()
                loss = _loss(model, x, y)
                optimizer.backward(loss)
                optimizer.step()
                losses.append(loss.item())
        return losses, _params(model)

    (la, pa), (lb, pb) = run(True), run(False)
    assert la == lb and _same(pa, pb)


def test_closure_with_dynamic_scale_retries_until_finite(capsys):
    model = _model()
    optimizer = FP16_Optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**24},
        verbose=False,
    )
    x, y = _data()[0]
    calls = []

    def closure():
        calls.append(optimizer.loss_scale)
        optimizer.zero_grad()
        loss = _loss(model, x, y) * 100.0
        optimizer.backward(loss)
        return loss

    before = _params(model)
    optimizer.step(closure)
    out = capsys.readouterr().out
    assert len(calls) >= 2 and calls == sorted(calls, reverse=True)
    assert out.count("OVERFLOW within closure! Skipping step, reducing loss scale to") == len(calls) - 1
    assert optimizer.overflow is False and not _same(before, _params(model))
    assert optimizer.first_closure_call_this_step is True


def test_lbfgs_closure_sees_fresh_model_params():
    # LBFGS calls the closure several times per step; each call must see the masters' current values.
    model = _model()
    optimizer = FP16_Optimizer(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5), verbose=False)
    x, y = _data()[0]
    seen = []

    def closure():
        optimizer.zero_grad()
        masters = optimizer.fp32_from_fp16_groups[0]
        seen.append(all(torch.equal(p, m.half()) for p, m in zip(model.parameters(), masters, strict=True)))
        loss = _loss(model, x, y)
        optimizer.backward(loss)
        return loss

    first = optimizer.step(closure).item()
    assert len(seen) > 1 and all(seen)
    assert _loss(model, x, y).item() < first


def test_multiple_losses_delayed_master_grads():
    x, y = _data()[0]

    def losses(model):
        out = model(x.half()).float()
        return torch.nn.functional.mse_loss(out, y), out.abs().mean()

    model = _model()
    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=128.0, verbose=False)
    loss1, loss2 = losses(model)
    optimizer.backward(loss1, update_master_grads=False, retain_graph=True)
    optimizer.backward(loss2, update_master_grads=False)
    optimizer.update_master_grads()
    got = [g.clone() for g in optimizer.inspect_master_grad_data()[0]]
    optimizer.step()

    ref_model = _model()
    l1, l2 = losses(ref_model)
    (l1.float() * 128.0).backward(retain_graph=True)
    (l2.float() * 128.0).backward()
    ref = [p.grad.float() * (1.0 / 128.0) for p in ref_model.parameters()]
    assert _same(got, ref)
    # and it agrees with an fp32 computation of the summed loss
    f32 = _model().float()
    sum(losses_ for losses_ in (torch.nn.functional.mse_loss(f32(x), y), f32(x).abs().mean())).backward()
    for g, p in zip(got, f32.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("dynamic", [False, True])
def test_naive_multiple_backward_calls_are_right_for_fp32_params(dynamic):
    # backward(loss1); backward(loss2) (each updating the master grads) must equal the delayed path,
    # also for the float32 param (apex divided its first grads twice) and when a dynamic scale grows
    # between the two calls (window 1: the scale doubles after every update).
    x, y = _data()[0]

    def losses(model):
        out = model(x)
        return torch.nn.functional.mse_loss(out, y), out.abs().mean()

    def master_grads(naive):
        torch.manual_seed(0)
        model = _Mixed()
        kwargs = (
            {"dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": 2.0**8, "scale_window": 1}}
            if dynamic
            else {"static_loss_scale": 2.0**8}
        )
        optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False, **kwargs)
        loss1, loss2 = losses(model)
        optimizer.backward(loss1, update_master_grads=naive, retain_graph=True)
        optimizer.backward(loss2, update_master_grads=naive)
        if not naive:
            optimizer.update_master_grads()
        optimizer.update_master_grads()  # a repeated call is harmless
        return [g.clone() for g in optimizer.inspect_master_grad_data()[0]], optimizer.loss_scale

    (naive, scale_naive), (delayed, _) = master_grads(True), master_grads(False)
    if dynamic:
        assert scale_naive == 2.0**11  # three updates, three doublings
    assert _same(naive, delayed)
    torch.manual_seed(0)
    ref = _Mixed()
    ref.lin.float()
    out = ref.lin(x) * ref.gain
    (torch.nn.functional.mse_loss(out, y) + out.abs().mean()).backward()
    for g, p in zip(naive, ref.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=2e-2, atol=2e-3)


# ---------------------------------------------------------------- checkpoint and resume


@pytest.mark.parametrize("dynamic", [False, True])
def test_checkpoint_resume_gives_the_same_trajectory(dynamic, tmp_path):
    data = _data(steps=12)
    kwargs = (
        {"dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": 2.0**24, "scale_window": 3}}
        if dynamic
        else {"static_loss_scale": 128.0}
    )

    def make():
        model = _model()
        return model, FP16_Optimizer(torch.optim.Adam(model.parameters(), lr=1e-2), verbose=False, **kwargs)

    def train(model, optimizer, batch):
        history = []
        for x, y in batch:
            optimizer.zero_grad()
            optimizer.backward(_loss(model, x, y) * 50.0)
            optimizer.step()
            history.append((_params(model), optimizer.loss_scale, optimizer.overflow))
        return history

    model, optimizer = make()
    train(model, optimizer, data[:6])
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save(checkpoint, tmp_path / "saved.pth")
    expected = train(model, optimizer, data[6:])
    if dynamic:
        assert any(o for _, _, o in expected) or optimizer.loss_scale < 2.0**24  # the scale did move

    model, optimizer = make()
    checkpoint = torch.load(tmp_path / "saved.pth")  # default weights_only=True must work
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    resumed = train(model, optimizer, data[6:])
    for (pa, sa, oa), (pb, sb, ob) in zip(expected, resumed, strict=True):
        assert _same(pa, pb) and sa == sb and oa == ob


def test_state_dict_layout():
    optimizer = FP16_Optimizer(torch.optim.SGD(_model().parameters(), lr=0.1), dynamic_loss_scale=True, verbose=False)
    sd = optimizer.state_dict()
    assert set(sd) == {
        "loss_scaler",
        "dynamic_loss_scale",
        "overflow",
        "first_closure_call_this_step",
        "optimizer_state_dict",
        "fp32_from_fp16",
    }
    # torch GradScaler's five keys plus apex's fields
    assert sd["loss_scaler"] == {
        "scale": 65536.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "_growth_tracker": 0,
        "dynamic": True,
        "min_loss_scale": None,
        "max_loss_scale": 2.0**24,
    }
    with pytest.raises(TypeError, match="loss_scaler"):
        optimizer.load_state_dict({**sd, "loss_scaler": object()})


def test_serialization_must_go_through_state_dict():
    optimizer = FP16_Optimizer(torch.optim.SGD(_model().parameters(), lr=0.1), verbose=False)
    with pytest.raises(RuntimeError, match=r"FP16_Optimizer should be serialized using state_dict\(\)\."):
        pickle.dumps(optimizer)
    with pytest.raises(RuntimeError, match="serialized using state_dict"):
        copy.deepcopy(optimizer)
    with pytest.raises(RuntimeError, match=r"deserialized using load_state_dict\(\)\."):
        FP16_Optimizer.__setstate__(optimizer, {})


# ---------------------------------------------------------------- construction details


def test_existing_optimizer_state_is_rekeyed_and_recast():
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, D_IN, dtype=torch.half)).float().sum().backward()
    sgd.step()  # momentum buffers in float16, keyed by the half params
    optimizer = FP16_Optimizer(sgd, verbose=False)
    masters = optimizer.fp32_from_fp16_groups[0]
    assert all(m in optimizer.state for m in masters)
    assert all(optimizer.state[m]["momentum_buffer"].dtype == torch.float32 for m in masters)
    assert not any(p in optimizer.state for p in model.parameters())


def test_param_groups_and_frozen_params():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)).half()
    model[1].bias.requires_grad_(False)
    sgd = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.5}], lr=0.1)
    optimizer = FP16_Optimizer(sgd, verbose=False)
    assert [len(g) for g in optimizer.fp16_groups] == [2, 1]
    assert optimizer.param_groups[1]["params"][1] is model[1].bias  # frozen: left alone
    optimizer.param_groups[0]["lr"] = 0.0  # proxied: change the learning rate
    before = _params(model)
    optimizer.backward(model(torch.ones(1, 2, dtype=torch.half)).float().sum())
    optimizer.step()
    after = _params(model)
    assert torch.equal(before[0], after[0]) and not torch.equal(before[2], after[2])


def test_bfloat16_params_get_masters():
    model = torch.nn.Linear(2, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.fill_(1.0)
    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=1e-3), verbose=False)
    for _ in range(10):
        optimizer.zero_grad()
        optimizer.backward(model(torch.ones(1, 2, dtype=torch.bfloat16)).float().sum())
        optimizer.step()
    assert optimizer.fp32_from_fp16_groups[0][0][0, 0].item() == pytest.approx(0.99, rel=1e-6)
    assert model.weight.dtype == torch.bfloat16 and model.weight[0, 0].item() == pytest.approx(0.98828125)


def test_zero_grad_variants():
    model = _model()
    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    optimizer.backward(_loss(model, *_data()[0]))
    optimizer.zero_grad()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    assert all(not m.grad.any() for m in optimizer.fp32_from_fp16_groups[0])
    optimizer.zero_grad(set_grads_to_None=True)
    assert all(p.grad is None for p in model.parameters())
    assert all(m.grad is None for m in optimizer.fp32_from_fp16_groups[0])


def test_argument_errors():
    with pytest.raises(TypeError, match="init_optimizer must be a torch.optim.Optimizer"):
        FP16_Optimizer([torch.zeros(1)])
    p64 = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    with pytest.raises(TypeError, match="Wrapped parameters must be either float32, float16 or bfloat16"):
        FP16_Optimizer(torch.optim.SGD([p64], lr=0.1), verbose=False)
    sgd = torch.optim.SGD(_model().parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"dynamic_loss_args has unknown keys \['window'\]"):
        FP16_Optimizer(sgd, dynamic_loss_scale=True, dynamic_loss_args={"window": 5}, verbose=False)
    with pytest.raises(ValueError, match="static_loss_scale must be a finite number > 0"):
        FP16_Optimizer(torch.optim.SGD(_model().parameters(), lr=0.1), static_loss_scale=0.0, verbose=False)
    with pytest.raises(ValueError, match="growth_interval"):
        FP16_Optimizer(
            torch.optim.SGD(_model().parameters(), lr=0.1),
            dynamic_loss_scale=True,
            dynamic_loss_args={"scale_window": 0},
            verbose=False,
        )
    with pytest.raises(ValueError, match="growth_factor"):
        DynamicLossScaler(scale_factor=1.0)


# ---------------------------------------------------------------- manual master-parameter management


@pytest.mark.parametrize("flat_master", [False, True])
def test_manual_recipe_matches_fp16_optimizer(flat_master):
    data = _data(steps=6)
    scale = 128.0
    model = _model()
    model_params, master_params = prep_param_lists(model, flat_master=flat_master)
    assert len(master_params) == (1 if flat_master else 2)
    opt = torch.optim.SGD(master_params, lr=0.1, momentum=0.9)
    for x, y in data:
        model.zero_grad()
        (_loss(model, x, y) * scale).backward()
        model_grads_to_master_grads(model_params, master_params, flat_master=flat_master)
        for m in master_params:
            m.grad.data.mul_(1.0 / scale)
        opt.step()
        master_params_to_model_params(model_params, master_params, flat_master=flat_master)

    ref_model = _model()
    optimizer = FP16_Optimizer(
        torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9), static_loss_scale=scale, verbose=False
    )
    for x, y in data:
        optimizer.zero_grad()
        optimizer.backward(_loss(ref_model, x, y))
        optimizer.step()
    assert _same(_params(model), _params(ref_model))


def test_model_grads_none_propagates():
    model = _model()
    model_params, master_params = prep_param_lists(model)
    model_grads_to_master_grads(model_params, master_params)
    assert all(m.grad is None for m in master_params)


def test_half_network_helpers():
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    half = network_to_half(copy.deepcopy(net))
    assert isinstance(half[0], fp16_utils.tofp16)
    assert half[1][0].weight.dtype == torch.float16 and half[1][1].weight.dtype == torch.float32
    assert half(torch.randn(5, 3)).dtype == torch.float16
    wrapped = FP16Model(copy.deepcopy(net))
    assert wrapped.network[1].running_mean.dtype == torch.float32
    assert wrapped.network[2].weight.dtype == torch.float16
    assert wrapped(torch.randn(5, 3)).dtype == torch.float16
    bn_plain = torch.nn.BatchNorm1d(2, affine=False).half()
    assert BN_convert_float(bn_plain).running_mean.dtype == torch.float16  # non-affine BN stays half
    assert fp16_utils.to_python_float(torch.tensor([3.0])) == 3.0


# ---------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_matches_hand_written_master_loop_on_cuda():
    data = _data(steps=6, device="cuda")
    got, _ = _fp16_optimizer_run(OPTIMIZERS["adam"], data, device="cuda", static_loss_scale=256.0)
    ref = _reference_run(OPTIMIZERS["adam"], [256.0] * len(data), data, device="cuda")
    for a, b in zip(got, ref, strict=True):
        assert _same(a, b)
    got, opt = _fp16_optimizer_run(
        OPTIMIZERS["adam"], data, device="cuda", dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0**24}
    )
    assert all(torch.isfinite(p).all() for p in got[-1])
