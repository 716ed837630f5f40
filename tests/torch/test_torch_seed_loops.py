"""The examples page's loops, written for CUDA, run unchanged with ``import fmp.torch as amp``.

On this CPU-only torch the CUDA GradScaler and autocast warn and turn themselves off
(torch's behaviour); the loop still trains, exactly as with torch.amp.
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

import fmp.torch  # noqa: E402


def _typical_loop(amp):
    # the "Typical Mixed Precision Training" sample, device names as written there
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = torch.nn.functional.mse_loss
    data = [(torch.randn(3, 4), torch.randn(3, 2)) for _ in range(3)]
    scaler = amp.GradScaler()
    for input, target in data:
        optimizer.zero_grad()
        with amp.autocast(device_type="cuda", dtype=torch.float16):
            output = model(input)
            loss = loss_fn(output, target)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return model.weight.detach(), scaler.get_scale()


def test_typical_cuda_loop_runs_unchanged():
    if torch.cuda.is_available():
        pytest.skip("expects a CPU-only torch")
    out = []
    for amp in (torch.amp, fmp.torch):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            weight, scale = _typical_loop(amp)
        out.append((weight, scale, sorted({str(x.message) for x in w})))
    assert torch.equal(out[0][0], out[1][0]) and out[0][1] == out[1][1] == 1.0
    assert out[0][2] == out[1][2] and len(out[0][2]) == 2
