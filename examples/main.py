"""fmp's main job: a deep autoencoder on scikit-learn's digits, trained four ways.

The same plain autoencoder (64 -> 16 GELU layers of width 32 -> a 16-unit code -> 16 GELU layers of width 32
-> 64, sigmoid; flax's default init, no residual connections, no normalisation) and the same batches are
trained with Adam in

* ``float32``        plain JAX, the reference;
* ``bfloat16``       ``fmp.autocast(loss, "mixed_bfloat16")``: matmuls in bfloat16, the loss in float32;
* ``float16+scaling`` ``fmp.autocast(loss, "mixed_float16")`` with ``fmp.value_and_grad`` and a dynamic
  ``fmp.GradScaler``: the loss is multiplied by the scale before the backward pass, non-finite steps are skipped;
* ``float16``        the same code with the scaler disabled: float16 autocast WITHOUT loss scaling.

Why float16 needs the scaler here: the loss is the squared error averaged over every pixel of the batch
(512 images x 64 pixels), so the gradient of each output is its error divided by 32768 (about 1e-5); at
flax's default init each plain GELU layer passes back about half the gradient it receives, so the gradient
of each activation falls below float16's smallest subnormal (2**-24, 6e-8) from the decoder's middle down,
to about 3e-11 at the code. Every run starts on the plateau where the decoder outputs the average digit.
float32 and bfloat16 (float32's exponent range) keep those tiny gradients and Adam turns them into
full-size steps; a loss scale of 2**16 and up lifts the gradients of the code and the layers around it into
float16's range, enough to start; float16 without scaling rounds them to zero in the backward pass, so the
layers below the decoder's last few never learn and the loss stays at the average digit's.

At ``--checks`` points during training and at the end, each run measures, on the whole training set at its
current parameters, how many gradient elements that are non-zero in float32 come out exactly zero in that
run's gradient (flushed to zero). steps/s is timed after training, the runs taking turns in 9 rounds of
20 steps each (the median round), so that every run's figure shares the machine's load.

Prints the ``fmp.explain`` summary of the model, a progress bar per run, then two tables. What each run
learned: the test and training-set losses at the final parameters evaluated in float32, the training loss
against float32's, skipped steps, the loss scale after the last step, flushed gradient elements. What its
train step costs: steps/s (timed, this machine), and, read from the compiled program, the bytes the forward
pass keeps for the backward pass, XLA's bytes accessed per step (``cost_analysis()``), the compiled memory
(``memory_analysis()``) and the parameter + Adam state. Writes ``fmp_main.png`` to the output folder: (a)
the loss curves on a log axis, (b) the flushed fraction over training per run, (c) the loss-scale
trajectory with the skipped steps marked, ending at the final scale, (d) the costs as ratios to float32.

    pip install -e ".[examples]" && python examples/main.py
    python examples/main.py --steps 300 --runs float32,float16+scaling --out /tmp/fmp
    python examples/main.py --init-scale 1e9     # start too high: more skipped steps on the scale plot
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import fmp

RUNS = {  # name -> (policy or None for plain float32, loss scaling)
    "float32": (None, False),
    "bfloat16": ("mixed_bfloat16", False),
    "float16+scaling": ("mixed_float16", True),
    "float16": ("mixed_float16", False),
}


class Autoencoder(nn.Module):
    """The model every run trains: a plain deep autoencoder, flax's default (LeCun normal) init."""

    width: int = 32
    depth: int = 16  # GELU layers on each side of the code
    code: int = 16
    pixels: int = 64

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for size in [self.width] * self.depth + [self.code] + [self.width] * self.depth:
            x = nn.gelu(nn.Dense(size)(x))
        return nn.sigmoid(nn.Dense(self.pixels)(x))


def load_data(seed: int) -> tuple[np.ndarray, ...]:
    """Digits (1797 8x8 images, shipped with scikit-learn), scaled to [0, 1], split 75/25 (stratified by label):
    ``(x_train, x_test)``."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_tr, x_te = train_test_split(x, test_size=0.25, random_state=seed, stratify=digits.target)
    return x_tr, x_te


def make_loss(model: Autoencoder):
    def loss_fn(params: Any, x: jax.Array) -> jax.Array:
        """Squared reconstruction error averaged over every pixel of the batch."""
        return jnp.mean(jnp.square(model.apply(params, x) - x))

    return loss_fn


class Float32Eval:
    """The float32 evaluations every run shares (jitted once): the loss, and the loss and gradients."""

    def __init__(self, model: Autoencoder):
        self.loss = jax.jit(make_loss(model))
        self.value_and_grad = jax.jit(jax.value_and_grad(make_loss(model)))


def make_step(loss_fn, policy: str | None, tx: optax.GradientTransformation):
    """One jitted train step; a disabled GradScaler makes the unscaled runs use the same code path."""
    fn = loss_fn if policy is None else fmp.autocast(loss_fn, policy)

    def step(params, opt_state, scaler, x):
        loss, grads, finite, scaler = fmp.value_and_grad(fn, scaler)(params, x)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        # skip the step (keep params and optimizer state) when the gradients overflowed
        params, opt_state = fmp.select_tree(finite, (new_params, new_opt_state), (params, opt_state))
        return params, opt_state, scaler, loss, finite

    return fn, jax.jit(step, donate_argnums=(0, 1))


def nbytes(tree) -> int:
    """Bytes of every array (or ShapeDtypeStruct) leaf of ``tree``."""
    return sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def step_costs(step, fn, params, opt_state, scaler, xb) -> tuple[Any, dict[str, float | None]]:
    """The compiled step (the training loop runs it: one compile), and what one train step costs, read from the
    program, not timed: the same on any machine with this jax.

    * ``residual_bytes``: the values the forward pass keeps for the backward pass (the leaves of
      ``jax.vjp``'s backward function: activations and the weights the matmuls saw, in their dtypes);
    * ``bytes_accessed``: XLA's count of bytes read and written by the compiled step (``cost_analysis()``);
    * ``mem_bytes``: argument + output + temporary bytes of the compiled step (``memory_analysis()``);
    * ``state_bytes``: parameters and Adam state (float32 master weights in every run).
    """
    compiled = step.lower(params, opt_state, scaler, xb).compile()
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = (cost[0] if cost else {}) if isinstance(cost, list) else (cost or {})  # a list of one in older jax
    residuals = jax.eval_shape(lambda p, x: jax.vjp(fn, p, x)[1], params, xb)
    mem_bytes = None if mem is None else mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
    return compiled, {
        "mem_bytes": mem_bytes,
        "bytes_accessed": cost.get("bytes accessed"),
        "residual_bytes": nbytes(residuals),
        "state_bytes": nbytes((params, opt_state)),
    }


def flushed(fn_grads, ref_grads) -> tuple[int, int]:
    """Gradient elements non-zero in float32 but exactly zero in the run's gradient; and the float32 non-zeros."""
    ref = np.concatenate([np.ravel(g) for g in jax.tree.leaves(ref_grads)])
    got = np.concatenate([np.ravel(g) for g in jax.tree.leaves(fn_grads)])
    nonzero = ref != 0
    return int(np.sum(nonzero & (got == 0))), int(np.sum(nonzero))


def train(name: str, args, data, model: Autoencoder, init_params, f32: Float32Eval) -> dict[str, Any]:
    policy, scaled = RUNS[name]
    x_tr, x_te = data
    loss_fn = make_loss(model)
    tx = optax.adam(args.lr)
    fn, step = make_step(loss_fn, policy, tx)
    params = jax.tree.map(jnp.copy, init_params)
    opt_state = tx.init(params)
    scaler = fmp.GradScaler(init_scale=args.init_scale, growth_interval=args.growth_interval, enabled=scaled)

    rng = np.random.default_rng(args.seed)
    n = len(x_tr)
    batches = [rng.choice(n, args.batch, replace=False) for _ in range(args.steps)]
    step, costs = step_costs(step, fn, params, opt_state, scaler, jnp.asarray(x_tr[batches[0]]))

    # the flushed-to-zero fraction over training: at `checks` points, the run's gradient (its own precision and
    # loss scale) against the float32 gradient, both on the whole training set at the run's current params
    x_all = jnp.asarray(x_tr)
    probe_scaler = fmp.GradScaler(enabled=scaled, dynamic=False)
    probe = jax.jit(lambda p, s, x: fmp.value_and_grad(fn, s)(p, x)[1])
    every = max(1, args.steps // args.checks)
    flush_curve: list[tuple[int, float]] = []

    def measure_flush(step_no: int) -> tuple[int, int]:
        _, ref = f32.value_and_grad(params, x_all)
        s = dataclasses.replace(probe_scaler, loss_scale=scaler.loss_scale)  # same static fields: no retrace
        n_flushed, n_nonzero = flushed(probe(params, s, x_all), ref)
        flush_curve.append((step_no, n_flushed / max(n_nonzero, 1)))
        return n_flushed, n_nonzero

    losses, finites, scales = [], [], []
    for i in tqdm(range(args.steps), desc=f"{name:>16}", leave=True, disable=args.quiet):
        xb = jnp.asarray(x_tr[batches[i]])
        scales.append(scaler.loss_scale)
        params, opt_state, scaler, loss, finite = step(params, opt_state, scaler, xb)
        losses.append(loss)
        finites.append(finite)
        if (i + 1) % every == 0 and i + 1 < args.steps:
            measure_flush(i + 1)
    scales.append(scaler.loss_scale)  # after the last step: the plot ends at the final scale
    # the step again, for timing after every run has trained (time_interleaved), on its own copy of the state
    bench = [jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, opt_state), scaler]

    def seconds_per_step(n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            bench[:] = step(*bench, xb)[:3]
        jax.block_until_ready(bench[0])
        return (time.perf_counter() - t) / n

    test_loss = float(f32.loss(params, jnp.asarray(x_te)))
    # flushed-to-zero count at this run's final params, on the full training set
    ref_loss = float(f32.loss(params, x_all))
    n_flushed, n_nonzero = measure_flush(args.steps)
    finites = np.asarray(jax.device_get(finites))
    return {
        "name": name,
        "policy": policy or "float32 (no autocast)",
        "test_loss": test_loss,
        "loss": np.asarray(jax.device_get(losses), np.float32),
        "train_loss": ref_loss,
        "seconds_per_step": seconds_per_step,
        **costs,
        "skipped": int(np.sum(~finites)),
        "skipped_at": np.flatnonzero(~finites),
        "scales": np.asarray(jax.device_get(scales), np.float64),
        "final_scale": float(scaler.loss_scale) if scaled else None,
        "flushed": n_flushed,
        "nonzero": n_nonzero,
        "flush_curve": np.asarray(flush_curve),
    }


def time_interleaved(results: list[dict[str, Any]], rounds: int = 9, steps: int = 20) -> None:
    """Sets each run's ``steps_per_s``: its train step timed in ``rounds`` rounds of ``steps`` steps, the runs
    taking turns (each round starts one run later), the median round. Turns taken side by side share the
    machine's load, so their ratio holds where a run timed after another would not."""
    times: dict[str, list[float]] = {r["name"]: [] for r in results}
    for r in results:
        r["seconds_per_step"](2)  # warm-up
    for k in range(rounds):
        for r in results[k % len(results) :] + results[: k % len(results)]:
            times[r["name"]].append(r["seconds_per_step"](steps))
    for r in results:
        r["steps_per_s"] = 1.0 / float(np.median(times[r["name"]]))


def _fmt_table(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    rows = [head, *rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    fmt = lambda row: "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt(rows[0]), sep, *map(fmt, rows[1:])])


def scale_str(scale: float | None) -> str:
    """``2^21`` for a power of two (every dynamic scale here), else the number."""
    if scale is None:
        return "-"
    exp = math.log2(scale) if scale > 0 else 0.5
    return f"2^{exp:.0f}" if exp == int(exp) else f"{scale:g}"


def table(results: list[dict[str, Any]]) -> str:
    """What each run learned: losses (and against the first run's), skipped steps, final scale, gradient lost to
    underflow."""
    head = ("run", "test loss", "train loss", f"vs {results[0]['name']}", "skipped", "final scale",
            "grads flushed to 0")  # fmt: skip
    rows = [
        (
            r["name"],
            f"{r['test_loss']:.2e}",
            f"{r['train_loss']:.2e}",
            f"{r['train_loss'] / results[0]['train_loss']:.2f}x",
            str(r["skipped"]),
            scale_str(r["final_scale"]),
            f"{r['flushed']}/{r['nonzero']} ({100 * r['flushed'] / max(r['nonzero'], 1):.1f}%)",
        )
        for r in results
    ]
    return _fmt_table(head, rows)


def mib(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 2**20:.2f}"


def cost_table(results: list[dict[str, Any]]) -> str:
    """What each run's train step costs: speed (timed) and bytes (read from the compiled program)."""
    head = ("run", "steps/s", "saved for bwd MiB", "bytes accessed MiB", "compiled MiB", "params+Adam MiB")
    rows = [
        (
            r["name"],
            f"{r['steps_per_s']:.0f}",
            mib(r["residual_bytes"]),
            mib(r["bytes_accessed"]),
            mib(r["mem_bytes"]),
            mib(r["state_bytes"]),
        )
        for r in results
    ]
    return _fmt_table(head, rows)


COLORS = {"float32": "black", "bfloat16": "tab:blue", "float16+scaling": "tab:green", "float16": "tab:red"}


def plot(results: list[dict[str, Any]], path: Path, title: str = "", plateau: float | None = None) -> None:
    """Four panels: loss (log axis; ``plateau``: the loss of outputting the average training image), fraction of
    gradient elements flushed to zero, loss scale, speed and memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ((ax1, ax2), (ax3, ax4)) = plt.subplots(2, 2, figsize=(12, 8.5))
    # (a) loss on a log axis (it falls from 0.18 through the average digit's plateau to a few hundredths)
    for r in results:
        loss = r["loss"]
        k = max(1, len(loss) // 50)
        smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
        steps = np.arange(len(smooth)) + k
        ax1.plot(steps, smooth, color=COLORS[r["name"]],
                 label=f"{r['name']}: train loss {r['train_loss']:.3f}")  # fmt: skip
    if plateau is not None:
        ax1.axhline(plateau, color="gray", ls="--", lw=0.8, label=f"the average digit: {plateau:.3f}")
    ax1.set(yscale="log", xlabel="step", ylabel=f"training loss, pixel MSE (mean of {k} steps)",
            title="(a) Loss (log axis)")  # fmt: skip
    ax1.legend()
    # (b) the fraction of gradient elements that are non-zero in float32 but exactly zero in the run
    for r in results:
        c = r["flush_curve"]
        ax2.plot(c[:, 0], 100 * c[:, 1], marker=".", color=COLORS[r["name"]], label=r["name"])
    ax2.set(xlabel="step", ylabel="% of gradient elements flushed to 0",
            title="(b) Gradient lost to float16 underflow (whole training set)")  # fmt: skip
    ax2.legend()
    # (c) the loss scale before each step, and the steps skipped because the scaled gradients overflowed
    scaled = [r for r in results if r["final_scale"] is not None]
    for r in scaled:
        ax3.step(np.arange(len(r["scales"])), r["scales"], where="post", color=COLORS[r["name"]],
                 label=f"{r['name']}: loss scale")  # fmt: skip
        if len(r["skipped_at"]):
            ax3.scatter(r["skipped_at"], r["scales"][r["skipped_at"]], marker="x", color="red", zorder=3,
                        label=f"skipped step: overflow, scale halved ({r['skipped']})")  # fmt: skip
        else:
            ax3.plot([], [], " ", label="no skipped step")
    if not scaled:
        ax3.text(0.5, 0.5, "no run with loss scaling", ha="center", transform=ax3.transAxes)
    ax3.set(
        yscale="log",
        xlabel="step",
        ylabel="loss scale (before each step; last: after the last)",
        title="(c) Dynamic loss scale",
    )
    if scaled:
        ax3.legend()
    # (d) what each run's step costs, as a ratio to the first run (float32): speed, and bytes read from the
    # compiled program
    metrics = [("steps/s", "steps_per_s", "{:.0f}/s"), ("saved for backward", "residual_bytes", None),
               ("bytes accessed", "bytes_accessed", None), ("compiled memory", "mem_bytes", None),
               ("params + Adam", "state_bytes", None)]  # fmt: skip
    height = 0.8 / len(results)
    for j, r in enumerate(results):
        for i, (_, key, fmt) in enumerate(metrics):
            base, val = results[0][key], r[key]
            if base is None or val is None:
                continue
            y = i + (j - (len(results) - 1) / 2) * height
            ax4.barh(y, val / base, height=height, color=COLORS[r["name"]], label=r["name"] if i == 0 else None)
            ax4.text(val / base, y, " " + (fmt.format(val) if fmt else f"{val / 2**20:.2f} MiB"), va="center",
                     fontsize=7)  # fmt: skip
    ax4.set_yticks(range(len(metrics)), [m[0] for m in metrics])
    ax4.invert_yaxis()
    ax4.axvline(1.0, color="gray", lw=0.5)
    ax4.set_xlim(0, 1.6 * max(r[k] / results[0][k] for r in results for _, k, _ in metrics if r[k] and results[0][k]))
    ax4.set(xlabel=f"ratio to {results[0]['name']} (bytes: the compiled step; speed: this CPU)",
            title="(d) Train step on this CPU: speed and bytes")  # fmt: skip
    ax4.legend(fontsize=8, loc="upper right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1500, help="training steps per run (default 1500)")
    p.add_argument(
        "--runs",
        default=",".join(RUNS),
        help=f"comma-separated runs to train, from {', '.join(RUNS)} (default: all four)",
    )
    p.add_argument("--batch", type=int, default=512, help="batch size (default 512)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    p.add_argument(
        "--growth-interval",
        type=int,
        default=100,
        help="GradScaler growth_interval: finite steps before the scale doubles (default 100; torch uses 2000)",
    )
    p.add_argument("--init-scale", type=float, default=2.0**16, help="GradScaler init_scale (default 65536, torch's)")
    p.add_argument(
        "--out", type=Path, default=Path("fmp_main_out"), help="output folder for the PNG (default ./fmp_main_out)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed for the data split, the init and the batches (default 0)")
    p.add_argument(
        "--checks", type=int, default=20, help="points at which the flushed fraction is measured (default 20)"
    )
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = [r for r in args.runs if r not in RUNS]
    if unknown:
        p.error(f"--runs: unknown run(s) {unknown}; expected some of {list(RUNS)}")
    if args.steps < 2:
        p.error(f"--steps must be >= 2, got {args.steps}")
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    t0 = time.perf_counter()
    data = load_data(args.seed)
    model = Autoencoder()
    init_params = model.init(jax.random.key(args.seed), jnp.zeros((1, 64), jnp.float32))
    n_params = sum(leaf.size for leaf in jax.tree.leaves(init_params))
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPUs; digits: "
          f"{len(data[0])} train / {len(data[1])} test images; autoencoder of {2 * model.depth + 2} layers, "
          f"{n_params} parameters; {args.steps} steps of batch {args.batch}")  # fmt: skip
    # the plateau every run starts on: the decoder outputs the average training image, whatever the input
    x_tr = jnp.asarray(data[0])
    plateau = float(jnp.mean(jnp.square(jnp.mean(x_tr, axis=0) - x_tr)))
    print(f"loss of outputting the average digit (the plateau): {plateau:.4f}")

    xb = jnp.asarray(data[0][: args.batch])
    report = fmp.explain(make_loss(model), "mixed_float16")(init_params, xb)
    s = report.summary
    print("fmp.explain(loss, 'mixed_float16') summary:")
    print(f"  share of FLOPs in float16: {100 * s['low_precision_flop_share']:.1f}%")
    for key, val in s.items():
        if key != "low_precision_flop_share":
            print(f"  {key}: {val}")

    f32 = Float32Eval(model)
    results = [train(name, args, data, model, init_params, f32) for name in args.runs]
    time_interleaved(results)
    print()
    print(table(results))
    print()
    print(cost_table(results))
    ref = results[0]
    for r in results[1:]:
        if r["policy"] != ref["policy"] and r["residual_bytes"] and ref["residual_bytes"]:
            print(f"{r['name']}: {mib(r['residual_bytes'])} MiB saved for the backward pass, "
                  f"{r['residual_bytes'] / ref['residual_bytes']:.2f}x {ref['name']}'s")  # fmt: skip
    print("params+Adam: float32 master weights and moments in every run (autocast casts per op)")
    for r in results:
        if r["final_scale"] is not None:  # panel (c) plots r["scales"]: its last point is the table's final scale
            print(f"{r['name']}: loss scale {scale_str(r['scales'][0])} before the first step, "
                  f"{scale_str(r['scales'][-1])} after the last (panel (c))")  # fmt: skip
            at = ", ".join(str(int(i)) for i in r["skipped_at"]) or "none"
            print(f"{r['name']}: highest loss scale {scale_str(float(np.max(r['scales'])))}; {r['skipped']} steps "
                  f"skipped (their gradients overflowed, the scale halved): {at}")  # fmt: skip
    by = {r["name"]: r for r in results}
    if "float32" in by:
        ref = by["float32"]["train_loss"]
        for name in ("bfloat16", "float16+scaling", "float16"):
            if name in by:
                r = by[name]
                print(f"{name} vs float32: final train loss {r['train_loss']:.4f} = {r['train_loss'] / ref:.2f}x "
                      f"float32's {ref:.4f} (the average digit: {r['train_loss'] / plateau:.2f}x)")  # fmt: skip
    if "float16" in by:
        r = by["float16"]
        print(
            f"float16 without scaling: {r['flushed']} of {r['nonzero']} gradient elements that are non-zero in "
            f"float32 flush to zero at its final params"
        )
    # a squared error is never negative: a negative logged loss would mean a value seen at two roundings
    print("lowest logged loss: " + ", ".join(f"{r['name']} {float(np.min(r['loss'])):.3e}" for r in results))
    if not args.no_plot:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "fmp_main.png"
        plot(results, path, plateau=plateau,
             title=f"digits autoencoder, {model.depth}+{model.depth} GELU layers of {model.width}, Adam({args.lr:g}), "
             f"batch {args.batch}, {args.steps} steps; jax {jax.__version__} on {jax.devices()[0].platform}")  # fmt: skip
        print(f"wrote {path}")
    print(f"total time {time.perf_counter() - t0:.1f} s")
    return results


if __name__ == "__main__":
    main()
