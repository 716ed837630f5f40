"""Fault injection for the torch ways to train: the facade (GradScaler + autocast), its accumulation loop, and
``FP16_Optimizer``.

As in ``_reliability_jax``: the system under test (SUT) runs with seeded faults; the reference runs the same
code with clean inputs on the steps that were not injected and only backs the scale off on injected ones.
Same program, same inputs on taken steps, so the comparison is bitwise. The facade paths are also run through
``torch.amp`` with the same faults and compared bit for bit after every step.

Faults: ``grad`` sets one element of one parameter's ``.grad`` to ±inf or NaN after ``backward`` (before
``step``; for ``FP16_Optimizer`` before ``update_master_grads``); ``loss`` multiplies the loss by inf or NaN.
"""

from __future__ import annotations

import contextlib
import io

import numpy as np
import torch
from _reliability_jax import Counts
from torch import nn

import fmp.torch
from fmp.torch.fp16_utils import FP16_Optimizer

TORCH_PATHS = ("torch_facade", "torch_accumulate", "fp16_optimizer")
TORCH_KINDS = ("grad_inf", "grad_nan", "loss_inf", "loss_nan")
ACCUMULATE_K = 4


def _tbits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _model(half: bool = False) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    return m.half() if half else m


class _Run:
    """One training run: model, optimizer, scaler, and one step (or micro-step) with an optional fault."""

    def __init__(self, path: str, amp=None):
        self.path = path
        self.amp = amp
        if path == "fp16_optimizer":
            self.model = _model(half=True)
            inner = torch.optim.Adam(self.model.parameters(), lr=1e-2)
            self.opt = FP16_Optimizer(
                inner,
                dynamic_loss_scale=True,
                dynamic_loss_args={"init_scale": 2.0**12, "scale_window": 8},
                verbose=False,
            )
            return
        self.model = _model()
        if path == "torch_facade":
            self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        else:
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.scaler = amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=8)

    # -- state -------------------------------------------------------------------------------------------------
    def scale(self) -> float:
        if self.path == "fp16_optimizer":
            return float(self.opt.loss_scale)
        return float(self.scaler.get_scale())

    def protected(self) -> list[bytes]:
        """Params and optimizer state (and the float32 masters): what a skipped step must leave alone."""
        out = [_tbits(p) for p in self.model.parameters()]
        opt = self.opt.optimizer if self.path == "fp16_optimizer" else self.opt
        for group in opt.param_groups:
            for p in group["params"]:
                out.append(_tbits(p))  # the masters, for FP16_Optimizer (the model params otherwise, again)
                state = opt.state.get(p, {})
                out.extend(_tbits(state[k]) for k in sorted(state) if isinstance(state[k], torch.Tensor))
        return out

    def back_off(self) -> None:
        """The reference's skip: the scale times the backoff factor, the growth tracker reset."""
        target = self.opt.loss_scaler if self.path == "fp16_optimizer" else self.scaler
        sd = target.state_dict()
        sd["scale"] = sd["scale"] * sd["backoff_factor"]
        sd["_growth_tracker"] = 0
        target.load_state_dict(sd)

    # -- one (micro-)step ----------------------------------------------------------------------------------------
    def _inject(self, params: list[torch.Tensor], fault) -> None:
        _, pi, fi, value = fault
        with torch.no_grad():
            params[pi].grad.view(-1)[fi] = value

    def step(self, i: int, x: torch.Tensor, y: torch.Tensor, fault) -> bool:
        """Runs step ``i``; returns True if it ended an optimizer step (always, except accumulation micro-steps)."""
        factor = 1.0
        if fault is not None and fault[0].startswith("loss"):
            factor = fault[3]
        grad_fault = fault if fault is not None and fault[0].startswith("grad") else None
        params = list(self.model.parameters())
        if self.path == "fp16_optimizer":
            self.opt.zero_grad()
            loss = nn.functional.mse_loss(self.model(x.half()).float(), y) * factor
            self.opt.backward(loss, update_master_grads=False)
            if grad_fault:
                self._inject(params, grad_fault)
            self.opt.update_master_grads()
            with contextlib.redirect_stdout(io.StringIO()):  # "Gradient overflow.  Skipping step ..."
                self.opt.step()
            return True
        amp = self.amp
        if self.path == "torch_facade":
            self.opt.zero_grad()
            with amp.autocast(device_type="cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(self.model(x), y)
            self.scaler.scale(loss * factor).backward()
            if grad_fault:
                self._inject(params, grad_fault)
            self.scaler.step(self.opt)
            self.scaler.update()
            return True
        # the seeds' accumulation loop
        with amp.autocast(device_type="cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(self.model(x), y)
            loss = loss / ACCUMULATE_K
        self.scaler.scale(loss * factor).backward()
        if grad_fault:
            self._inject(params, grad_fault)
        if (i + 1) % ACCUMULATE_K == 0:
            self.scaler.step(self.opt)
            self.scaler.update()
            self.opt.zero_grad()
            return True
        return False


def _fault(run: _Run, kind: str, rng: np.random.Generator):
    value = float("inf") if kind.endswith("inf") else float("nan")
    if rng.random() < 0.5:
        value = -value
    params = list(run.model.parameters())
    pi = int(rng.integers(len(params)))
    fi = int(rng.integers(params[pi].numel()))
    return (kind, pi, fi, value)


def run_path(name: str, steps: int, seed: int, p_fault: float = 0.1, compare_torch_amp: bool = True) -> Counts:
    """Runs ``steps`` (micro-)steps of ``name`` with seeded faults; returns the counts."""
    k = ACCUMULATE_K if name == "torch_accumulate" else 1
    steps -= steps % k
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    xs = torch.randn(steps, 16, 8, generator=gen)
    ys = torch.tanh(xs @ torch.randn(8, 4, generator=gen))
    facade = name != "fp16_optimizer"
    sut = _Run(name, fmp.torch)
    ref = _Run(name, fmp.torch)
    twin = _Run(name, torch.amp) if facade and compare_torch_amp else None  # torch.amp, same faults
    counts = Counts(name)
    window_bad = False
    window_start = sut.protected()
    window_faults: list = []
    for i in range(steps):
        kind = TORCH_KINDS[rng.integers(len(TORCH_KINDS))] if rng.random() < p_fault else None
        fault = None if kind is None else _fault(sut, kind, rng)
        if fault is not None:
            counts.injected += 1
            counts.injected_by_kind[kind] += 1
            window_bad = True
        window_faults.append(fault)
        scale_before = sut.scale()
        before = sut.protected()
        ended = sut.step(i, xs[i], ys[i], fault)
        if twin is not None:
            twin.step(i, xs[i], ys[i], fault)
        counts.steps += 1
        counts.checks += 1
        if not ended:
            if sut.protected() != before or sut.scale() != scale_before:
                counts.fail(i, "a micro-step changed params, optimizer state or scale")
            continue
        skipped = sut.opt.overflow if name == "fp16_optimizer" else sut.scale() < scale_before
        # reference: clean steps on clean windows, a bare back-off on bad ones
        if window_bad:
            ref.back_off()
        else:
            for j in range(i - k + 1, i + 1):
                ref.step(j, xs[j], ys[j], None)
        if skipped:
            counts.skipped += 1
            counts.expected_skips += int(window_bad)
            if sut.protected() != window_start:
                counts.fail(i, "a skipped step changed params or optimizer state")
        elif window_bad:
            counts.fail(i, f"injected faults {window_faults} were not skipped")
        if sut.protected() != ref.protected():
            counts.fail(i, "params or optimizer state differ from the reference")
        if sut.scale() != ref.scale():
            counts.fail(i, f"scale {sut.scale()} differs from the reference's {ref.scale()}")
        if twin is not None and (sut.protected() != twin.protected() or sut.scale() != twin.scale()):
            counts.fail(i, "differs from torch.amp with the same faults")
        if not all(bool(torch.isfinite(p).all()) for p in sut.model.parameters()):
            counts.fail(i, "non-finite params")
        window_bad, window_faults = False, []
        window_start = sut.protected()
    return counts
