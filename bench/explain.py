"""Benchmark: what ``fmp.explain(fn, compare=True)`` costs against one eager forward pass.

Run ``python bench/explain.py`` from the repository root; it prints one markdown table per question, for
the bench transformer of ``bench/autocast.py`` (2 pre-LN blocks, B=8, T=128, D=256) and a flax linen
encoder (4 blocks, B=8, T=64, D=128), under ``mixed_bfloat16``:

- warm: a repeated call (minimum over ``--repeat``) against a repeated eager forward (op by op, no jit);
- cold: the first call in a fresh process against the first eager forward in another (median over
  ``--runs`` process pairs; both pay JAX's start-up on a small warm-up first, so what is compared is
  the compilation of each op the call runs, and the work);
- memory: the most bytes of live arrays while the comparison runs (beyond the arguments), sampled at
  every op, against the forward's activations (the bytes of every value the float32 program computes).
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import jaxprs_in_params

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import autocast as bench_autocast  # noqa: E402

import fmp  # noqa: E402
from fmp._autocast._explain import _forward  # noqa: E402

MODELS = ("bench transformer", "linen encoder")


def model(name: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    if name == "bench transformer":
        params = bench_autocast.init_params(jax.random.key(0), d=256)
        return bench_autocast.transformer, (params, jax.random.normal(jax.random.key(1), (8, 128, 256)))
    init, enc_loss = bench_autocast.linen_encoder(hand=False)
    xe = jax.random.normal(jax.random.key(2), (8, 64, 128))
    return enc_loss, (jax.jit(init)(jax.random.key(3), xe), xe)  # jitted: no op of the forward compiled before


def _best(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def activation_bytes(fn: Callable[..., Any], *args: Any) -> int:
    """Bytes of every value the float32 program computes (each equation's outputs, bodies once)."""

    def walk(jaxpr: Any) -> int:
        total = 0
        for eqn in jaxpr.eqns:
            total += sum(
                math.prod(v.aval.shape) * v.aval.dtype.itemsize for v in eqn.outvars if hasattr(v.aval, "shape")
            )
            total += sum(walk(sub) for sub in jaxprs_in_params(eqn.params))
        return total

    return walk(jax.make_jaxpr(fn)(*args).jaxpr)


def peak_bytes(fn: Callable[..., Any], args: tuple[Any, ...]) -> int:
    """The most bytes of live arrays beyond ``args`` while ``explain(compare=True)`` runs, sampled per op."""
    base = sum(a.nbytes for a in jax.live_arrays())
    peak = 0
    step = _forward.Comparison.step

    def sampled(self: Any, *a: Any) -> Any:
        nonlocal peak
        out = step(self, *a)
        peak = max(peak, sum(x.nbytes for x in jax.live_arrays()) - base)
        return out

    _forward.Comparison.step = sampled  # type: ignore[method-assign]
    try:
        fmp.explain(fn, "mixed_bfloat16", compare=True)(*args)
    finally:
        _forward.Comparison.step = step  # type: ignore[method-assign]
    return peak


def warm(name: str, repeat: int) -> dict[str, Any]:
    fn, args = model(name)
    explain = fmp.explain(fn, "mixed_bfloat16", compare=True)
    explain(*args)
    eager = _best(lambda: fn(*args), repeat)
    call = _best(lambda: (explain(*args), 0)[1], repeat)
    acts = activation_bytes(fn, *args)
    peak = peak_bytes(fn, args)
    return {
        "model": name,
        "eager forward (ms)": 1e3 * eager,
        "explain compare (ms)": 1e3 * call,
        "warm ratio": call / eager,
        "activations (MiB)": acts / 2**20,
        "peak live (MiB)": peak / 2**20,
        "peak / activations": peak / acts,
    }


def first_call(kind: str, name: str) -> float:
    """Wall seconds of the first eager forward (``eager``) or ``explain(compare=True)`` call (``explain``)."""
    jax.block_until_ready(jnp.ones((3, 3)) @ jnp.ones((3, 3)))  # JAX's own start-up, paid alike
    fn, args = model(name)
    jax.block_until_ready(args)
    start = time.perf_counter()
    if kind == "eager":
        jax.block_until_ready(fn(*args))
    else:
        fmp.explain(fn, "mixed_bfloat16", compare=True)(*args)
    return time.perf_counter() - start


def cold(name: str, runs: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {"eager": [], "explain": []}
    for _ in range(runs):
        for kind, got in times.items():
            cmd = [sys.executable, __file__, "--first-call", kind, name]
            got.append(float(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()[-1]))
    eager, call = statistics.median(times["eager"]), statistics.median(times["explain"])
    return {"model": name, "eager forward (s)": eager, "explain compare (s)": call, "cold ratio": call / eager}


def table(rows: list[dict[str, Any]]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        lines.append("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3, help="fresh process pairs for the cold figures")
    parser.add_argument("--first-call", nargs=2, metavar=("KIND", "MODEL"), help=argparse.SUPPRESS)
    opts = parser.parse_args()
    with jax.numpy_dtype_promotion("standard"):
        if opts.first_call:
            print(first_call(*opts.first_call))
            return
        print(table([warm(name, opts.repeat) for name in MODELS]) + "\n")
    print(table([cold(name, opts.runs) for name in MODELS]))


if __name__ == "__main__":
    main()
