"""Runs the scenarios of torch's AMP examples page through an ``amp`` namespace and snapshots every iteration.

``run(TORCH, ...)`` and ``run(FMP, ...)`` execute the same code; the tests compare
their snapshots bit for bit.
"""

from __future__ import annotations

import copy
import types

import torch
from torch import nn

import fmp.torch

TORCH = types.SimpleNamespace(
    name="torch",
    GradScaler=torch.amp.GradScaler,
    autocast=torch.autocast,
    custom_fwd=torch.amp.custom_fwd,
    custom_bwd=torch.amp.custom_bwd,
)
FMP = types.SimpleNamespace(
    name="fmp",
    GradScaler=fmp.torch.GradScaler,
    autocast=fmp.torch.autocast,
    custom_fwd=fmp.torch.custom_fwd,
    custom_bwd=fmp.torch.custom_bwd,
)

SCENARIOS = ("typical", "clipping", "accumulation", "penalty", "multiple", "custom_function")
OPTIMIZERS = ("sgd", "sgd_momentum", "adam_foreach", "adam_fused", "adamw")
# more _step_supports_amp_scaling optimizers, for the slow sweep
EXTRA_OPTIMIZERS = ("sgd_fused", "adamw_fused", "adagrad_fused")


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05)
    if kind == "sgd_momentum":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if kind == "adam_foreach":
        return torch.optim.Adam(params, lr=1e-2, foreach=True)
    if kind == "adam_fused":
        return torch.optim.Adam(params, lr=1e-2, fused=True)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if kind == "sgd_fused":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=True)
    if kind == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-2, fused=True)
    if kind == "adagrad_fused":
        return torch.optim.Adagrad(params, lr=1e-2, fused=True)
    raise ValueError(kind)


def _custom_functions(amp):
    class MyMM(torch.autograd.Function):
        @staticmethod
        @amp.custom_fwd(device_type="cpu")
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a.mm(b)

        @staticmethod
        @amp.custom_bwd(device_type="cpu")
        def backward(ctx, grad):
            a, b = ctx.saved_tensors
            return grad.mm(b.t()), a.t().mm(grad)

    class MyFloat32Func(torch.autograd.Function):
        @staticmethod
        @amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return torch.exp(x) * x

        @staticmethod
        @amp.custom_bwd(device_type="cpu")
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return grad * torch.exp(x) * (1 + x)

    return MyMM.apply, MyFloat32Func.apply


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.is_floating_point():
        return t.clone().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t.clone()


def snapshot(scaler, models, optimizers) -> dict:
    out = {
        "scale": scaler.get_scale(),
        "tracker": scaler._get_growth_tracker(),
        "state_dict": scaler.state_dict(),
        "params": [],
        "grads": [],
        "opt_state": [],
    }
    for model in models:
        for p in model.parameters():
            out["params"].append(_bits(p))
            out["grads"].append(None if p.grad is None else _bits(p.grad))
    for opt in optimizers:
        for state in opt.state.values():
            for key in sorted(state):
                out["opt_state"].append((key, _bits(state[key])))
    return out


def run(
    amp, scenario: str, dtype: torch.dtype, opt_kind: str, *, steps: int = 5, inject=(2,), nan: bool = False, seed=0
):
    """Runs ``steps`` iterations of ``scenario``; injects inf (or NaN) into a grad at ``inject`` steps."""
    scaler = amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    models = [_model(seed)] + ([_model(seed + 1)] if scenario == "multiple" else [])
    optimizers = [make_optimizer(opt_kind, m.parameters()) for m in models]
    mymm, myf32 = _custom_functions(amp)
    torch.manual_seed(seed + 100)
    data = [(torch.randn(6, 8), torch.randn(6, 4)) for _ in range(steps)]
    bad = float("nan") if nan else float("inf")
    loss_fn = nn.functional.mse_loss
    snaps = []
    model, opt = models[0], optimizers[0]

    def inject_if(i):
        if i in inject:
            with torch.no_grad():
                next(models[-1].parameters()).grad[0, 0] = bad

    for i, (x, y) in enumerate(data):
        if scenario == "accumulation":
            with amp.autocast(device_type="cpu", dtype=dtype):
                loss = loss_fn(model(x), y) / 2
            scaler.scale(loss).backward()
            if i % 2 == 1:
                inject_if(i)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
            snaps.append(snapshot(scaler, models, optimizers))
            continue
        for o in optimizers:
            o.zero_grad()
        if scenario in ("typical", "clipping"):
            with amp.autocast(device_type="cpu", dtype=dtype):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            inject_if(i)
            if scenario == "clipping":
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(opt)
        elif scenario == "penalty":
            with amp.autocast(device_type="cpu", dtype=dtype):
                loss = loss_fn(model(x), y)
            scaled = torch.autograd.grad(outputs=scaler.scale(loss), inputs=model.parameters(), create_graph=True)
            inv_scale = 1.0 / scaler.get_scale()
            grads = [g * inv_scale for g in scaled]
            with amp.autocast(device_type="cpu", dtype=dtype):
                norm = 0
                for g in grads:
                    norm = norm + g.pow(2).sum()
                loss = loss + norm.sqrt()
            scaler.scale(loss).backward()
            inject_if(i)
            scaler.step(opt)
        elif scenario == "multiple":
            m0, m1 = models
            with amp.autocast(device_type="cpu", dtype=dtype):
                o0, o1 = m0(x), m1(x)
                loss0 = loss_fn(2 * o0 + 3 * o1, y)
                loss1 = loss_fn(3 * o0 - 5 * o1, y)
            scaler.scale(loss0).backward(retain_graph=True)
            scaler.scale(loss1).backward()
            inject_if(i)
            scaler.unscale_(optimizers[0])
            scaler.step(optimizers[0])
            scaler.step(optimizers[1])
        elif scenario == "custom_function":
            with amp.autocast(device_type="cpu", dtype=dtype):
                h = model[0](x)
                w = model[2].weight
                out = mymm(torch.tanh(h), w.t()) + model[2].bias
                loss = loss_fn(myf32(out), y)
            scaler.scale(loss).backward()
            inject_if(i)
            scaler.step(opt)
        else:
            raise ValueError(scenario)
        scaler.update()
        snaps.append(snapshot(scaler, models, optimizers))
    return snaps


def assert_same(a, b, where=""):
    """Bitwise equality of two snapshots (or lists/dicts of them)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, (where, a.dtype, b.dtype)
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), (where, a, b)
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b) and a == b, (where, a, b)


__all__ = ["EXTRA_OPTIMIZERS", "FMP", "OPTIMIZERS", "SCENARIOS", "TORCH", "assert_same", "copy", "run"]
