"""fmp.torch vs torch.amp on CPU: GradScaler step+update, and autocast forward+backward.

Run from the repository root:  python bench/torch_scaler.py [--repeats N]

Prints one markdown table. Timings are medians over interleaved rounds in one process (the GradScaler rows
alternate which side runs first), so machine noise hits both sides alike.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fmp  # noqa: E402
import fmp.torch  # noqa: E402

_clock = time.perf_counter


def _mlp(width: int, depth: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def bench_scaler(repeats: int, opt_kind: str, width: int = 2048) -> tuple[float, float, int]:
    model = _mlp(width, 6)
    n_params = sum(p.numel() for p in model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    saved = [p.grad.clone() for p in model.parameters()]
    if opt_kind == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-6, fused=True)
    scalers = {
        "torch": torch.amp.GradScaler("cpu", growth_interval=10**9),
        "fmp": fmp.torch.GradScaler("cpu", growth_interval=10**9),
    }
    for s in scalers.values():
        s.scale(torch.ones(()))
    times: dict[str, list[float]] = {k: [] for k in scalers}
    for i in range(repeats + 2):
        # alternate which side runs first in a round, so neither always inherits the other's cache state
        order = list(scalers.items()) if i % 2 == 0 else list(scalers.items())[::-1]
        for name, scaler in order:
            with torch.no_grad():
                for p, g in zip(model.parameters(), saved, strict=True):
                    p.grad.copy_(g)
            t0 = _clock()
            scaler.step(opt)
            scaler.update()
            dt = _clock() - t0
            if i >= 2:  # warm-up rounds
                times[name].append(dt)
    return _summary(times), n_params


def bench_autocast(repeats: int, dtype: torch.dtype, custom: bool) -> tuple[float, float]:
    model = _mlp(512, 4)
    x = torch.randn(64, 512)
    rules = fmp.DEFAULT_RULES.derive(framework="torch", lower_precision=["aten::relu"]) if custom else None

    def run(ctx):
        model.zero_grad(set_to_none=True)
        t0 = _clock()
        with ctx:
            loss = model(x).float().pow(2).mean()
        loss.backward()
        return _clock() - t0

    times: dict[str, list[float]] = {"torch": [], "fmp": []}
    for i in range(repeats + 2):
        a = run(torch.autocast("cpu", dtype=dtype))
        b = run(fmp.torch.autocast("cpu", dtype=dtype, rules=rules))
        if i >= 2:
            times["torch"].append(a)
            times["fmp"].append(b)
    return _summary(times)


def bench_region(repeats: int) -> tuple[float, float, float]:
    """Cost of entering and leaving an empty autocast region (the facade's fixed overhead)."""
    times: dict[str, list[float]] = {"torch": [], "fmp": []}
    for _ in range(repeats):
        for name, ac in (("torch", torch.autocast), ("fmp", fmp.torch.autocast)):
            t0 = _clock()
            for _ in range(200):
                with ac("cpu", dtype=torch.bfloat16):
                    pass
            times[name].append((_clock() - t0) / 200)
    return _summary(times)


def _summary(times: dict[str, list[float]]) -> tuple[float, float, float]:
    """(torch median, fmp median, ratio of the minimums): the minimum is the least noisy cost estimate."""
    return statistics.median(times["torch"]), statistics.median(times["fmp"]), min(times["fmp"]) / min(times["torch"])


def _row(name: str, summary: tuple[float, float, float], target: str, digits: int = 2) -> str:
    t, f, min_ratio = summary
    return f"| {name} | {t * 1e3:.{digits}f} | {f * 1e3:.{digits}f} | {f / t:.3f}x | {min_ratio:.3f}x | {target} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: time.perf_counter; cpu: time.process_time (this process's CPU time, all threads; "
        "robust on a machine shared with other jobs)",
    )
    args = parser.parse_args()
    global _clock
    _clock = time.perf_counter if args.clock == "wall" else time.process_time
    print(
        f"torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}, "
        f"{torch.get_num_threads()} threads, {args.clock} clock, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    print()
    print(
        "| benchmark | torch.amp median (ms) | fmp.torch median (ms) | ratio of medians | ratio of minimums | target |"
    )
    print("|---|---|---|---|---|---|")
    for opt_kind in ("sgd", "adam_fused"):
        summary, n = bench_scaler(args.repeats, opt_kind)
        print(_row(f"GradScaler step+update, {n / 1e6:.1f}M params, {opt_kind}", summary, "<= 1.05x"))
    summary, n = bench_scaler(args.repeats * 20, "sgd", width=4)
    print(_row(f"GradScaler step+update, {n} params, sgd (fixed per-call overhead)", summary, "(none)", digits=3))
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        summary = bench_autocast(args.repeats, dtype, custom=False)
        print(_row(f"autocast fwd+bwd, 1.1M-param MLP, batch 64, {name}, default rules", summary, "<= 1.05x"))
    print(_row("autocast enter+exit of an empty region (fixed per-region overhead)", bench_region(50), "(none)", 4))
    summary = bench_autocast(args.repeats, torch.bfloat16, custom=True)
    print(_row("autocast fwd+bwd, same, bf16, custom rules (torch-function mode)", summary, "(none)"))


if __name__ == "__main__":
    main()
