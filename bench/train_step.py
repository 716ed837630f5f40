"""Overhead of loss scaling on a whole jitted train step of a small transformer.

Pairs, each timed in the same process, step against step:

* ``jax.value_and_grad`` + SGD  vs  ``fmp.value_and_grad`` + SGD + ``fmp.select_tree`` (skip non-finite);
* ``jax.grad`` + ``optax.adamw``  vs  scaled loss + ``fmp.optax.loss_scaled(optax.adamw)``;
* the same AdamW baseline  vs  ``fmp.value_and_grad`` + a ``lax.cond`` around ``adamw.update`` and
  ``optax.apply_updates`` (the guarded region holds the apply, so Adam's update fuses into the param write).

and, as the peer, the same model and steps in eager torch (float32, CPU) without and with
``torch.amp.GradScaler('cpu')``, SGD and AdamW (``foreach``), timed the same way (``--no-torch`` skips them).

Everything runs in float32 (autocast is not part of this measurement), params and optimizer state are
donated. The two steps of a pair alternate, one call each, for ``--steps`` pairs (which one goes first
alternates too); the overhead is the median over the pairs of fmp's time / the baseline's time, so a slow
spell of the machine hits both sides of a pair. ``--batches`` sweeps the batch size: the overhead is a
fixed number of passes over the parameters, so its share falls as tokens per step grow.
``--decompose`` adds two diagnostic SGD steps (not valid skips) that split the overhead into the
scaled backward + check and the wait of every update for the global flag.
The target is at most 3% overhead. Run: ``python bench/train_step.py``.
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
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's fmp, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/scaler.py
from scaler import kernel_count, taken_path_bytes  # noqa: E402  (bench/scaler.py, next to this file)

import fmp  # noqa: E402
import fmp.optax  # noqa: E402

VOCAB, D, HEADS, LAYERS, SEQ, BATCH = 1024, 128, 4, 2, 64, 4  # BATCH: the first row's, and the tests'


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
    batch = tokens.shape[0]
    x = params["emb"][tokens[:, :-1]] + params["pos"][: SEQ - 1]
    mask = jnp.tril(jnp.ones((SEQ - 1, SEQ - 1), bool))
    for lyr in params["layers"]:
        h = layer_norm(x, lyr["ln1"]) @ lyr["qkv"]
        q, k, v = jnp.split(h.reshape(batch, SEQ - 1, 3 * HEADS, D // HEADS), 3, axis=2)
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(D // HEADS))
        att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(batch, SEQ - 1, D) @ lyr["proj"]
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


def fmp_sgd_flag_unused(params, scaler, tokens):
    """Diagnostic, not a valid skip: the scaled backward and the check, but the update ignores the flag."""
    loss, grads, finite, scaler = fmp.value_and_grad(loss_fn, scaler)(params, tokens)
    return jax.tree.map(lambda p, g: p - LR * g, params, grads), scaler, jnp.where(finite, loss, 0.0)


def fmp_sgd_early_flag(params, scaler, tokens):
    """Diagnostic, not a valid skip: everything fmp_sgd does, but the select waits only for a flag known
    before the backward (the loss's), so the updates need not wait for the last gradient's check."""
    loss, grads, finite, scaler = fmp.value_and_grad(loss_fn, scaler)(params, tokens)
    new = jax.tree.map(lambda p, g: p - LR * g, params, grads)
    return fmp.select_tree(jnp.isfinite(loss), new, params), scaler, jnp.where(finite, loss, 0.0)


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


def fmp_adam_cond(params, state, tokens):
    scaler, opt_state = state
    loss, grads, finite, scaler = fmp.value_and_grad(loss_fn, scaler)(params, tokens)

    def apply(p, s, g):
        updates, s = ADAM.update(g, s, p)
        return optax.apply_updates(p, updates), s

    params, opt_state = jax.lax.cond(finite, apply, lambda p, s, g: (p, s), params, opt_state, grads)
    return params, (scaler, opt_state), loss


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


def paired(base, ours, n):
    """Alternates one call of each, ``n`` pairs; returns (base median s, ours median s, median ratio)."""
    tb, to = [], []
    for i in range(n):
        for run, ts in ((base, tb), (ours, to)) if i % 2 == 0 else ((ours, to), (base, tb)):
            t0 = time.perf_counter()
            run()
            ts.append(time.perf_counter() - t0)
    ratios = [o / b for o, b in zip(to, tb, strict=True)]
    return statistics.median(tb), statistics.median(to), statistics.median(ratios)


PAIRS = {
    "SGD: jax.value_and_grad vs fmp.value_and_grad + select_tree": (
        (plain_sgd, lambda p: jnp.zeros(())),
        (fmp_sgd, lambda p: fmp.GradScaler()),
    ),
    "AdamW: optax.adamw vs fmp.optax.loss_scaled(optax.adamw)": ((plain_adam, ADAM.init), (fmp_adam, SCALED_ADAM.init)),
    "AdamW: optax.adamw vs fmp.value_and_grad + lax.cond(update + apply)": (
        (plain_adam, ADAM.init),
        (fmp_adam_cond, lambda p: (fmp.GradScaler(), ADAM.init(p))),
    ),
}


# --- the peer: the same model and steps in eager torch, with and without torch.amp.GradScaler('cpu') ------------
def torch_runner(batch: int, optimizer: str, scaled: bool):
    """One eager torch train step of the same transformer (float32), plain or with GradScaler('cpu')."""
    import torch
    import torch.nn.functional as F

    params = jax.tree.map(lambda x: torch.from_numpy(np.array(x)).requires_grad_(), init_params(jax.random.key(0)))
    leaves = jax.tree.leaves(params)
    tokens = torch.from_numpy(np.array(jax.random.randint(jax.random.key(1), (batch, SEQ), 0, VOCAB))).long()
    mask = torch.tril(torch.ones(SEQ - 1, SEQ - 1, dtype=torch.bool))

    def t_layer_norm(x, g):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) * torch.rsqrt(var + 1e-5) * g

    def t_loss():
        x = params["emb"][tokens[:, :-1]] + params["pos"][: SEQ - 1]
        for lyr in params["layers"]:
            h = t_layer_norm(x, lyr["ln1"]) @ lyr["qkv"]
            q, k, v = h.reshape(batch, SEQ - 1, 3 * HEADS, D // HEADS).split(HEADS, dim=2)
            att = torch.einsum("bqhd,bkhd->bhqk", q, k) / (D // HEADS) ** 0.5
            att = torch.softmax(torch.where(mask, att, -1e9), dim=-1)
            x = x + torch.einsum("bhqk,bkhd->bqhd", att, v).reshape(batch, SEQ - 1, D) @ lyr["proj"]
            x = x + F.gelu(t_layer_norm(x, lyr["ln2"]) @ lyr["fc"], approximate="tanh") @ lyr["out"]
        logits = t_layer_norm(x, params["ln_f"]) @ params["emb"].T
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    if optimizer == "sgd":
        opt = torch.optim.SGD(leaves, lr=LR, foreach=True)
    else:
        opt = torch.optim.AdamW(leaves, lr=LR, foreach=True)
    scaler = torch.amp.GradScaler("cpu", enabled=scaled)

    def run():
        loss = t_loss()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    with torch.no_grad():
        run.initial_loss = float(t_loss())  # for the test that this is the same model as loss_fn
    run()
    run()
    return run


TORCH_PAIRS = {
    "torch peer, eager: SGD(foreach) vs GradScaler('cpu') + SGD(foreach)": "sgd",
    "torch peer, eager: AdamW(foreach) vs GradScaler('cpu') + AdamW(foreach)": "adamw",
}


# --decompose: where the SGD pair's overhead goes (each against the same unscaled SGD step)
DECOMPOSE = {
    "SGD diagnostic: fmp step with the flag computed, not used (no valid skip)": (
        (plain_sgd, lambda p: jnp.zeros(())),
        (fmp_sgd_flag_unused, lambda p: fmp.GradScaler()),
    ),
    "SGD diagnostic: fmp step selecting on a flag known before the backward (no valid skip)": (
        (plain_sgd, lambda p: jnp.zeros(())),
        (fmp_sgd_early_flag, lambda p: fmp.GradScaler()),
    ),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[BATCH, 16])
    ap.add_argument("--steps", type=int, default=300, help="pairs of steps at the smallest batch (fewer when larger)")
    ap.add_argument(
        "--decompose",
        action="store_true",
        help="also time two diagnostic SGD steps that show where the overhead goes (not valid skips)",
    )
    ap.add_argument("--no-torch", action="store_true", help="skip the torch.amp.GradScaler peer rows")
    args = ap.parse_args()
    pairs = PAIRS | (DECOMPOSE if args.decompose else {})
    n_params = sum(x.size for x in jax.tree.leaves(init_params(jax.random.key(0))))
    print(
        f"# machine: {platform.machine()}, python {platform.python_version()}, jax {jax.__version__}, "
        f"optax {optax.__version__}; transformer {LAYERS} layers, d={D}, seq={SEQ}, "
        f"{n_params / 1e6:.1f}M params, float32"
    )
    tree = 4 * n_params
    print(
        "\nTime (medians over alternating steps; overhead: median of the per-pair ratios) and, deterministic,"
        " the bytes the compiled step accesses on a finite step (optimized HLO, the taken branch of any cond)"
        " in float32-param-tree units, and its kernels\n"
    )
    print(
        "| batch | pair | no scaling (ms) | with scaling (ms) | overhead | bytes: no scaling / fmp (trees) "
        "| bytes overhead | kernels |\n|---|---|---|---|---|---|---|---|"
    )
    for batch in args.batches:
        tokens = jax.random.randint(jax.random.key(1), (batch, SEQ), 0, VOCAB)
        n = max(50, args.steps * min(args.batches) // batch)
        for name, ((base_step, base_init), (our_step, our_init)) in pairs.items():
            base, ours = make_runner(base_step, base_init, tokens), make_runner(our_step, our_init, tokens)
            b, o, ratio = paired(base, ours, n)
            bb, bo = (taken_path_bytes(r.compiled) / tree for r in (base, ours))
            kb, ko = (kernel_count(r.compiled) for r in (base, ours))
            print(
                f"| {batch} | {name} | {b * 1e3:.1f} | {o * 1e3:.1f} | {100 * (ratio - 1):+.1f}% | {bb:.2f} / {bo:.2f} "
                f"| {100 * (bo / bb - 1):+.1f}% | {kb} / {ko} |",
                flush=True,
            )
        if not args.no_torch:
            for name, optimizer in TORCH_PAIRS.items():
                base, ours = torch_runner(batch, optimizer, False), torch_runner(batch, optimizer, True)
                b, o, ratio = paired(base, ours, n)
                print(
                    f"| {batch} | {name} | {b * 1e3:.1f} | {o * 1e3:.1f} | {100 * (ratio - 1):+.1f}% | n/a | n/a | n/a |"
                )


if __name__ == "__main__":
    main()
