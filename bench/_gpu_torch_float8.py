"""The torch float8 section of ``bench/gpu_check.py``: fmp's FX float8 rewrite on torch's device.

Checks:

* **kernel choice**: which kernel ``float8_matmul="auto"`` picks for tensorwise and rowwise on the device
  (``torch._scaled_mm`` on CPU and on CUDA sm89+, the emulation elsewhere, with the reason).
* **kernels bit for bit where the math is the same**: a linear layer on small integers (every float8 value,
  product and partial sum exact in float32, power-of-two scales), forward, input and weight gradient: the
  ``torch._scaled_mm`` kernel must equal the emulation exactly (rowwise: the emulation rounded to bfloat16, as
  documented), whatever order or accumulator the device's GEMM uses.
* **kernels on random data**: the same MLP step on random data; the GEMMs sum in different orders (and the
  forward uses ``use_fast_accum``, as torchao does), so the two kernels agree only to a tolerance: the largest
  difference over the output and every gradient, relative to that tensor's largest value, must stay under 2%.

Timings (median of ``iters`` steps; a step is forward, backward and an SGD update of a two-layer MLP, bfloat16
results): ``autocast_fx`` with ``"mixed_bfloat16"``, the float8 rewrite with each kernel, and torchao's
``convert_to_float8_training`` under ``torch.autocast`` when torchao is importable (otherwise the reason is
printed); each eager and, unless ``compile=False`` (smoke runs), under ``torch.compile``.

    python bench/_gpu_torch_float8.py --smoke      # this section alone, tiny, any machine
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's fmp, not an installed one
import fmp  # noqa: E402
import fmp.torch  # noqa: E402

FULL = {"tokens": 8192, "d": 4096, "hidden": 16384}
SMOKE = {"tokens": 32, "d": 32, "hidden": 64}
SCALINGS = ("tensorwise", "rowwise")


def _policy(scaling: str, **changes: Any) -> fmp.Policy:
    """``"mixed_float8"`` with torchao's named recipe (exact tensorwise scales, e4m3 rowwise gradients)."""
    recipe = fmp.Float8Recipe.from_peer(f"torchao_{scaling}", **changes)
    return dataclasses.replace(fmp.get_policy("mixed_float8"), float8=recipe)


def _mlp(torch, c: dict[str, int], device: str):
    torch.manual_seed(0)
    lin = torch.nn.Linear
    return torch.nn.Sequential(lin(c["d"], c["hidden"], bias=False), torch.nn.GELU(), lin(c["hidden"], c["d"], bias=False)).to(device)  # fmt: skip


def _kernels(gm) -> list[str]:
    return [n.args[-1] for n in gm.graph.nodes if getattr(n.target, "__name__", "") == "float8_linear"]


def _grads(torch, gm, x, g) -> list:
    x = x.clone().requires_grad_()
    gm.zero_grad()
    out = gm(x)
    out.backward(g.to(out.dtype))
    return [out.detach().float(), x.grad.float(), *(p.grad.float() for p in gm.parameters())]


# --- checks ----------------------------------------------------------------------------------------------------
def check_kernel_choice(torch, device: str) -> list[dict[str, Any]]:
    from fmp.torch._fx._scaled_mm import scaled_mm_error

    out = []
    cap = torch.cuda.get_device_capability() if device == "cuda" else None
    for scaling in SCALINGS:
        x = torch.zeros(16, 32, device=device)
        chosen = _kernels(fmp.torch.autocast_fx(torch.nn.Linear(32, 16).to(device), (x,), _policy(scaling)))
        why = scaled_mm_error(device, scaling == "rowwise")
        expect_scaled = device == "cpu" or (cap is not None and cap >= (8, 9))
        ok = chosen == ["scaled_mm"] if expect_scaled else None
        detail = f"auto picks {chosen[0]}" + (f" ({why})" if why else "") + (f"; sm{cap[0]}{cap[1]}" if cap else "")
        out.append({"name": f"torch float8 kernel choice ({scaling}, {device})", "ok": ok, "detail": detail})
    return out


def check_exact(torch, device: str) -> list[dict[str, Any]]:
    """The two kernels on a linear layer whose every float8 value, product and partial sum is exact."""
    gen = torch.Generator().manual_seed(1)
    ints = lambda lo, hi, *shape: torch.randint(lo, hi + 1, shape, generator=gen).float().to(device)  # noqa: E731
    x, g = ints(-8, 8, 32, 64), ints(-4, 4, 32, 32)
    lin = torch.nn.Linear(64, 32, bias=False).to(device)
    with torch.no_grad():
        lin.weight.copy_(ints(-8, 8, 32, 64))
    out = []
    for scaling in SCALINGS:
        pol = dataclasses.replace(fmp.get_policy("mixed_float8"), float8=fmp.Float8Recipe(scaling, output="float32"))
        res = {}
        for kernel in ("scaled_mm", "emulated"):
            try:
                gm = fmp.torch.autocast_fx(copy.deepcopy(lin), (x,), pol, float8_matmul=kernel)
                res[kernel] = _grads(torch, gm, x, g)
            except RuntimeError as e:
                res[kernel] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        name = f"torch float8 scaled_mm = emulation, exact data ({scaling}, {device})"
        if isinstance(res["scaled_mm"], str):
            out.append({"name": name, "ok": None, "detail": f"scaled_mm does not run: {res['scaled_mm']}"})
            continue
        want = res["emulated"] if scaling == "tensorwise" else [t.bfloat16().float() for t in res["emulated"]]
        same = [torch.equal(a, b) for a, b in zip(res["scaled_mm"], want, strict=True)]
        rule = "equal" if scaling == "tensorwise" else "equal to the emulation rounded to bfloat16"
        detail = f"out, dx, dW {rule}: {same}"
        out.append({"name": name, "ok": all(same), "detail": detail})
    return out


def check_random(torch, device: str, c: dict[str, int]) -> list[dict[str, Any]]:
    torch.manual_seed(2)
    x, g = torch.randn(c["tokens"], c["d"], device=device), torch.randn(c["tokens"], c["d"], device=device)
    out = []
    for scaling in SCALINGS:
        res = [_grads(torch, fmp.torch.autocast_fx(_mlp(torch, c, device), (x,), _policy(scaling), float8_matmul=k), x, g)
               for k in ("scaled_mm", "emulated")]  # fmt: skip
        errs = [float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(*res, strict=True)]
        out.append({"name": f"torch float8 scaled_mm vs emulation, random MLP ({scaling}, {device})",
                    "ok": max(errs) < 0.02, "detail": f"largest relative difference {max(errs):.2e} (out, dx, dW1, dW2: "
                    f"{', '.join(f'{e:.1e}' for e in errs)}); GEMM summation order and fast accumulation differ"})  # fmt: skip
    return out


# --- timings ---------------------------------------------------------------------------------------------------
def _median_ms(torch, step, iters: int) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    step()
    step()  # warm-up (and compile)
    sync()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def _torchao(torch, model, scaling: str):
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception as e:  # noqa: BLE001 - torchao absent or broken is a reported result
        return f"torchao not importable ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
    return convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(scaling))


def time_steps(torch, device: str, c: dict[str, int], iters: int, compile: bool) -> list[dict[str, Any]]:
    x = torch.randn(c["tokens"], c["d"], device=device)
    variants: dict[str, Any] = {"bf16 autocast_fx": lambda m: fmp.torch.autocast_fx(m, (x,), "mixed_bfloat16")}
    for scaling in SCALINGS:
        for kernel in ("scaled_mm", "emulated"):
            variants[f"float8 {scaling} {kernel}"] = lambda m, s=scaling, k=kernel: fmp.torch.autocast_fx(
                m, (x,), _policy(s), float8_matmul=k
            )
        variants[f"torchao {scaling}"] = lambda m, s=scaling: _torchao(torch, m, s)
    rows, base = [], {}
    for mode in ("eager", "compiled") if compile else ("eager",):
        for name, make in variants.items():
            if mode == "compiled" and "emulated" in name:
                continue
            model = make(_mlp(torch, c, device))
            if isinstance(model, str):
                rows.append({"variant": name, "mode": mode, "step_ms": None, "vs_bf16": None, "note": model})
                continue
            run = torch.compile(model) if mode == "compiled" else model
            opt = torch.optim.SGD(model.parameters(), lr=1e-6)
            ac = torch.autocast(device, dtype=torch.bfloat16, enabled=name.startswith("torchao"))

            def step(run=run, opt=opt, ac=ac):
                opt.zero_grad(set_to_none=True)
                with ac:
                    out = run(x)
                out.float().square().mean().backward()
                opt.step()

            try:
                ms = _median_ms(torch, step, iters)
            except Exception as e:  # noqa: BLE001 - a variant that cannot run here is a reported result
                rows.append({"variant": name, "mode": mode, "step_ms": None, "vs_bf16": None,
                             "note": f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"})  # fmt: skip
                continue
            base.setdefault(mode, ms)  # the first variant is bf16
            rows.append({"variant": name, "mode": mode, "step_ms": ms, "vs_bf16": base[mode] / ms, "note": ""})
    return rows


def section(torch, device: str, smoke: bool, iters: int) -> dict[str, Any]:
    """The checks (gpu_check's check rows) and the timing rows of the torch float8 section."""
    c = SMOKE if smoke else FULL
    checks = check_kernel_choice(torch, device) + check_exact(torch, device) + check_random(torch, device, c)
    model = f"tokens={c['tokens']}, d={c['d']}, hidden={c['hidden']}"
    return {"checks": checks, "model": model, "steps": time_steps(torch, device, c, iters, compile=not smoke)}


def markdown(sec: dict[str, Any]) -> list[str]:
    lines = ["", f"## torch float8 MLP step ({sec['model']}; speed-up vs bf16 of the same mode)", "",
             "| variant | mode | step ms | speed-up vs bf16 | note |", "|---|---|---|---|---|"]  # fmt: skip
    for r in sec["steps"]:
        ms = "n/a" if r["step_ms"] is None else f"{r['step_ms']:.2f}"
        up = "n/a" if r["vs_bf16"] is None else f"{r['vs_bf16']:.2f}"
        lines.append(f"| {r['variant']} | {r['mode']} | {ms} | {up} | {r['note']} |")
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, no torch.compile: checks that it runs")
    ap.add_argument("--iters", type=int, default=None, help="timed steps per variant (default 20; smoke 2)")
    args = ap.parse_args(argv)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    sec = section(torch, device, args.smoke, args.iters or (2 if args.smoke else 20))
    for r in sec["checks"]:
        print(f"{'n/a' if r['ok'] is None else ('pass' if r['ok'] else 'FAIL')}: {r['name']}: {r['detail']}")
    print("\n".join(markdown(sec)))
    if any(r["ok"] is False for r in sec["checks"]):
        sys.exit(1)
    return sec


if __name__ == "__main__":
    main()
