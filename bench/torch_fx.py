"""Forward+backward time: ``fmp.torch.autocast_fx`` module vs eager ``torch.autocast``.

Run from the repository root: ``python bench/torch_fx.py`` (``--quick`` for a smoke run).
Prints one markdown table; each figure is the median of ``--repeats`` timed steps
after warm-up, interleaving the two variants so machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fmp.torch


class MLPLoss(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(width, 4 * width), nn.LayerNorm(4 * width), nn.GELU(), nn.Linear(4 * width, 10)
        )

    def forward(self, x, target):
        return nn.functional.cross_entropy(self.net(x), target)


def models(quick: bool):
    batch = 2 if quick else 8
    layer = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
    yield (
        "TransformerEncoder (2x d64, seq 32)",
        nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
        (torch.randn(batch, 32, 64),),
    )
    cnn = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(64 * 16, 10),
    )
    yield "CNN + BatchNorm (16x16 images)", cnn, (torch.randn(batch, 3, 16, 16),)
    yield (
        "MLP + LayerNorm + CE (width 128)",
        MLPLoss(128),
        (torch.randn(4 * batch, 128), torch.randint(0, 10, (4 * batch,))),
    )


def step(call, inputs):
    out = call(*inputs)
    loss = out if out.dim() == 0 else out.float().square().mean()
    loss.backward()


class _Count(TorchDispatchMode):
    """Counts ATen calls below autograd (a noise-free measure of the work a step does)."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        self.casts += func is torch.ops.aten._to_copy.default
        return func(*args, **(kwargs or {}))


def count(model, call, inputs):
    model.zero_grad(set_to_none=True)
    with _Count() as counter:
        step(call, inputs)
    return counter.calls, counter.casts


def bench(model, inputs, dtype, repeats, warmup):
    gm = fmp.torch.autocast_fx(model, inputs, ("cpu", dtype))

    def eager(*args):
        with torch.autocast("cpu", dtype=dtype):
            return model(*args)

    times = {"eager": [], "fx": []}
    for i in range(warmup + repeats):
        for name, call in (("eager", eager), ("fx", gm)):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            step(call, inputs)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    ops = (count(model, eager, inputs), count(model, gm, inputs))
    return statistics.median(times["eager"]), statistics.median(times["fx"]), ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small inputs, few repeats (a smoke run)")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats, warmup = (3, 1) if args.quick else (args.repeats, args.warmup)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    print()
    print("| model | dtype | eager autocast (ms) | autocast_fx (ms) | fx / eager | ATen calls (casts) eager / fx |")
    print("|---|---|---|---|---|---|")
    for name, model, inputs in models(args.quick):
        for dtype in (torch.bfloat16, torch.float16):
            eager, fx, ((n_e, c_e), (n_f, c_f)) = bench(model, inputs, dtype, repeats, warmup)
            short = str(dtype).removeprefix("torch.")
            calls = f"{n_e} ({c_e}) / {n_f} ({c_f})"
            print(f"| {name} | {short} | {eager * 1e3:.2f} | {fx * 1e3:.2f} | {fx / eager:.2f} | {calls} |")


if __name__ == "__main__":
    main()
