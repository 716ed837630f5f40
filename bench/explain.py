"""Benchmark: what ``fmp.explain(fn, compare=True)`` and ``compare=True, grads=True`` cost.

Run ``python bench/explain.py`` from the repository root; it prints one markdown table per question, for
the bench transformer of ``bench/autocast.py`` (2 pre-LN blocks, B=8, T=128, D=256, its mean-square loss) and
a flax linen encoder (4 blocks, B=8, T=64, D=128, the same loss), under ``mixed_bfloat16``:

- warm: a repeated ``explain(compare=True)`` call against a repeated eager forward (op by op, no jit), the
  same call with the comparison run op by op (as for a program with loops or float8), and a
  repeated ``explain(compare=True, grads=True)`` call against a repeated eager ``jax.grad`` (no jit); each
  the minimum over ``--repeat`` rounds, the four measured in turn in every round (side by side, so a
  shared machine's load weighs on all alike);
- cold: the first call in a fresh process against the first eager forward (or ``jax.grad``) in another
  (median over ``--runs`` process sets; every process pays JAX's start-up on a small warm-up first, so what
  is compared is the compilation of what the call runs, and the work);
- memory, against the forward's activations (the bytes of every value the float32 program computes): the
  bytes XLA assigns the compiled comparison beyond its arguments (temporaries and outputs), and the most bytes
  of live arrays while the comparison runs op by op (beyond the arguments), sampled at every op.
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
from fmp._autocast._explain import _compiled, _forward  # noqa: E402

MODELS = ("bench transformer", "linen encoder")


def model(name: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    if name == "bench transformer":
        params = bench_autocast.init_params(jax.random.key(0), d=256)
        return bench_autocast.loss, (params, jax.random.normal(jax.random.key(1), (8, 128, 256)))
    init, enc_loss = bench_autocast.linen_encoder(hand=False)
    xe = jax.random.normal(jax.random.key(2), (8, 64, 128))
    return enc_loss, (jax.jit(init)(jax.random.key(3), xe), xe)  # jitted: no op of the forward compiled before


def _best(fns: dict[str, Callable[[], Any]], repeat: int) -> dict[str, float]:
    """The least wall seconds of each of ``fns`` over ``repeat`` rounds, each round running them in turn."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[k].append(time.perf_counter() - start)
    return {k: min(v) for k, v in times.items()}


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
    """The most bytes of live arrays beyond ``args`` while ``explain(compare=True)`` runs op by op (as it does
    for programs with loops or float8, or whose statistics need the arrays), sampled per op."""
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
        _op_by_op(fmp.explain(fn, "mixed_bfloat16", compare=True), args)
    finally:
        _forward.Comparison.step = step  # type: ignore[method-assign]
    return peak


def program_bytes(fn: Callable[..., Any], args: tuple[Any, ...]) -> int:
    """The bytes XLA assigns the compiled comparison beyond its arguments (its temporaries and outputs)."""
    built: list[Any] = []
    build = _compiled._build

    def kept(*a: Any) -> Any:
        built.append(build(*a))
        return built[-1]

    _compiled._build = kept
    try:
        fmp.explain(fn, "mixed_bfloat16", compare=True)(*args)
    finally:
        _compiled._build = build
    memory = built[0].compiled.memory_analysis()
    return memory.temp_size_in_bytes + memory.output_size_in_bytes


def _runner(kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """What one call of ``kind`` runs: an eager forward or ``jax.grad``, or one of the two explain calls."""
    if kind == "eager":
        return fn
    if kind == "grad":
        return jax.grad(fn)
    explain = fmp.explain(fn, "mixed_bfloat16", compare=True, grads=kind == "explain grads")
    return lambda *args: (explain(*args), 0)[1]


KINDS = ("eager", "explain", "grad", "explain grads")


def warm(name: str, repeat: int) -> dict[str, Any]:
    fn, args = model(name)
    calls = {kind: _runner(kind, fn) for kind in KINDS}
    for call in calls.values():
        jax.block_until_ready(call(*args))  # every op compiled
    fns = {kind: (lambda c=call: c(*args)) for kind, call in calls.items()}
    fns["op by op"] = lambda: _op_by_op(calls["explain"], args)
    t = _best(fns, repeat)
    acts = activation_bytes(fn, *args)
    peak = peak_bytes(fn, args)
    program = program_bytes(fn, args)
    return {
        "model": name,
        "eager forward (ms)": 1e3 * t["eager"],
        "explain compare (ms)": 1e3 * t["explain"],
        "forward ratio": t["explain"] / t["eager"],
        "op by op (ms)": f"{1e3 * t['op by op']:.3g} = {t['op by op'] / t['eager']:.2f}x",
        "eager jax.grad (ms)": 1e3 * t["grad"],
        "explain grads (ms)": 1e3 * t["explain grads"],
        "grads ratio": t["explain grads"] / t["grad"],
        "compiled comparison / activations (MiB)": f"{program / 2**20:.0f} / {acts / 2**20:.0f} = {program / acts:.2f}x",
        "op by op: peak live / activations (MiB)": f"{peak / 2**20:.0f} / {acts / 2**20:.0f} = {peak / acts:.2f}x",
    }


def _op_by_op(call: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """``call`` with the forward comparison run op by op (as for a program with loops or float8)."""
    compiled = _compiled.run
    _compiled.run = lambda *a: False
    try:
        return call(*args)
    finally:
        _compiled.run = compiled


def first_call(kind: str, name: str) -> float:
    """Wall seconds of the first call of ``kind`` (``KINDS``) in this process."""
    jax.block_until_ready(jnp.ones((3, 3)) @ jnp.ones((3, 3)))  # JAX's own start-up, paid alike
    fn, args = model(name)
    jax.block_until_ready(args)
    call = _runner(kind, fn)
    start = time.perf_counter()
    jax.block_until_ready(call(*args))
    return time.perf_counter() - start


def cold(name: str, runs: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for _ in range(runs):
        for kind, got in times.items():
            cmd = [sys.executable, __file__, "--first-call", kind, name]
            got.append(float(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()[-1]))
    t = {kind: statistics.median(got) for kind, got in times.items()}
    return {
        "model": name,
        "eager forward (s)": t["eager"],
        "explain compare (s)": t["explain"],
        "forward ratio": t["explain"] / t["eager"],
        "eager jax.grad (s)": t["grad"],
        "explain grads (s)": t["explain grads"],
        "grads ratio": t["explain grads"] / t["grad"],
    }


def table(rows: list[dict[str, Any]]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        lines.append("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="rounds for the warm figures")
    parser.add_argument("--runs", type=int, default=3, help="fresh process sets for the cold figures")
    parser.add_argument("--warm-only", action="store_true", help="skip the cold figures")
    parser.add_argument("--first-call", nargs=2, metavar=("KIND", "MODEL"), help=argparse.SUPPRESS)
    opts = parser.parse_args()
    with jax.numpy_dtype_promotion("standard"):
        if opts.first_call:
            print(first_call(*opts.first_call))
            return
        print(table([warm(name, opts.repeat) for name in MODELS]) + "\n", flush=True)
    if not opts.warm_only:
        print(table([cold(name, opts.runs) for name in MODELS]))


if __name__ == "__main__":
    main()
