"""Check and time the block-scaled formats (MXFP8, MXFP4, NVFP4) on whatever device JAX sees.

Checks (pass/fail):

* **device = CPU**: ``fmp.quantize`` on the default device gives the same codes and scales, bit for bit, as on
  the CPU, for every format (the emulation must not depend on the device: a GPU that flushes subnormals or
  fuses differently would show here).
* **MX tensor cores** (a GPU with ``jax.nn.scaled_dot_general`` lowering, Blackwell): the MXFP8 product of
  ``Float8Recipe("mxfp8", emulate=False)`` (``scaled_dot_general``) against fmp's emulation: bit for bit on
  exactly representable data (every product and partial sum exact), within a relative 1e-2 on random data
  (the GEMM accumulates in its own order); "not supported" where there is no lowering (a CPU).

Timings (median of ``--iters`` jitted calls after warm-up, ``block_until_ready``): an ``n x n x n`` matmul with
its two gradient products (``jax.grad`` of the sum) in bfloat16, and emulated under ``mxfp8``, ``mxfp4`` and
``nvfp4``, and through ``scaled_dot_general`` where it runs. The emulation's cost is the quantisation passes
around a float32 GEMM.

Writes ``gpu_check_microscaled.json`` to ``--out``. ``--smoke`` shrinks everything to run on a CPU in seconds.

    python bench/gpu_check_microscaled.py --out /tmp/mx_check           # full size, on the GPU if there is one
    python bench/gpu_check_microscaled.py --smoke --out /tmp/mx_check   # tiny, any machine
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fmp  # noqa: E402
from fmp._float8._block_dot import block_dot_general  # noqa: E402

DN = (((1,), (0,)), ((), ()))
FORMATS = ("mxfp8", "mxfp8_e5m2", "mxfp4", "nvfp4")


def check_device_equals_cpu(n: int) -> dict[str, bool]:
    x = np.asarray(jax.random.normal(jax.random.key(0), (n, n), jnp.float32)) * np.exp2(np.arange(n) % 40 - 20)
    cpu = jax.devices("cpu")[0]
    out = {}
    for fmt in FORMATS:
        here = fmp.quantize(jnp.asarray(x, jnp.float32), fmt)
        with jax.default_device(cpu):
            there = fmp.quantize(jnp.asarray(x, jnp.float32), fmt)
        same = all(
            np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
            for a, b in ((here.data, there.data), (here.scale, there.scale))
        )
        out[fmt] = bool(same)
    return out


def check_scaled_dot_general(n: int) -> dict[str, object]:
    exact_x = jnp.asarray(np.random.default_rng(0).integers(-4, 5, (n, n)) / 4, jnp.float32)
    exact_w = jnp.asarray(np.random.default_rng(1).integers(-4, 5, (n, n)) / 8, jnp.float32)
    rand = [jax.random.normal(jax.random.key(i), (n, n), jnp.float32) for i in (2, 3)]
    hw, emu = fmp.Float8Recipe("mxfp8", emulate=False), fmp.Float8Recipe("mxfp8")
    try:
        got = np.asarray(block_dot_general(exact_x, exact_w, DN, hw, jnp.float32))
    except (ValueError, NotImplementedError, RuntimeError) as err:
        return {"supported": False, "why": str(err).splitlines()[0]}
    want = np.asarray(block_dot_general(exact_x, exact_w, DN, emu, jnp.float32))
    a = np.asarray(block_dot_general(*rand, DN, hw, jnp.float32))
    b = np.asarray(block_dot_general(*rand, DN, emu, jnp.float32))
    rel = float(np.abs(a - b).max() / np.abs(b).max())
    return {"supported": True, "exact_bit_for_bit": bool(np.array_equal(got, want)), "random_rel_diff": rel,
            "random_ok": rel < 1e-2}  # fmt: skip


def _median_ms(fn, args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def timings(n: int, iters: int) -> dict[str, float]:
    x, w = (jax.random.normal(jax.random.key(i), (n, n), jnp.float32) for i in (4, 5))

    def step(recipe):
        if recipe is None:
            f = lambda a, b: jnp.sum(jnp.dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)).astype(jnp.float32))  # noqa: E731
        else:
            f = lambda a, b: jnp.sum(block_dot_general(a, b, DN, recipe, jnp.float32))  # noqa: E731
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))

    out = {"bfloat16": _median_ms(step(None), (x, w), iters)}
    for name in ("mxfp8", "mxfp4", "nvfp4"):
        out[f"{name} (emulated)"] = _median_ms(step(fmp.Float8Recipe(name)), (x, w), iters)
    try:
        out["mxfp8 (scaled_dot_general)"] = _median_ms(step(fmp.Float8Recipe("mxfp8", emulate=False)), (x, w), iters)
    except (ValueError, NotImplementedError, RuntimeError):
        pass
    return out


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script runs, times mean nothing")
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    n, iters = (64, 2) if args.smoke else (args.n, args.iters)
    device = jax.devices()[0]
    result = {
        "device": f"{device.platform} {getattr(device, 'device_kind', '')}".strip(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "n": n,
        "device_equals_cpu": check_device_equals_cpu(n),
        "scaled_dot_general": check_scaled_dot_general(n),
        "ms_matmul_with_grads": timings(n, iters),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check_microscaled.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
