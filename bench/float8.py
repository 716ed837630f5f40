"""Benchmark: float8 recipes against bfloat16 autocast on the small pre-LN transformer of ``bench/autocast.py``.

Run ``python bench/float8.py`` from the repository root; it prints one table with, per policy, the
trace+lower and compile times of the train step (``value_and_grad``), its compiled temp and argument
memory (``memory_analysis``), the bytes saved for the backward pass, and the median step time. On a CPU
the float8 matmuls are emulated (quantise, dequantise to float32, float32 matmul): the step time is the
cost of the emulation, not a float8 speed. On a GPU it also times one large matmul in bfloat16 and in
float8 (``--gpu-matmul``). ``--cold N`` instead times the first trace+lower of the train step in fresh
processes (median of N, the policies interleaved), for bfloat16 and the tensorwise, rowwise and delayed
(with an ``fmp.Float8State``) float8 recipes.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fmp  # noqa: E402
from bench.autocast import compile_once, fresh_medians, init_params, loss, run_all  # noqa: E402
from fmp._float8._dot import float8_dot_general  # noqa: E402

POLICIES = {
    "float32": None,
    "mixed_bfloat16": "mixed_bfloat16",
    "fp8 tensorwise": "mixed_float8",
    "fp8 rowwise": "p=f32,c=bf16,o=f32,float8=rowwise",
    "fp8 blockwise": "p=f32,c=bf16,o=f32,float8=blockwise",
}


def variants() -> dict:
    return {name: (loss if pol is None else fmp.autocast(loss, pol)) for name, pol in POLICIES.items()}


# the first trace in a fresh process: bfloat16 against each float8 recipe (delayed: with a Float8State)
COLD = {
    "mixed_bfloat16": "mixed_bfloat16",
    "fp8 tensorwise": "mixed_float8",
    "fp8 rowwise": "p=f32,c=bf16,o=f32,float8=rowwise",
    "fp8 delayed": "p=f32,c=bf16,o=f32,float8=delayed",
}


def first_trace(name: str) -> tuple[float, float]:
    """Wall and CPU seconds of the first trace+lower of ``jit(value_and_grad(step))`` in this process.

    JAX's first-use costs are paid first by a hand-cast warm-up at other shapes (as ``bench/autocast.py``
    does); a delayed recipe's state is built before the clock starts and differentiated with the parameters.
    """
    policy = COLD[name]
    with jax.numpy_dtype_promotion("standard"):
        small = init_params(jax.random.key(0), d=64, layers=1)
        compile_once(lambda p, x: loss(p, x, hand=True), small, jnp.ones((2, 16, 64)), compile=False)
        params = init_params(jax.random.key(0))
        x = jax.random.normal(jax.random.key(1), (8, 128, 256))
        if "delayed" in policy:
            state = fmp.float8_state(loss, policy)(params, x)
            step = jax.value_and_grad(
                lambda p, st, x: fmp.autocast(loss, policy, float8_state=st)(p, x), argnums=(0, 1)
            )
            args = (params, state, x)
        else:
            step, args = jax.value_and_grad(fmp.autocast(loss, policy)), (params, x)
        wall, cpu = time.perf_counter(), time.process_time()
        jax.jit(step).lower(*args)
        return time.perf_counter() - wall, time.process_time() - cpu


def cold_table(runs: int) -> None:
    """Prints the median first trace (wall and CPU ms) per policy over ``runs`` fresh processes each."""
    med = fresh_medians(__file__, tuple(COLD), runs)
    bf = med["mixed_bfloat16"]
    print(f"jax {jax.__version__}, first trace+lower of the train step, fresh processes, median of {runs}")
    print("| policy | wall ms | CPU ms | wall / bf16 | CPU / bf16 |")
    print("|---|---|---|---|---|")
    for name, m in med.items():
        print(
            f"| {name} | {1e3 * m['wall']:.0f} | {1e3 * m['cpu']:.0f} | "
            f"{m['wall'] / bf['wall']:.2f} | {m['cpu'] / bf['cpu']:.2f} |"
        )


def gpu_matmul(n: int = 8192, repeats: int = 20) -> None:
    """bf16 vs float8 (tensorwise) throughput of one n x n x n matmul; GPU only."""
    x = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    dn = (((1,), (0,)), ((), ()))
    fns = {
        "bf16": jax.jit(lambda a, b: jax.lax.dot_general(a, b, dn, preferred_element_type=jnp.bfloat16)),
        "fp8 tensorwise": jax.jit(lambda a, b: float8_dot_general(a, b, dn, fmp.Float8Recipe(), jnp.bfloat16)),
        "fp8 rowwise": jax.jit(lambda a, b: float8_dot_general(a, b, dn, fmp.Float8Recipe("rowwise"), jnp.bfloat16)),
        "fp8 tensorwise, emulate=True": jax.jit(
            lambda a, b: float8_dot_general(a, b, dn, fmp.Float8Recipe(emulate=True), jnp.bfloat16)
        ),
    }
    for name, f in fns.items():
        hlo = f.lower(x, w).compile().as_text() or ""
        f8 = sum(1 for line in hlo.splitlines() if "matmul$f8" in line or (" dot(" in line and "f8e" in line))
        print(f"{name}: {f8} matmul(s) with float8 operands in the compiled program")
        jax.block_until_ready(f(x, w))
        t0 = time.perf_counter()
        for _ in range(repeats):
            out = f(x, w)
        jax.block_until_ready(out)
        dt = (time.perf_counter() - t0) / repeats
        print(f"{name}: {2 * n**3 / dt / 1e12:.1f} TFLOP/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2, help="trace+compile rounds per variant (min is reported)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--gpu-matmul", action="store_true")
    ap.add_argument("--cold", type=int, default=0, help="only the first trace, in N fresh processes per policy")
    ap.add_argument("--first-trace", choices=tuple(COLD), help=argparse.SUPPRESS)  # one cold process
    args = ap.parse_args()
    if args.first_trace:
        print("{:.6f} {:.6f}".format(*first_trace(args.first_trace)))
        return
    if args.cold:
        cold_table(args.cold)
        return
    params = init_params(jax.random.key(0), args.dim)
    x = jax.random.normal(jax.random.key(1), (args.batch, args.seq, args.dim))
    rows = run_all(variants(), params, x, args.rounds, args.repeats)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, B={args.batch} T={args.seq} D={args.dim}")
    cols = ["trace_lower_s", "compile_s", "temp_MB", "residual_MB", "step_ms"]
    print("| policy | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, r in rows.items():
        print(f"| {name} | " + " | ".join(f"{r[c]:.3g}" for c in cols) + " |")
    bf = rows["mixed_bfloat16"]
    for name, r in rows.items():
        if name.startswith("fp8"):
            print(
                f"{name} / mixed_bfloat16: trace+lower {r['trace_lower_s'] / bf['trace_lower_s']:.2f}x, "
                f"compile {r['compile_s'] / bf['compile_s']:.2f}x, step {r['step_ms'] / bf['step_ms']:.2f}x"
            )
    if args.gpu_matmul:
        if jax.default_backend() != "gpu":
            print("--gpu-matmul: no GPU here, skipped (float8 matmuls on a CPU are emulated)")
        else:
            gpu_matmul()


if __name__ == "__main__":
    main()
