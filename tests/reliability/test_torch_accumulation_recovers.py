"""The examples page's accumulation loop through ``fmp.torch.GradScaler`` recovers from a bad micro-batch, bit for
bit like ``torch.amp.GradScaler``: the bad effective batch is skipped, the scale backs off once, the next trains."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import fmp.torch  # noqa: E402

K = 4  # iters_to_accumulate


def _bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def _loop(amp, bad_at: int, bad: float):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.functional.mse_loss
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)) for _ in range(4 * K)]
    scaler = amp.GradScaler("cpu", init_scale=2.0**10)
    trace = []
    for i, (input, target) in enumerate(data):
        with amp.autocast(device_type="cpu", dtype=torch.bfloat16):
            output = model(input)
            loss = loss_fn(output, target)
            loss = loss / K
        if i == bad_at:
            loss = loss * bad  # a bad micro-batch: every gradient of the window becomes inf/NaN
        scaler.scale(loss).backward()
        if (i + 1) % K == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        params = [_bits(p) for p in model.parameters()]
        momenta = [_bits(s["momentum_buffer"]) for s in optimizer.state.values()]
        trace.append((scaler.get_scale(), params, momenta))
    return trace


@pytest.mark.parametrize(("bad_at", "bad"), [(K + 1, float("inf")), (K + 3, float("nan"))])
def test_seed_accumulation_loop_recovers_like_torch(bad_at, bad):
    ours, theirs = _loop(fmp.torch, bad_at, bad), _loop(torch.amp, bad_at, bad)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a[0] == b[0], i
        assert all(torch.equal(x, y) for x, y in zip(a[1] + a[2], b[1] + b[2], strict=True)), i
    scales = [ours[w * K + K - 1][0] for w in range(4)]
    assert scales == [1024.0, 512.0, 512.0, 512.0]  # one back-off, for the bad effective batch only
    end = [ours[w * K + K - 1][1] for w in range(4)]
    same = [all(torch.equal(x, y) for x, y in zip(end[w], end[w - 1], strict=True)) for w in (1, 2, 3)]
    assert same == [True, False, False]  # window 1 skipped (params untouched), windows 2 and 3 train
    assert all(torch.isfinite(p.view(torch.float32)).all() for p in end[3])
