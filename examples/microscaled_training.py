"""Microscaled training on any machine: a digits MLP in float32, bfloat16, MXFP8 and NVFP4 (emulated).

The MLP of ``float8_training.py`` (64 -> 256 -> 256 -> 256 -> 10, GELU) is trained from the same initial
parameters on the same batches with Adam under ``float32``, ``mixed_bfloat16``, ``mixed_mxfp8`` and
``mixed_nvfp4`` (gradients rounded stochastically from a key that changes every step), and once more under
each block-scaled policy with the layers ``fmp.explain(..., compare=True).suggested()`` keeps in bfloat16.
Prints each run's final loss (float32, whole training set) and milliseconds per step (after compilation),
and writes the loss curves to ``microscaled_training.png`` in the output folder.

    python examples/microscaled_training.py --out docs/assets
    python examples/microscaled_training.py --steps 50 --no-plot
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from float8_training import MLP, load_data  # noqa: E402

import fmp  # noqa: E402

POLICIES = ("float32", "mixed_bfloat16", "mixed_mxfp8", "mixed_nvfp4")


def loss_fn(model: MLP):
    def loss(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()

    return loss


def train(policy: str, overrides: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    """Trains the MLP ``args.steps`` steps under ``policy``; the per-step losses, final loss and step time."""
    x_tr, _, y_tr, _ = load_data(args.seed)
    model = MLP()
    loss = loss_fn(model)
    params = model.init(jax.random.PRNGKey(args.seed), jnp.zeros((1, 64)))
    opt = optax.adam(1e-3)
    state = opt.init(params)
    batches = np.random.default_rng(args.seed).integers(0, len(x_tr), (args.steps, 128))
    nvfp4 = "nvfp4" in policy

    @jax.jit
    def step(params, state, x, y, i):
        key = jax.random.fold_in(jax.random.key(args.seed), i) if nvfp4 else None
        f = loss if policy == "float32" else fmp.autocast(loss, policy, overrides=overrides or None, key=key)
        value, grads = jax.value_and_grad(f)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    losses, start = [], None
    for i, b in enumerate(batches):
        params, state, value = step(params, state, x_tr[b], y_tr[b], i)
        losses.append(float(value))
        if i == 0:
            start = time.perf_counter()  # compiled: time the remaining steps
    ms = 1e3 * (time.perf_counter() - start) / max(args.steps - 1, 1)
    final = float(jax.jit(loss)(params, x_tr, y_tr))
    name = policy.removeprefix("mixed_") + (" + keep" if overrides else "")
    return {"run": name, "loss": losses, "final": final, "ms_per_step": ms, "kept": sorted(overrides)}


def kept_layers(policy: str, args: argparse.Namespace) -> dict[str, str]:
    """The overrides the precision report suggests under ``policy`` (layers it keeps in bfloat16)."""
    x_tr, _, y_tr, _ = load_data(args.seed)
    model = MLP()
    params = model.init(jax.random.PRNGKey(args.seed), jnp.zeros((1, 64)))
    rep = fmp.explain(loss_fn(model), policy, compare=True)(params, x_tr[:256], y_tr[:256])
    return dict(rep.suggested().get("overrides", {}))


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, r in enumerate(runs):
        smooth = np.convolve(r["loss"], np.ones(10) / 10, mode="valid")
        style = "--" if "keep" in r["run"] else "-"
        ax.plot(smooth, style, color=f"C{i}", lw=1.2, label=f"{r['run']} (final {r['final']:.4f})")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("batch loss (10-step mean)")
    ax.set_title("digits MLP: float32, bfloat16 and block-scaled formats (emulated on a CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    runs = [train(p, {}, args) for p in POLICIES]
    for policy in ("mixed_mxfp8", "mixed_nvfp4"):
        keep = kept_layers(policy, args)
        if keep:
            runs.append(train(policy, keep, args))
    ref = runs[1]["final"]
    for r in runs:
        kept = f"  kept in bfloat16: {', '.join(r['kept'])}" if r["kept"] else ""
        print(f"{r['run']:<14} final {r['final']:.4f} ({r['final'] / ref:.2f}x bfloat16)  "
              f"{r['ms_per_step']:.1f} ms/step{kept}")  # fmt: skip
    if not args.no_plot:
        args.out.mkdir(parents=True, exist_ok=True)
        plot(runs, args.out / "microscaled_training.png")
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "loss"} for r in runs]))
    return runs


if __name__ == "__main__":
    main()
