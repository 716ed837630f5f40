"""Benchmark: what ``fmp.plan`` costs, against one training step, as the number of sites grows.

Run ``python bench/plan.py`` from the repository root; it prints one markdown table. The model is a stack of
``L`` residual MLP layers (``D`` wide, ``B`` tokens, each layer's matmul under its own ``jax.named_scope``:
``L`` sites) with a mean-square loss. For each ``L``:

- plan: one ``fmp.plan(loss, params, x, device=...)`` call (``grads=True``, one batch, formats float8,
  bfloat16 and float32, on a device table where float8 pays so every site is measured in both formats), its
  wall time, and how many programs it ran (each site alone per format, then the plan as a whole);
- step: one compiled training step (``jax.value_and_grad`` of the loss under ``mixed_bfloat16`` plus an SGD
  update), its first call (tracing and compilation included) and its warm time (the minimum of ``--repeat``).

Planning runs about ``2L + 1`` compiled programs (eight to a compilation), so its cost grows linearly with
the number of sites and is dominated by compilation on a small model; the ratio to one warm step says how many
steps planning is worth, the ratio to the first step how many compilations.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fmp  # noqa: E402

DEVICE = {"peak": {"float32": 66.9e12, "bfloat16": 989.4e12, "float8": 1978.9e12}, "bandwidth": 1e18}
DEVICE["size_rule"] = False


def model(layers: int):
    def loss(p, x):
        h = x
        for i in range(layers):
            with jax.named_scope(f"layer{i}"):
                h = h + jnp.tanh(h @ p[i])
        return jnp.mean(h**2)

    return loss


def measure(layers: int, dim: int, tokens: int, repeat: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    params = [jnp.asarray(rng.standard_normal((dim, dim)) / np.sqrt(dim), jnp.float32) for _ in range(layers)]
    x = jnp.asarray(rng.standard_normal((tokens, dim)), jnp.float32)
    loss = model(layers)
    policy_loss = fmp.autocast(loss, "mixed_bfloat16")

    @jax.jit
    def step(p, x):
        value, g = jax.value_and_grad(policy_loss)(p, x)
        return jax.tree_util.tree_map(lambda w, d: w - 1e-2 * d, p, g), value

    t = time.perf_counter()
    jax.block_until_ready(step(params, x))
    first = time.perf_counter() - t
    warm = []
    for _ in range(repeat):
        t = time.perf_counter()
        jax.block_until_ready(step(params, x))
        warm.append(time.perf_counter() - t)
    t = time.perf_counter()
    plan = fmp.plan(loss, params, x, device=DEVICE)
    planning = time.perf_counter() - t
    return {"plan": planning, "runs": plan.runs, "first": first, "warm": min(warm)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args()
    print(f"fmp.plan vs one training step (D={args.dim}, B={args.tokens}, grads=True)\n")
    print("| sites | plan (s) | programs run | plan per site (s) | first step (s) | warm step (ms) |"
          " plan / first step | plan / warm step |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for n in args.layers:
        r = measure(n, args.dim, args.tokens, args.repeat)
        print(
            f"| {n} | {r['plan']:.1f} | {r['runs']} | {r['plan'] / n:.2f} | {r['first']:.2f} | "
            f"{r['warm'] * 1e3:.2f} | {r['plan'] / r['first']:.0f}x | {r['plan'] / r['warm']:.0f}x |"
        )


if __name__ == "__main__":
    main()
