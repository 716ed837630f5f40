"""Train step time of a float8 model rewritten by ``fmp.torch.autocast_fx``, against bfloat16 autocast and torchao.

Run from the repository root: ``python bench/torch_float8.py`` (``--quick`` for a smoke run). For an MLP and a
tiny Hugging Face Llama, one train step (forward, backward, SGD step) of: eager ``torch.autocast`` (bfloat16),
``autocast_fx`` (bfloat16), torchao's ``convert_to_float8_training`` (emulated, under bfloat16 autocast) and
``autocast_fx`` with the same torchao recipe, tensorwise and rowwise. The variants run interleaved in one
process (each repeat times every variant once), so load on the machine hits them alike; each figure is the
median over ``--repeats``. Prints one markdown table with the machine, the versions and the load average.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import platform
import statistics
import time
import warnings

import torch
from torch import nn

import fmp
import fmp.torch

BF16 = torch.bfloat16


class _LMLoss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return self.model(input_ids=ids, labels=labels).loss


class _MLPLoss(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x, y):
        return nn.functional.mse_loss(self.net(x).float(), y)


def models(quick: bool):
    """(name, model, example inputs); every Linear has dims divisible by 16 (torchao converts them all)."""
    width, batch = (64, 16) if quick else (256, 128)
    torch.manual_seed(0)
    yield (
        f"MLP ({width}-{4 * width}-{width}, batch {batch})",
        _MLPLoss(width),
        (
            torch.randn(batch, width),
            torch.randn(batch, width),
        ),
    )
    import transformers

    hidden, seq = (32, 16) if quick else (128, 64)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq,
        attn_implementation="eager",
        use_cache=False,
    )
    ids = torch.randint(0, 256, (4, seq))
    yield (
        f"Llama (2 layers, d {hidden}, seq {seq}, batch 4)",
        _LMLoss(transformers.LlamaForCausalLM(config)),
        (ids, ids),
    )


def _autocast(call):
    def run(*args):
        with torch.autocast("cpu", dtype=BF16):
            return call(*args)

    return run


def variants(model: nn.Module, inputs: tuple) -> dict[str, tuple[nn.Module, object]]:
    """name -> (the module whose parameters train, the callable of one forward)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    out = {}
    eager = copy.deepcopy(model)
    out["torch.autocast bf16"] = (eager, _autocast(eager))
    fx = copy.deepcopy(model)
    out["autocast_fx bf16"] = (fx, fmp.torch.autocast_fx(fx, inputs, "mixed_bfloat16"))
    for scaling in ("tensorwise", "rowwise"):
        cfg = dataclasses.replace(Float8LinearConfig.from_recipe_name(scaling), emulate=True)
        ao = convert_to_float8_training(copy.deepcopy(model), config=cfg)
        out[f"torchao {scaling}"] = (ao, _autocast(ao))
        ours = copy.deepcopy(model)
        policy = fmp.Policy("f32", "bf16", "f32", float8=fmp.Float8Recipe.from_peer(f"torchao_{scaling}"))
        out[f"autocast_fx {scaling}"] = (ours, fmp.torch.autocast_fx(ours, inputs, policy))
    return out


def bench(model: nn.Module, inputs: tuple, repeats: int, warmup: int) -> dict[str, float]:
    runs = variants(model, inputs)
    opts = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, (m, _) in runs.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(warmup + repeats):
        for name, (_, call) in runs.items():
            opts[name].zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            call(*inputs).backward()
            opts[name].step()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small models, few repeats (a smoke run)")
    args = parser.parse_args()
    repeats, warmup = (3, 1) if args.quick else (args.repeats, args.warmup)
    warnings.filterwarnings("ignore", message=".*register_constant.*")
    import torchao
    import transformers

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"torch {torch.__version__}, torchao {torchao.__version__}, transformers {transformers.__version__}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, "
        f"load average {load} (at start)"
    )
    print()
    print("| model | step | ms | vs torch.autocast bf16 | vs torchao, same recipe |")
    print("|---|---|---|---|---|")
    for name, model, inputs in models(args.quick):
        t = bench(model, inputs, repeats, warmup)
        base = t["torch.autocast bf16"]
        for variant, ms in t.items():
            scaling = variant.split()[-1]
            vs_ao = (
                f"{ms / t[f'torchao {scaling}']:.2f}"
                if variant.startswith("autocast_fx ") and scaling != "bf16"
                else ""
            )
            print(f"| {name} | {variant} | {ms * 1e3:.2f} | {ms / base:.2f} | {vs_ao} |")
    print(f"\nload average {', '.join(f'{x:.1f}' for x in os.getloadavg())} (at end)")


if __name__ == "__main__":
    main()
