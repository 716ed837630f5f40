"""Let fmp choose the precision of a small language model, then train it with the plan.

A one-block transformer LM (embedding, attention, MLP, LM head; every matmul under a ``jax.named_scope``) with
a planted massive activation channel before the head (the final norm scales one channel 10^6 times the others
and the head's weights for it are as much smaller, both kept so in training: the same logits, but one float8
scale for the head's input flushes the other channels). ``fmp.plan`` measures each site in float8 and bfloat16 on a few batches and keeps
the sites whose error stands out out of float8. The model is then trained for the same steps, from the same
initial parameters on the same batches with Adam, under the plan, all-bfloat16, all-float8 and float32; the
four loss curves go to ``plan_lm.png`` with the plan's predicted speedup.

At this toy size float8 pays on no real GPU (``device="h100"`` keeps every site in bfloat16 by torchao's size
rule), so the plan prices the sites on an H100 table without the size rule and without memory limits: the
formats are chosen by the measured errors, and the predicted speedup is that of the GEMMs' compute alone.

    python examples/plan_lm.py --out docs/assets
    python examples/plan_lm.py --fast          # 20 steps, no plot
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fmp  # noqa: E402

VOCAB, DIM, LENGTH, BATCH, MASSIVE = 64, 64, 32, 8, 1e6
# H100 SXM5 dense peaks (FLOP/s); memory never limits and no size rule: only the measured errors decide
DEVICE = {"peak": {"float32": 66.9e12, "bfloat16": 989.4e12, "float8": 1978.9e12}, "bandwidth": 1e18}
DEVICE["size_rule"] = False


def init(key):
    ks = jax.random.split(key, 6)
    n = lambda k, shape: jax.random.normal(k, shape) / np.sqrt(shape[0])  # noqa: E731
    head = n(ks[5], (DIM, VOCAB)).at[0].divide(MASSIVE)
    return {"embed": n(ks[0], (VOCAB, DIM)), "qkv": n(ks[1], (DIM, 3 * DIM)), "out": n(ks[2], (DIM, DIM)),
            "up": n(ks[3], (DIM, 4 * DIM)), "down": n(ks[4], (4 * DIM, DIM)), "head": head}  # fmt: skip


NORM = np.ones(DIM, np.float32)
NORM[0] = MASSIVE  # the final norm's scale: a constant, so training keeps the planted channel


def rms(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def loss_fn(p, tokens):  # next-token cross-entropy over a batch of sequences
    with jax.named_scope("embed"):
        x = jax.nn.one_hot(tokens, VOCAB) @ p["embed"]
    with jax.named_scope("attn"):
        q, k, v = jnp.split(rms(x) @ p["qkv"], 3, axis=-1)
        mask = jnp.tril(jnp.ones((LENGTH, LENGTH), bool))
        s = jnp.where(mask, q @ jnp.swapaxes(k, 1, 2) / np.float32(np.sqrt(DIM)), -1e9)
        x = x + (jax.nn.softmax(s, axis=-1) @ v) @ p["out"]
    with jax.named_scope("mlp"):
        x = x + jax.nn.gelu(rms(x) @ p["up"]) @ p["down"]
    with jax.named_scope("head"):
        logits = (rms(x) * NORM) @ p["head"]
    logp = jax.nn.log_softmax(logits[:, :-1])
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()


def batches(seed, n):
    """Sequences of a fixed random walk over the vocabulary (each token mostly followed by one of two)."""
    rng = np.random.default_rng(seed)
    nxt = np.random.default_rng(0).integers(0, VOCAB, (VOCAB, 2))
    out = []
    for _ in range(n):
        t = np.zeros((BATCH, LENGTH), np.int32)
        t[:, 0] = rng.integers(0, VOCAB, BATCH)
        for i in range(1, LENGTH):
            pick = nxt[t[:, i - 1], rng.integers(0, 2, BATCH)]
            t[:, i] = np.where(rng.random(BATCH) < 0.9, pick, rng.integers(0, VOCAB, BATCH))
        out.append(jnp.asarray(t))
    return out


def train(loss, params, data):
    opt = optax.adam(3e-3)

    @jax.jit
    def step(p, s, tokens):
        value, g = jax.value_and_grad(loss)(p, tokens)
        g["head"] = g["head"].at[0].set(0.0)  # the head's row for the massive channel stays 10^6 times smaller
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    state, curve = opt.init(params), []
    for tokens in data:
        params, state, value = step(params, state, tokens)
        curve.append(float(value))
    return params, curve


def run(steps, out=None):
    params = init(jax.random.key(0))
    # --8<-- [start:plan]
    plan_batches = batches(1, 3)
    plan = fmp.plan(loss_fn, params, plan_batches[0], batches=plan_batches[1:], device=DEVICE)
    print(plan)
    plan_loss = fmp.autocast(loss_fn, plan.policy, overrides=plan.overrides)
    # --8<-- [end:plan]
    runs = {
        "plan": plan_loss,
        "bfloat16": fmp.autocast(loss_fn, "mixed_bfloat16"),
        "float8": fmp.autocast(loss_fn, "mixed_float8"),
        "float32": loss_fn,
    }
    data, held = batches(2, steps), batches(3, 4)
    curves, final = {}, {}
    for name, loss in runs.items():
        p, curves[name] = train(loss, params, data)
        final[name] = float(np.mean([loss_fn(p, t) for t in held]))  # evaluated in float32 on held-out batches
    for name in runs:
        gap = (final[name] - final["float32"]) / final["float32"]
        print(f"{name:9s} final held-out loss {final[name]:.4f} ({gap:+.1%} vs float32)")
    if out is not None:
        plot(curves, plan, out / "plan_lm.png")
    return {"plan": plan, "final": final, "curves": curves}


def plot(curves, plan, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    smooth = lambda c: np.convolve(c, np.ones(10) / 10, mode="valid")  # noqa: E731
    mix = ", ".join(f"{r.site}: {r.format}" for r in plan.rows)
    labels = {"plan": f"plan ({mix})", "bfloat16": "all bfloat16", "float8": "all float8", "float32": "float32"}
    styles = {"plan": ("-", 2.5), "bfloat16": ("--", 1.2), "float8": ("-", 1.2), "float32": (":", 1.5)}
    for name, c in curves.items():
        ls, lw = styles[name]
        ax.plot(np.arange(len(smooth(c))) + 10, smooth(c), ls, label=labels[name], lw=lw)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (10-step mean; plan, bfloat16, float32 overlap)")
    ax.set_title(f"fmp.plan: predicted speedup {plan.predicted_speedup:.2f}x over bfloat16 (GEMM compute)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"wrote {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--fast", action="store_true", help="20 steps, no plot")
    parser.add_argument("--out", type=Path, default=None, help="folder for plan_lm.png")
    args = parser.parse_args()
    run(20 if args.fast else args.steps, None if args.fast else (args.out or Path(".")))
