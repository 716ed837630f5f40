"""Overhead of loss scaling on a whole jitted train step of a small transformer.

Pairs, each timed in the same process with interleaved rounds:

* ``jax.value_and_grad`` + SGD  vs  ``fmp.value_and_grad`` + SGD + ``fmp.select_tree`` (skip non-finite);
* ``jax.grad`` + ``optax.adamw``  vs  scaled loss + ``fmp.optax.loss_scaled(optax.adamw)``.

Everything runs in float32 (autocast is not part of this measurement), params and optimizer state are
donated. The target is at most 3% overhead. Run: ``python bench/train_step.py``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's fmp, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/scaler.py
from scaler import kernel_count, taken_path_bytes  # noqa: E402  (bench/scaler.py, next to this file)

import fmp  # noqa: E402
import fmp.optax  # noqa: E402

VOCAB, D, HEADS, LAYERS, SEQ, BATCH = 1024, 128, 4, 2, 64, 4


def init_params(key):
    keys = iter(jax.random.split(key, 4 + 6 * LAYERS))
    nrm = lambda shape, s=0.02: jax.random.normal(next(keys), shape) * s  # noqa: E731
    params = {"emb": nrm((VOCAB, D)), "pos": nrm((SEQ, D)), "ln_f": jnp.ones(D), "layers": []}
    for _ in range(LAYERS):
        params["layers"].append(
            {
                "ln1": jnp.ones(D),
                "qkv": nrm((D, 3 * D)),
                "proj": nrm((D, D)),
                "ln2": jnp.ones(D),
                "fc": nrm((D, 4 * D)),
                "out": nrm((4 * D, D)),
            }
        )
    return params


def layer_norm(x, g):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * g


def loss_fn(params, tokens):
    x = params["emb"][tokens[:, :-1]] + params["pos"][: SEQ - 1]
    mask = jnp.tril(jnp.ones((SEQ - 1, SEQ - 1), bool))
    for lyr in params["layers"]:
        h = layer_norm(x, lyr["ln1"]) @ lyr["qkv"]
        q, k, v = jnp.split(h.reshape(BATCH, SEQ - 1, 3 * HEADS, D // HEADS), 3, axis=2)
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(D // HEADS))
        att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(BATCH, SEQ - 1, D) @ lyr["proj"]
        x = x + jax.nn.gelu(layer_norm(x, lyr["ln2"]) @ lyr["fc"]) @ lyr["out"]
    logits = layer_norm(x, params["ln_f"]) @ params["emb"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


LR = 1e-3


def plain_sgd(params, state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    return jax.tree.map(lambda p, g: p - LR * g, params, grads), state, loss


def fmp_sgd(params, scaler, tokens):
    loss, grads, finite, scaler = fmp.value_and_grad(loss_fn, scaler)(params, tokens)
    new = jax.tree.map(lambda p, g: p - LR * g, params, grads)
    return fmp.select_tree(finite, new, params), scaler, loss


ADAM = optax.adamw(LR)
SCALED_ADAM = fmp.optax.loss_scaled(optax.adamw(LR))


def plain_adam(params, state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, state = ADAM.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss


def fmp_adam(params, state, tokens):
    scaler = fmp.optax.current_scaler(state)
    loss, grads = jax.value_and_grad(lambda p: scaler.scale(loss_fn(p, tokens)))(params)
    updates, state = SCALED_ADAM.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss


def make_runner(step, state_init, tokens):
    f = jax.jit(step, donate_argnums=(0, 1))
    params = init_params(jax.random.key(0))
    box = [params, state_init(params)]
    compiled = f.lower(box[0], box[1], tokens).compile()

    def run():
        box[0], box[1], loss = f(box[0], box[1], tokens)
        jax.block_until_ready(loss)

    run()
    run()
    run.compiled = compiled
    return run


def timed(run, n):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        run()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    tokens = jax.random.randint(jax.random.key(1), (BATCH, SEQ), 0, VOCAB)
    pairs = {
        "SGD: jax.value_and_grad vs fmp.value_and_grad + select_tree": (
            make_runner(plain_sgd, lambda p: jnp.zeros(()), tokens),
            make_runner(fmp_sgd, lambda p: fmp.GradScaler(), tokens),
        ),
        "AdamW: optax.adamw vs fmp.optax.loss_scaled(optax.adamw)": (
            make_runner(plain_adam, ADAM.init, tokens),
            make_runner(fmp_adam, SCALED_ADAM.init, tokens),
        ),
    }
    n_params = sum(x.size for x in jax.tree.leaves(init_params(jax.random.key(0))))
    print(
        f"# machine: {platform.machine()}, python {platform.python_version()}, jax {jax.__version__}, "
        f"optax {optax.__version__}; transformer {LAYERS} layers, d={D}, seq={SEQ}, batch={BATCH}, "
        f"{n_params / 1e6:.1f}M params, float32"
    )
    tree = 4 * n_params
    print(
        "\nTime (best of the rounds' medians) and, deterministic, the bytes the compiled step accesses on a"
        " finite step (optimized HLO, the taken branch of any cond) in float32-param-tree units, and its kernels\n"
    )
    print(
        "| pair | no scaling (ms) | with fmp (ms) | overhead | bytes: no scaling / fmp (trees) "
        "| bytes overhead | kernels |\n|---|---|---|---|---|---|---|"
    )
    for name, (base, ours) in pairs.items():
        tb, to = [], []
        for _ in range(args.rounds):  # interleaved, so load changes hit both sides
            tb.append(timed(base, args.steps))
            to.append(timed(ours, args.steps))
        b, o = min(tb), min(to)
        bb, bo = (taken_path_bytes(r.compiled) / tree for r in (base, ours))
        kb, ko = (kernel_count(r.compiled) for r in (base, ours))
        print(
            f"| {name} | {b * 1e3:.1f} | {o * 1e3:.1f} | {100 * (o / b - 1):+.1f}% | {bb:.2f} / {bo:.2f} "
            f"| {100 * (bo / bb - 1):+.1f}% | {kb} / {ko} |"
        )


if __name__ == "__main__":
    main()
