"""Benchmark: what autocast adds to tracing and compiling as a model gets deeper.

Run ``python bench/trace_cost.py`` from the repository root; it prints one markdown table. Model: pre-LN
MLP blocks of width 128 (layernorm, ``gelu(h @ w1 + b1) @ w2 + b2`` with a 4x hidden layer, the residual
add), a batch of 8 rows, one ``jax.jit(jax.value_and_grad(loss)).lower(...)`` and ``.compile()``, timed
from scratch in a fresh process per measurement (nothing cached from an earlier trace). Variants:

* **hand**: bfloat16 cast by hand (every matmul's inputs and its bias in bfloat16, ``gelu`` on that
  bfloat16 value, the result back to float32 for the residual stream), the reference;
* **bf16**: ``fmp.autocast(loss, "mixed_bfloat16")`` on the float32 model;
* **float8**: ``fmp.autocast(loss, "mixed_float8")`` (tensorwise float8 matmuls);
* **scan hand** / **scan bf16**: the same blocks with the layers stacked and run by ``jax.lax.scan``:
  one body whatever the depth, so their times should not grow with it.

The unrolled layers are written out one after another, as flax linen or nnx without ``nn.scan`` and
equinox loops give them to ``jit``. Runs are interleaved (every variant at every depth once per round,
in a fresh process each) and the table gives medians over the rounds; the load average of the machine
is printed before and after.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fmp  # noqa: E402

D, HIDDEN, BATCH = 128, 512, 8
BF16, F32 = jnp.bfloat16, jnp.float32
VARIANTS = ("hand", "bf16", "float8", "scan hand", "scan bf16")
POLICIES = {"bf16": "mixed_bfloat16", "float8": "mixed_float8", "scan bf16": "mixed_bfloat16"}


def init_params(layers: int) -> dict[str, jax.Array]:
    """The blocks' parameters stacked along a leading layer axis."""
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "g": jnp.ones((layers, D)),
        "b": jnp.zeros((layers, D)),
        "w1": jax.random.normal(k1, (layers, D, HIDDEN)) / D**0.5,
        "b1": jnp.zeros((layers, HIDDEN)),
        "w2": jax.random.normal(k2, (layers, HIDDEN, D)) / HIDDEN**0.5,
        "b2": jnp.zeros((layers, D)),
    }


def block(p: dict[str, jax.Array], x: jax.Array, hand: bool) -> jax.Array:
    """One pre-LN MLP block; ``hand=True`` casts its Dense layers to bfloat16 by hand."""
    m = x.mean(-1, keepdims=True)
    h = (x - m) * jax.lax.rsqrt(jnp.square(x - m).mean(-1, keepdims=True) + 1e-5) * p["g"] + p["b"]
    if not hand:
        return x + jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    h = jax.nn.gelu(h.astype(BF16) @ p["w1"].astype(BF16) + p["b1"].astype(BF16))
    return x + (h @ p["w2"].astype(BF16) + p["b2"].astype(BF16)).astype(F32)


def unrolled(hand: bool):
    def loss(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
        for p in params:
            x = block(p, x, hand)
        return jnp.mean(x**2)

    return loss


def scanned(hand: bool):
    def loss(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        x, _ = jax.lax.scan(lambda c, p: (block(p, c, hand), None), x, params)
        return jnp.mean(x**2)

    return loss


def measure(variant: str, layers: int, compile: bool = True) -> tuple[float, float]:
    """``(trace+lower s, compile s)`` of the train step of ``variant`` at ``layers`` blocks (compile: NaN when
    not asked for)."""
    stacked = init_params(layers)
    params = stacked if variant.startswith("scan") else [{k: v[i] for k, v in stacked.items()} for i in range(layers)]
    base = (scanned if variant.startswith("scan") else unrolled)(hand=variant.endswith("hand"))
    loss = base if variant.endswith("hand") else fmp.autocast(base, POLICIES[variant])
    x = jnp.ones((BATCH, D))
    jax.block_until_ready((params, x))
    t0 = time.perf_counter()
    lowered = jax.jit(jax.value_and_grad(loss)).lower(params, x)
    t1 = time.perf_counter()
    if not compile:
        return t1 - t0, float("nan")
    lowered.compile()
    return t1 - t0, time.perf_counter() - t1


def _load() -> str:
    return Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"


def _cpu() -> str:
    info = Path("/proc/cpuinfo")
    if info.exists():
        for line in info.read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    return platform.processor() or "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 32, 128, 256, 512])
    ap.add_argument("--rounds", type=int, default=3, help="fresh processes per variant and depth (median)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--compile-up-to", type=int, default=1 << 30, help="time compile only up to this depth")
    ap.add_argument("--one", nargs=3, metavar=("VARIANT", "LAYERS", "COMPILE"), help=argparse.SUPPRESS)  # a child
    args = ap.parse_args()
    if args.one:
        print("{:.6f} {:.6f}".format(*measure(args.one[0], int(args.one[1]), args.one[2] == "1")))
        return
    times: dict[tuple[str, int], list[tuple[float, float]]] = {}
    load_before, started = _load(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for _ in range(args.rounds):
        for layers in args.layers:
            for variant in args.variants:
                cmd = [sys.executable, __file__, "--one", variant, str(layers), str(int(layers <= args.compile_up_to))]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()
                times.setdefault((variant, layers), []).append((float(out[-2]), float(out[-1])))
    print(
        f"{_cpu()}; Python {platform.python_version()}, jax {jax.__version__}; {started}; "
        f"load average {load_before} before, {_load()} after; median of {args.rounds} fresh processes; "
        f"compile timed up to {min(args.compile_up_to, max(args.layers))} layers"
    )
    med = {k: (statistics.median(t for t, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}
    head = ["layers"]
    for what, i in (("trace+lower", 0), ("compile", 1)):
        head += [f"{v} {what} s" for v in args.variants]
        if "hand" in args.variants and "bf16" in args.variants:
            head.append(f"bf16/hand {what}")
        if "bf16" in args.variants and "float8" in args.variants and i == 0:
            head.append("float8/bf16 trace+lower")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for layers in args.layers:
        row = [str(layers)]
        for i in (0, 1):
            row += [f"{med[v, layers][i]:.3g}" for v in args.variants]
            if "hand" in args.variants and "bf16" in args.variants:
                row.append(f"{med['bf16', layers][i] / med['hand', layers][i]:.2f}")
            if "bf16" in args.variants and "float8" in args.variants and i == 0:
                row.append(f"{med['float8', layers][0] / med['bf16', layers][0]:.2f}")
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
