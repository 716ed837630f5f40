"""The torch facade under threads: per-thread autocast state and scalers give the results of a sequential run."""

from __future__ import annotations

import math
import threading

import pytest

torch = pytest.importorskip("torch")

import fmp  # noqa: E402
import fmp.torch  # noqa: E402

# thread id -> (autocast dtype or None, custom rules?, GradScaler growth_interval)
CONFIGS = [
    (torch.bfloat16, False, 2),
    (torch.float16, False, 3),
    (torch.bfloat16, True, 2),
    (None, False, 1),  # no autocast at all
]
STEPS = 12
_RULES = fmp.DEFAULT_RULES.derive(framework="torch", unlisted=["aten::matmul"])


def _train(index: int, barrier: threading.Barrier | None = None) -> dict:
    """A small loop: linear -> tanh -> linear under this thread's autocast, fmp.torch.GradScaler, SGD.

    Every 5th step injects a NaN into the loss, so scalers back off at different times in different threads.
    """
    dtype, custom, interval = CONFIGS[index]
    gen = torch.Generator().manual_seed(100 + index)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = fmp.torch.GradScaler("cpu", init_scale=2.0**8, growth_interval=interval)
    x = torch.randn(32, 8, generator=gen)
    y = torch.randn(32, 1, generator=gen)
    trace = []
    for step in range(STEPS):
        if barrier is not None:
            barrier.wait()  # every thread is inside its loop at the same time, step by step
        opt.zero_grad()
        ctx = fmp.torch.autocast("cpu", dtype=dtype, enabled=dtype is not None, rules=_RULES if custom else None)
        with ctx:
            hidden = model[1](model[0](x))
            out = model[2](hidden)
            seen = (torch.is_autocast_enabled("cpu"), hidden.dtype)
            loss = torch.nn.functional.mse_loss(out.float(), y)
        if step % 5 == 4:
            loss = loss * math.nan
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        trace.append((seen, loss.item(), scaler.get_scale(), scaler.state_dict()["_growth_tracker"]))
    params = [p.detach().clone() for p in model.parameters()]
    return {"trace": trace, "params": params}


def _same(a: dict, b: dict) -> bool:
    if str(a["trace"]) != str(b["trace"]):  # str: NaN losses compare equal as text
        return False
    return all(
        x.dtype == y.dtype and torch.equal(x.view(torch.int32), y.view(torch.int32))
        for x, y in zip(a["params"], b["params"], strict=True)
    )


def test_threads_give_the_sequential_results_bitwise():
    sequential = [_train(i) for i in range(len(CONFIGS))]
    # the configurations differ, so a leak of one thread's autocast into another would change its result
    assert sequential[0]["trace"][0][0] == (True, torch.bfloat16)
    assert sequential[1]["trace"][0][0] == (True, torch.float16)
    # custom rules: a torch-function mode casts linear; torch's own autocast flag is off in such a region
    assert sequential[2]["trace"][0][0] == (False, torch.bfloat16)
    assert sequential[3]["trace"][0][0] == (False, torch.float32)
    results: list[dict | None] = [None] * len(CONFIGS)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(CONFIGS))

    def run(i: int) -> None:
        try:
            results[i] = _train(i, barrier)
        except BaseException as exc:  # reported below, not swallowed
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(CONFIGS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for i, (seq, par) in enumerate(zip(sequential, results, strict=True)):
        assert par is not None and _same(seq, par), f"thread {i} differs from its sequential run"


def test_autocast_state_does_not_leak_between_threads():
    inside = threading.Event()
    checked = threading.Event()
    seen: dict[str, object] = {}
    a = torch.ones(4, 4)

    def holder() -> None:
        with fmp.torch.autocast("cpu", dtype=torch.bfloat16):
            seen["holder"] = (torch.is_autocast_enabled("cpu"), (a @ a).dtype)
            inside.set()
            checked.wait(timeout=30)
            # the other thread's region (custom rules, then none) did not change ours
            seen["holder_after"] = (torch.is_autocast_enabled("cpu"), (a @ a).dtype)

    def other() -> None:
        inside.wait(timeout=30)
        seen["other"] = (torch.is_autocast_enabled("cpu"), (a @ a).dtype)
        with fmp.torch.autocast("cpu", dtype=torch.bfloat16, rules=_RULES):
            seen["other_custom"] = (a @ a).dtype, torch.nn.functional.linear(a, a).dtype
        checked.set()

    threads = [threading.Thread(target=holder), threading.Thread(target=other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert seen["holder"] == (True, torch.bfloat16)
    assert seen["other"] == (False, torch.float32)  # a new thread starts outside every region
    assert seen["other_custom"] == (torch.float32, torch.bfloat16)  # its own rules: matmul unlisted, linear cast
    assert seen["holder_after"] == (True, torch.bfloat16)
    # and the main thread saw none of it
    assert not torch.is_autocast_enabled("cpu") and (a @ a).dtype == torch.float32
