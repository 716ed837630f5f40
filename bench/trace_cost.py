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

A Dense layer's bias is added to its product before the residual add, ``x + (h @ w2 + b2)``, as in a
flax or equinox block. Written ``x + h @ w2 + b2`` instead, the float32 program itself compiles about 2.7x
slower at 8 layers (and worse deeper): XLA fuses the residual stream's adds into every later layer's
layernorm, and the second add per layer makes that chain twice as long; autocast keeps the program's
association, so it then compiles like the float32 program, not like a hand-cast one written the other way.

The unrolled layers are written out one after another, as flax linen or nnx without ``nn.scan`` and
equinox loops give them to ``jit``. Runs are interleaved (every variant at every depth once per round,
in a fresh process each, the variants' order reversed every other round, since the process that runs
first after another is measurably slower or faster on a shared machine); times are medians over the
rounds, and a ratio is the median of the rounds' own ratios (the two variants measured side by side, so
a change of the machine's load between rounds cancels) with its range. The load average of the machine
is printed before and after. Trace+lower is given in the process's CPU time (on a shared machine the wall
time also counts the time other jobs hold the cores) with the wall-time ratio beside it; compile in wall
time, by default up to 32 layers. ``--compile-up-to`` and ``--float8-up-to`` bound the depths those are
timed at.
"""

from __future__ import annotations

import argparse
import json
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
    if not hand:  # each Dense layer's bias is added to its own product, then the residual (as flax's Dense)
        return x + (jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"])
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


def measure(variant: str, layers: int, compile: bool = True) -> tuple[float, float, float]:
    """``(trace+lower wall s, trace+lower CPU s, compile wall s)`` of the train step of ``variant`` at
    ``layers`` blocks (compile: NaN when not asked for). CPU time is the process's own: on a shared machine
    the wall time also counts the time other jobs hold the cores."""
    stacked = init_params(layers)
    params = stacked if variant.startswith("scan") else [{k: v[i] for k, v in stacked.items()} for i in range(layers)]
    base = (scanned if variant.startswith("scan") else unrolled)(hand=variant.endswith("hand"))
    loss = base if variant.endswith("hand") else fmp.autocast(base, POLICIES[variant])
    x = jnp.ones((BATCH, D))
    jax.block_until_ready((params, x))
    t0, c0 = time.perf_counter(), time.process_time()
    lowered = jax.jit(jax.value_and_grad(loss)).lower(params, x)
    t1, c1 = time.perf_counter(), time.process_time()
    if not compile:
        return t1 - t0, c1 - c0, float("nan")
    lowered.compile()
    return t1 - t0, c1 - c0, time.perf_counter() - t1


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
    ap.add_argument("--rounds", type=int, default=5, help="fresh processes per variant and depth (median)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument(
        "--compile-up-to",
        type=int,
        default=32,
        help="time compile only up to this depth (compiling the 256-layer step ran out of memory on a 24 GiB machine)",
    )
    ap.add_argument("--float8-up-to", type=int, default=1 << 30, help="time float8 only up to this depth")
    ap.add_argument("--json", metavar="PATH", help="also write every process's times there")
    ap.add_argument("--one", nargs=3, metavar=("VARIANT", "LAYERS", "COMPILE"), help=argparse.SUPPRESS)  # a child
    args = ap.parse_args()
    if args.one:
        print("{:.6f} {:.6f} {:.6f}".format(*measure(args.one[0], int(args.one[1]), args.one[2] == "1")))
        return
    times: dict[tuple[str, int], list[tuple[float, ...]]] = {}
    load_before, started = _load(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for r in range(args.rounds):
        for layers in args.layers:
            for variant in args.variants if r % 2 == 0 else args.variants[::-1]:
                if variant == "float8" and layers > args.float8_up_to:
                    continue
                timed = str(int(layers <= args.compile_up_to))
                cmd = [sys.executable, __file__, "--one", variant, str(layers), timed]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    killed = f"killed by signal {-done.returncode}" if done.returncode < 0 else "failed"
                    sys.exit(
                        f"trace_cost.py: the {variant} process at {layers} layers (compile timed: {timed == '1'}) "
                        f"{killed}; out of memory? Lower --compile-up-to or the --layers.\n{done.stderr[-2000:]}"
                    )
                out = done.stdout.split()
                times.setdefault((variant, layers), []).append(tuple(float(w) for w in out[-3:]))
    print(
        f"{_cpu()}; Python {platform.python_version()}, jax {jax.__version__}; {started}; "
        f"load average {load_before} before, {_load()} after; {args.rounds} rounds of fresh processes"
    )
    if args.json:
        rows = [{"variant": v, "layers": n, "round": r, "lower_wall_s": t[0], "lower_cpu_s": t[1], "compile_s": t[2]}
                for (v, n), ts in times.items() for r, t in enumerate(ts)]  # fmt: skip
        Path(args.json).write_text(json.dumps(rows, indent=1))
    med = {k: [statistics.median(t[i] for t in v) for i in range(3)] for k, v in times.items()}

    def cell(variant: str, layers: int, i: int) -> str:
        return f"{med[variant, layers][i]:.3g}" if (variant, layers) in med else "-"

    def ratio(a: str, b: str, layers: int, i: int, spread: bool = False) -> str:
        if (a, layers) not in med or (b, layers) not in med:
            return "-"
        each = [x[i] / y[i] for x, y in zip(times[a, layers], times[b, layers], strict=True)]
        text = f"{statistics.median(each):.2f}"
        return f"{text} ({min(each):.2f}-{max(each):.2f})" if spread and len(each) > 1 else text

    columns = [
        *((f"{v} CPU s", lambda n, v=v: cell(v, n, 1)) for v in args.variants),
        ("bf16/hand CPU (range)", lambda n: ratio("bf16", "hand", n, 1, spread=True)),
        ("bf16/hand wall", lambda n: ratio("bf16", "hand", n, 0)),
        ("float8/bf16 CPU (range)", lambda n: ratio("float8", "bf16", n, 1, spread=True)),
        ("hand compile s", lambda n: cell("hand", n, 2)),
        ("bf16/hand compile", lambda n: ratio("bf16", "hand", n, 2)),
    ]
    print("| layers | " + " | ".join(name for name, _ in columns) + " |")
    print("|" + "---|" * (len(columns) + 1))
    for layers in args.layers:
        print(f"| {layers} | " + " | ".join(get(layers) for _, get in columns) + " |")


if __name__ == "__main__":
    main()
