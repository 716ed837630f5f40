"""Loss curves: float32 params vs bfloat16 params with and without ``fmp.optax.master_weights``.

A linear least-squares problem (512 x 32, targets a small perturbation of the starting weights) trained
for 200 steps with ``optax.adam(1e-3)`` three ways:

* ``float32``: float32 params (started from the bfloat16-rounded initial weights, so all runs start equal);
* ``bfloat16 + master_weights``: bfloat16 params in the forward pass, a float32 master in the optimizer state;
* ``bfloat16``: bfloat16 params updated directly. Adam's steps are about ``lr = 1e-3``, below half of
  bfloat16's spacing for weights of magnitude >= 0.5 (2**-9 = 0.00195), so those updates round away.

Usage::

    python examples/master_weights_curves.py [--out master_weights_curves.png] [--steps 200]

prints the table quoted in docs/guides/master_weights.md and writes the PNG (matplotlib needed only here).
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fmp.optax

RUNS = ("float32", "bfloat16 + master_weights", "bfloat16")


def run_experiment(steps: int = 200, lr: float = 1e-3, n: int = 512, d: int = 32, seed: int = 0) -> dict[str, Any]:
    """Trains the three variants; returns per-run numpy arrays of losses, params and (if any) masters."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k1, (n, d), jnp.float32)
    w0 = jax.random.normal(k2, (d,), jnp.float32)
    w_star = w0 + 0.1 * jax.random.normal(k3, (d,), jnp.float32)
    y = x @ w_star

    def loss(w: jax.Array) -> jax.Array:
        return jnp.mean((x @ w.astype(jnp.float32) - y) ** 2)

    w_init = w0.astype(jnp.bfloat16)

    def train(tx: optax.GradientTransformation, w: jax.Array) -> dict[str, jax.Array]:
        def body(carry, _):
            w, state = carry
            value, grad = jax.value_and_grad(loss)(w)
            updates, state = tx.update(grad, state, w)
            w = optax.apply_updates(w, updates)
            master = state.master if isinstance(state, fmp.optax.MasterWeightsState) else w.astype(jnp.float32)
            return (w, state), (value, w, master)

        (w, state), (losses, ws, masters) = jax.lax.scan(body, (w, tx.init(w)), None, length=steps)
        return {"loss": losses, "params": ws, "master": masters, "final_loss": loss(w)}

    # optax.adam is not clean under strict dtype promotion (its bias correction raises a float to an int32
    # power), so the runs trace with standard promotion whatever the caller configured.
    with jax.numpy_dtype_promotion("standard"):
        out = {
            "float32": jax.jit(lambda: train(optax.adam(lr), w_init.astype(jnp.float32)))(),
            "bfloat16 + master_weights": jax.jit(lambda: train(fmp.optax.master_weights(optax.adam(lr)), w_init))(),
            "bfloat16": jax.jit(lambda: train(optax.adam(lr), w_init))(),
        }
    result = {name: {k: np.asarray(v) for k, v in run.items()} for name, run in out.items()}
    result["init_loss"] = float(loss(w_init))
    result["init_params"] = np.asarray(w_init)
    return result


def summary(result: dict[str, Any]) -> dict[str, float]:
    """The figures quoted in the docs."""
    f32, mw, bf = (result[k] for k in RUNS)
    init = result["init_loss"]
    exact = np.all(mw["params"] == mw["master"].astype(mw["params"].dtype), axis=1)
    moved = np.any(bf["params"] != result["init_params"][None, :], axis=0)
    return {
        "initial loss": init,
        "final loss float32": float(f32["loss"][-1]),
        "final loss bf16 + master_weights": float(mw["loss"][-1]),
        "final loss bf16": float(bf["loss"][-1]),
        "max |loss mw - loss f32| / initial loss": float(np.max(np.abs(mw["loss"] - f32["loss"])) / init),
        "max |master - float32 params| (any step)": float(np.max(np.abs(mw["master"] - f32["master"]))),
        "steps where bf16 params == cast(master)": float(np.sum(exact)),
        "plain bf16: weights that ever moved": float(np.sum(moved)),
        "weights": float(moved.size),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="master_weights_curves.png")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    result = run_experiment(steps=args.steps)
    print(f"jax {jax.__version__}, optax {optax.__version__}, backend {jax.default_backend()}")
    for key, value in summary(result).items():
        print(f"{key:45s} {value:.6g}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = {"float32": "-", "bfloat16 + master_weights": "--", "bfloat16": "-"}
    for name in RUNS:
        ax.plot(result[name]["loss"], styles[name], label=name, linewidth=1.8)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (MSE)")
    ax.set_title("adam(1e-3): bfloat16 params stall, master weights track float32")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
