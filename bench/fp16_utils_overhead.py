"""fmp.torch.fp16_utils overheads on this machine (CPU unless --device cuda).

Prints two tables:

1. the overflow check over a list of gradients: apex's Python fallback (``float(g.float().sum())`` per
   tensor, one host sync each) vs fmp's element-wise ``_amp_foreach_non_finite_check_and_unscale_`` (check
   and unscale in one pass, one host sync);
2. one training step of a small MLP: a float32 model with a plain optimizer, a hand-written fp16
   master-weights loop (apex's recipe), and FP16_Optimizer with a static and a dynamic scale.

    python bench/fp16_utils_overhead.py [--device cpu] [--repeats 20]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from fmp.torch.fp16_utils import FP16_Optimizer
from fmp.torch.fp16_utils._loss_scaler import _any_found, non_finite_check


def _time(fn, repeats, sync):
    fn()
    sync()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def _apex_sum_check(grads, inv):
    for g in grads:
        s = float(g.float().sum())
        if s in (float("inf"), -float("inf")) or s != s:
            return True
        g.mul_(inv)
    return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    print(
        f"torch {torch.__version__}, device {dev}, {platform.processor() or platform.machine()}, "
        f"threads {torch.get_num_threads()}"
    )

    print("\n| grads | apex sum check (ms) | fmp element-wise (ms) | ratio |")
    print("|---|---|---|---|")
    for n, size in [(20, 10_000), (20, 1_000_000), (200, 10_000)]:
        grads = [torch.randn(size, device=dev) for _ in range(n)]
        a = _time(lambda grads=grads: _apex_sum_check(grads, 1.0), args.repeats, sync)
        b = _time(lambda grads=grads: _any_found(non_finite_check(grads, 1.0)), args.repeats, sync)
        print(f"| {n} x {size:,} fp32 | {a * 1e3:.3f} | {b * 1e3:.3f} | {a / b:.2f}x |")

    torch.manual_seed(0)
    x = torch.randn(64, 256, device=dev)
    y = torch.randn(64, 256, device=dev)

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)).to(dev)

    results = {}
    model32 = mlp()
    opt32 = torch.optim.Adam(model32.parameters(), lr=1e-4)

    def step_fp32():
        opt32.zero_grad()
        torch.nn.functional.mse_loss(model32(x), y).backward()
        opt32.step()

    results["float32 model + Adam"] = _time(step_fp32, args.repeats, sync)

    model16 = mlp().half()
    half = list(model16.parameters())
    masters = [p.detach().clone().float().requires_grad_(True) for p in half]
    opt_ref = torch.optim.Adam(masters, lr=1e-4)

    def step_manual():
        for p in half:
            p.grad = None
        (torch.nn.functional.mse_loss(model16(x.half()).float(), y) * 128.0).backward()
        for p, m in zip(half, masters, strict=True):
            m.grad = p.grad.float().mul_(1.0 / 128.0)
        opt_ref.step()
        with torch.no_grad():
            for p, m in zip(half, masters, strict=True):
                p.copy_(m)

    results["fp16 model, hand-written master loop"] = _time(step_manual, args.repeats, sync)

    for name, kwargs in [("static", {"static_loss_scale": 128.0}), ("dynamic", {"dynamic_loss_scale": True})]:
        model = mlp().half()
        opt = FP16_Optimizer(torch.optim.Adam(model.parameters(), lr=1e-4), verbose=False, **kwargs)

        def step(model=model, opt=opt):
            opt.zero_grad(set_grads_to_None=True)
            opt.backward(torch.nn.functional.mse_loss(model(x.half()).float(), y))
            opt.step()

        results[f"fp16 model, FP16_Optimizer ({name})"] = _time(step, args.repeats, sync)

    base = results["fp16 model, hand-written master loop"]
    print("\n| MLP 256-512-256, batch 64, Adam | ms/step | vs hand-written loop |")
    print("|---|---|---|")
    for name, t in results.items():
        print(f"| {name} | {t * 1e3:.2f} | {t / base:.2f}x |")


if __name__ == "__main__":
    main()
