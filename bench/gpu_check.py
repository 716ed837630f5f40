"""One command to check and time fmp on whatever device JAX and torch see (a GPU when there is one).

Checks (pass/fail, exact where the math is exact):

* **scaler vs torch.amp**: ``fmp.GradScaler`` and ``torch.amp.GradScaler`` on torch's device run the same
  overflow pattern (real ``scaler.step`` calls with an inf injected); scale, growth tracker and the unscaled
  gradients must be bit-identical after every step.
* **autocast dtypes**: for a matmul, a bias add after it, exp, softmax and a sum, the dtype ``fmp.autocast``
  gives on the JAX device must be the one the rule table says, and ``torch.autocast`` on torch's device is
  compared with it (a difference there is reported, it is torch's device-specific table); the autocast matmul
  must equal the hand-cast bfloat16 matmul bit for bit.
* **fp8 dots**: where the backend compiles a float8_e4m3fn / e5m2 dot with float32 accumulation, it is
  compared with the float32 dot of the same (exactly representable) values; "not supported" otherwise.
* **torch float8** (``bench/_gpu_torch_float8.py``, also runnable alone): the kernel ``autocast_fx`` picks, its
  ``torch._scaled_mm`` kernel against the emulation (exact data: bit for bit; random data: a tolerance), and
  the MLP step timed against bfloat16 and torchao (when importable).

Timings (median of ``--iters`` calls after warm-up, ``block_until_ready``):

* the scaler's hot path (``unscale`` + ``all_finite`` of a GPT-2-small-shaped float32 gradient tree) against
  the copy bandwidth unit (one read and one write of the same tree);
* a GPT-2-small-sized train step (124M parameters; batch x 1024 tokens; SGD) in float32, under
  ``fmp.autocast(..., "mixed_bfloat16")``, hand-cast to bfloat16, and under the float8 policies (tensorwise
  and rowwise); the table counts the matmuls that still take float8 operands in the compiled program (a
  float8 GEMM on a GPU that has them; 0 where XLA emulates float8 in float32).

Writes ``gpu_check.json`` and ``gpu_check.md`` to ``--out``. ``--smoke`` shrinks everything to run on a CPU in
seconds (CI runs it so the script is known to work the first time it meets a GPU); its timings mean nothing.

    python bench/gpu_check.py --out /tmp/gpu_check           # full size, on the GPU if there is one
    python bench/gpu_check.py --smoke --out /tmp/gpu_check   # tiny, any machine
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's fmp, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _gpu_torch_float8  # noqa: E402

import fmp  # noqa: E402

GPT2_SMALL = {"vocab": 50257, "d": 768, "layers": 12, "heads": 12, "seq": 1024, "batch": 8}
SMOKE = {"vocab": 256, "d": 64, "layers": 2, "heads": 2, "seq": 32, "batch": 2}


# --- correctness -----------------------------------------------------------------------------------------------
def check_scaler_vs_torch(torch, device: str, steps: int) -> dict[str, Any]:
    flags = np.random.default_rng(0).random(steps) < 0.2  # True: this step overflows
    hp = {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3}
    ts = torch.amp.GradScaler(device, **hp)
    p = torch.nn.Parameter(torch.ones(1000, device=device))
    opt = torch.optim.SGD([p], lr=0.0)
    s = fmp.GradScaler(**hp)
    update, unscale = jax.jit(fmp.GradScaler.update), jax.jit(fmp.GradScaler.unscale)
    grads = np.random.default_rng(1).standard_normal((steps, 1000)).astype(np.float32)
    mismatches = []
    for i, bad in enumerate(flags):
        g = grads[i].copy()
        if bad:
            g[7] = np.inf
        opt.zero_grad()
        ts.scale(p.sum())  # torch creates its scale on the first scale() call; the gradient is set below
        scale_before = float(ts.get_scale())
        p.grad = torch.from_numpy(g * np.float32(scale_before)).to(device)
        ts.unscale_(opt)
        torch_unscaled = p.grad.detach().cpu().numpy()
        ts.step(opt)
        ts.update()
        ours = unscale(s, {"g": jnp.asarray(g * np.float32(float(s.loss_scale)))})["g"]
        finite = fmp.all_finite(ours)
        s = update(s, finite)
        same = (
            float(s.loss_scale) == float(ts.get_scale())
            and int(s.growth_tracker) == int(ts._get_growth_tracker())
            and (bad or np.asarray(ours).tobytes() == torch_unscaled.tobytes())
            and bool(finite) == (not bad)
        )
        if not same:
            mismatches.append(i)
    return {"name": f"scaler vs torch.amp.GradScaler('{device}'), {steps} steps", "ok": not mismatches,
            "detail": f"{int(flags.sum())} overflow steps; mismatching steps: {mismatches[:10] or 'none'}"}  # fmt: skip


def _flat_eqns(jaxpr) -> list:
    """The equations of ``jaxpr`` in order, with those of ``jit`` calls inlined (a JAX release may keep
    ``x @ w`` as a call)."""
    out = []
    for e in jaxpr.eqns:
        inner = e.params.get("jaxpr") if e.primitive.name in ("jit", "pjit", "closed_call") else None
        out += _flat_eqns(getattr(inner, "jaxpr", inner)) if inner is not None else [e]
    return out


def check_autocast_dtypes(torch, device: str) -> list[dict[str, Any]]:
    x = jax.random.normal(jax.random.key(0), (16, 32))
    w = jax.random.normal(jax.random.key(1), (32, 8))
    b = jnp.ones(8)
    ops = {  # name -> (JAX fn, torch fn, dtype the rule table gives under mixed_bfloat16)
        "matmul": (lambda x, w, b: x @ w, lambda x, w, b: x @ w, "bfloat16"),
        "matmul + bias": (lambda x, w, b: x @ w + b, lambda x, w, b: torch.nn.functional.linear(x, w.T, b), "bfloat16"),
        "exp": (lambda x, w, b: jnp.exp(x @ w), lambda x, w, b: torch.exp(x @ w), "float32"),
        "softmax": (lambda x, w, b: jax.nn.softmax(x @ w), lambda x, w, b: torch.softmax(x @ w, -1), "float32"),
        "sum": (lambda x, w, b: jnp.sum(x @ w), lambda x, w, b: torch.sum(x @ w), "float32"),
    }
    out = []
    tx, tw, tb = (torch.from_numpy(np.array(a)).to(device) for a in (x, w, b))
    for name, (jf, tf, want) in ops.items():
        # the dtype the op computes in: the output of the rewritten program's last equation before the output
        # cast (fmp.autocast returns float32 results as float32); the rewrite also runs on the device
        rewritten = fmp.autocast_jaxpr(jax.make_jaxpr(jf)(x, w, b), "mixed_bfloat16")
        # (fmp marks each cast up from bfloat16 with reduce_precision: skip those too)
        last = [e for e in _flat_eqns(rewritten) if e.primitive.name not in ("convert_element_type", "reduce_precision")][-1]
        got = last.outvars[0].aval.dtype.name
        jax.block_until_ready(jax.jit(fmp.autocast(jf, "mixed_bfloat16"))(x, w, b))
        with torch.autocast(device, dtype=torch.bfloat16):
            tdt = str(tf(tx, tw, tb).dtype).removeprefix("torch.")
        note = "" if tdt == want else f" (torch.autocast('{device}') gives {tdt}: its table for this device differs)"
        out.append({"name": f"autocast dtype: {name}", "ok": got == want, "detail": f"fmp {got}, rule {want}{note}"})
    mm = jax.jit(fmp.autocast(lambda x, w: x @ w, "mixed_bfloat16"))(x, w)
    # the hand-cast program with the one rounding autocast guarantees: without reduce_precision, XLA may keep
    # the bfloat16 product in float32 (excess precision) and skip the rounding
    hand = jax.jit(
        lambda x, w: jax.lax.reduce_precision(
            (x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32), exponent_bits=8, mantissa_bits=7
        )
    )(x, w)
    same = np.asarray(mm).tobytes() == np.asarray(hand).tobytes()
    out.append({"name": "autocast matmul == hand-cast bf16 matmul (bits)", "ok": same, "detail": ""})
    return out


def check_float8() -> list[dict[str, Any]]:
    out = []
    for name in ("float8_e4m3fn", "float8_e5m2"):
        dt = getattr(jnp, name, None)
        if dt is None:
            out.append({"name": f"fp8 dot {name}", "ok": None, "detail": "dtype not in this JAX"})
            continue
        a = jax.random.normal(jax.random.key(2), (64, 128)).astype(dt)
        b = jax.random.normal(jax.random.key(3), (128, 32)).astype(dt)
        try:
            got = jax.jit(lambda a, b: jax.lax.dot(a, b, preferred_element_type=jnp.float32))(a, b)
            got = np.asarray(got)
        except Exception as e:  # noqa: BLE001 - a backend without fp8 dots is a result, not a crash
            out.append({"name": f"fp8 dot {name}", "ok": None, "detail": f"not supported: {type(e).__name__}"})
            continue
        ref = np.asarray(a.astype(jnp.float32), np.float64) @ np.asarray(b.astype(jnp.float32), np.float64)
        err = float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))
        # exact products; a CPU (and XLA's widened fallback) accumulates in float32 (error ~1e-7), a float8 GEMM
        # on Hopper with less precision (DeepSeek-V3's report measured about 14 bits on H800): bound 2**-10
        out.append({"name": f"fp8 dot {name} (accumulation error vs float64)", "ok": err < 2.0**-10,
                    "detail": f"max error {err:.2e} of max |result|"})  # fmt: skip
    return out


# --- timings ---------------------------------------------------------------------------------------------------
def float8_gemm_count(hlo: str) -> int:
    """Float8 matmuls in compiled HLO: cuBLAS-Lt float8 GEMM calls (``__cublas$lt$matmul$f8``) on a GPU, dots of
    float8 operands elsewhere; 0 where the operands were widened first."""
    return sum(1 for line in hlo.splitlines() if "matmul$f8" in line or (" dot(" in line and "f8e" in line))


def median_s(fn, *args, iters: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm-up
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def gpt2_shapes(c: dict[str, int]) -> dict[str, tuple[int, ...]]:
    d = c["d"]
    shapes = {"wte": (c["vocab"], d), "wpe": (c["seq"], d), "ln_f": (2, d)}
    for i in range(c["layers"]):
        shapes |= {f"h{i}.ln": (4, d), f"h{i}.qkv": (d, 3 * d), f"h{i}.qkv_b": (3 * d,), f"h{i}.proj": (d, d),
                   f"h{i}.fc": (d, 4 * d), f"h{i}.fc_b": (4 * d,), f"h{i}.fc_proj": (4 * d, d)}  # fmt: skip
    return shapes


def init(c: dict[str, int]) -> dict[str, jax.Array]:
    key = jax.random.key(0)
    out = {}
    for i, (name, shape) in enumerate(gpt2_shapes(c).items()):
        if name.endswith("ln") or name == "ln_f":
            out[name] = jnp.concatenate([jnp.ones((shape[0] // 2, shape[1])), jnp.zeros((shape[0] // 2, shape[1]))])
        elif name.endswith("_b"):
            out[name] = jnp.zeros(shape)
        else:
            out[name] = 0.02 * jax.random.normal(jax.random.fold_in(key, i), shape)
    return out


def time_scaler(c: dict[str, int], iters: int) -> dict[str, Any]:
    grads = init(c)
    nbytes = sum(g.size * g.dtype.itemsize for g in grads.values())
    scaler = fmp.GradScaler()
    hot = jax.jit(lambda s, g: (s.unscale(g), fmp.all_finite(g)))
    unit = jax.jit(lambda g, k: jax.tree.map(lambda x: x * k, g))  # one read + one write of every leaf
    t_fmp = median_s(hot, scaler, grads, iters=iters)
    t_unit = median_s(unit, grads, jnp.float32(0.5), iters=iters)
    return {"grad_MB": nbytes / 1e6, "unit_ms": 1e3 * t_unit, "fmp_ms": 1e3 * t_fmp, "ratio": t_fmp / t_unit,
            "copy_GBps": 2 * nbytes / t_unit / 1e9}  # fmt: skip


def layer_norm(x, gb):
    m = x.mean(-1, keepdims=True)
    v = jnp.square(x - m).mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-5) * gb[0] + gb[1]


def make_loss(c: dict[str, int], hand: bool):
    """GPT-2-small's forward and next-token cross-entropy; ``hand`` casts every matmul to bfloat16 by hand."""
    lo = (lambda z: z.astype(jnp.bfloat16)) if hand else (lambda z: z)
    hi = (lambda z: z.astype(jnp.float32)) if hand else (lambda z: z)
    heads = c["heads"]

    def loss(p, tokens):
        b, t = tokens.shape
        d = c["d"]
        x = p["wte"][tokens] + p["wpe"][:t]
        mask = jnp.tril(jnp.ones((t, t), bool))
        for i in range(c["layers"]):
            ln = p[f"h{i}.ln"]
            h = layer_norm(x, ln[0:2])
            q, k, v = jnp.split(lo(h) @ lo(p[f"h{i}.qkv"]) + lo(p[f"h{i}.qkv_b"]), 3, axis=-1)
            q, k, v = (z.reshape(b, t, heads, d // heads) for z in (q, k, v))
            s = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(d // heads)
            a = jax.nn.softmax(jnp.where(mask, hi(s), -1e9), axis=-1)
            o = jnp.einsum("bhts,bshd->bthd", lo(a), v).reshape(b, t, d)
            x = x + hi(o @ lo(p[f"h{i}.proj"]))
            h = layer_norm(x, ln[2:4])
            h = jax.nn.gelu(lo(h) @ lo(p[f"h{i}.fc"]) + lo(p[f"h{i}.fc_b"]))
            x = x + hi(h @ lo(p[f"h{i}.fc_proj"]))
        x = layer_norm(x, p["ln_f"])
        logits = hi(lo(x) @ lo(p["wte"]).T)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    return loss


def time_train_step(c: dict[str, int], iters: int) -> list[dict[str, Any]]:
    params = init(c)
    tokens = jax.random.randint(jax.random.key(1), (c["batch"], c["seq"]), 0, c["vocab"])
    variants = {
        "float32": make_loss(c, hand=False),
        "fmp.autocast bf16": fmp.autocast(make_loss(c, hand=False), "mixed_bfloat16"),
        "hand-cast bf16": make_loss(c, hand=True),
        "fmp.autocast fp8 tensorwise": fmp.autocast(make_loss(c, hand=False), "mixed_float8"),
        "fmp.autocast fp8 rowwise": fmp.autocast(make_loss(c, hand=False), "p=f32,c=bf16,o=f32,float8=rowwise"),
    }
    out = []
    for name, loss in variants.items():
        def step(p, tokens, loss=loss):
            val, g = jax.value_and_grad(loss)(p, tokens)
            return jax.tree.map(lambda w, gw: w - 1e-4 * gw, p, g), val

        jitted = jax.jit(step)
        compiled = jitted.lower(params, tokens).compile()
        hlo = compiled.as_text() or ""
        mem = compiled.memory_analysis()
        temp = None if mem is None else mem.temp_size_in_bytes / 2**20
        t = median_s(jitted, params, tokens, iters=iters)
        _, val = jitted(params, tokens)
        out.append({"variant": name, "step_ms": 1e3 * t, "tokens_per_s": c["batch"] * c["seq"] / t,
                    "temp_MiB": temp, "loss": float(val), "float8_gemms": float8_gemm_count(hlo)})  # fmt: skip
    base = out[0]["step_ms"]
    for r in out:
        r["speedup_vs_f32"] = base / r["step_ms"]
    return out


# --- report ----------------------------------------------------------------------------------------------------
def markdown(res: dict[str, Any]) -> str:
    e = res["env"]
    lines = [f"# fmp gpu_check ({'smoke' if res['smoke'] else 'full'})", "",
             f"JAX {e['jax']} on {e['jax_device']}; torch {e['torch']} on {e['torch_device']}; "
             f"Python {e['python']}; {e['machine']}.", "", "## Checks", "", "| check | result | detail |",
             "|---|---|---|"]  # fmt: skip
    for r in res["checks"]:
        verdict = "n/a" if r["ok"] is None else ("pass" if r["ok"] else "**FAIL**")
        lines.append(f"| {r['name']} | {verdict} | {r['detail']} |")
    s = res["scaler"]
    lines += ["", "## Scaler hot path vs copy bandwidth", "", "| grads MB | copy ms | copy GB/s | unscale+all_finite ms | "
              "ratio to copy |", "|---|---|---|---|---|",
              f"| {s['grad_MB']:.1f} | {s['unit_ms']:.3f} | {s['copy_GBps']:.1f} | {s['fmp_ms']:.3f} | {s['ratio']:.2f} |",
              "", f"## Train step ({res['model']})", "", "| variant | step ms | tokens/s | speed-up vs float32 | "
              "temp MiB | loss | float8 matmuls in HLO |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in res["train_step"]:
        temp = "n/a" if r["temp_MiB"] is None else f"{r['temp_MiB']:.0f}"
        lines.append(f"| {r['variant']} | {r['step_ms']:.2f} | {r['tokens_per_s']:.0f} | {r['speedup_vs_f32']:.2f} | "
                     f"{temp} | {r['loss']:.4f} | {r['float8_gemms']} |")  # fmt: skip
    lines += _gpu_torch_float8.markdown(res["torch_float8"])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, a few iterations: checks that it runs")
    ap.add_argument("--out", type=Path, default=Path("gpu_check_out"), help="folder for gpu_check.json/.md")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per measurement (default 20; smoke 2)")
    ap.add_argument("--batch", type=int, default=None, help="train-step batch (default 8 sequences of 1024)")
    args = ap.parse_args(argv)
    import torch

    c = dict(SMOKE if args.smoke else GPT2_SMALL)
    if args.batch:
        c["batch"] = args.batch
    iters = args.iters or (2 if args.smoke else 20)
    tdev = "cuda" if torch.cuda.is_available() else "cpu"
    jdev = jax.devices()[0]
    env = {"jax": jax.__version__, "jax_device": f"{jdev.platform} ({jdev.device_kind})", "torch": torch.__version__,
           "torch_device": torch.cuda.get_device_name() if tdev == "cuda" else "cpu", "python": platform.python_version(),
           "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}"}  # fmt: skip
    checks = [check_scaler_vs_torch(torch, tdev, 20 if args.smoke else 200)]
    checks += check_autocast_dtypes(torch, tdev)
    checks += check_float8()
    torch_float8 = _gpu_torch_float8.section(torch, tdev, args.smoke, iters)
    checks += torch_float8["checks"]
    res = {"smoke": args.smoke, "env": env, "checks": checks, "model": ", ".join(f"{k}={v}" for k, v in c.items()),
           "scaler": time_scaler(c, iters), "train_step": time_train_step(c, iters), "torch_float8": torch_float8}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(res, indent=2))
    md = markdown(res)
    (args.out / "gpu_check.md").write_text(md)
    print(md)
    failed = [r["name"] for r in checks if r["ok"] is False]
    if failed:
        print(f"FAILED checks: {failed}", file=sys.stderr)
        sys.exit(1)
    return res


if __name__ == "__main__":
    main()
