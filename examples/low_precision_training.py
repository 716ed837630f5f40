"""Training a small transformer LM with bfloat16 params and no float32 master copy.

A two-layer causal transformer (plain JAX) learns a synthetic language (a random Markov chain over 64
tokens) with AdamW, several ways:

* ``float32``: float32 params and moments (the reference);
* ``master weights``: bfloat16 params, a float32 master copy (``fmp.optax.master_weights``);
* ``stochastic rounding``: bfloat16 params, float32 moments, ``fmp.optax.stochastic_round``;
* ``kahan``: bfloat16 params, float32 moments, ``fmp.optax.kahan``;
* ``kahan, bf16 moments``: the same with both Adam moments stored in bfloat16 (``fmp.optax.state_dtypes``);
* ``stochastic, bf16 moments``: the moments in bfloat16, rounded stochastically;
* ``bfloat16``: bfloat16 params and moments updated with round-to-nearest (plain ``optax.adamw``).

Prints the final losses against float32 and the bytes each variant keeps per parameter; ``--torch`` also
trains the same model in torch: float32 ``AdamW``, bfloat16 params with plain ``AdamW``, and torchao's
``_AdamW(bf16_stochastic_round=True)``.

Usage::

    python examples/low_precision_training.py [--steps 300] [--plot docs/assets/low_precision_training.png] [--torch]
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fmp.optax

VOCAB, SEQ, BATCH, DIM, HEADS, LAYERS = 64, 32, 16, 32, 2, 2


# --8<-- [start:variants]
def optimizers(schedule: optax.Schedule) -> dict[str, optax.GradientTransformation]:
    adamw = optax.adamw(schedule, weight_decay=0.01)
    moments32 = fmp.optax.state_dtypes(adamw, mu="float32", nu="float32")
    moments16 = fmp.optax.state_dtypes(adamw, mu="bfloat16", nu="bfloat16", rounding="stochastic")
    return {
        "float32": adamw,  # float32 params
        "master weights": fmp.optax.master_weights(adamw),
        "stochastic rounding": optax.chain(moments32, fmp.optax.stochastic_round(seed=0)),
        "kahan": optax.chain(moments32, fmp.optax.kahan()),
        "kahan, bf16 moments": optax.chain(moments16, fmp.optax.kahan()),
        "stochastic, bf16 moments": optax.chain(moments16, fmp.optax.stochastic_round(seed=0)),
        "bfloat16": adamw,  # round-to-nearest: the moments are bfloat16 too
    }


# --8<-- [end:variants]


def markov_chain(seed: int = 0) -> np.ndarray:
    """Next-token probabilities given the previous token: (VOCAB, VOCAB), each row peaked."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(VOCAB, VOCAB)) * 2.5
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def sample_batches(steps: int, seed: int = 0) -> np.ndarray:
    """(steps, BATCH, SEQ + 1) int32 token sequences drawn from `markov_chain`."""
    probs = markov_chain(seed)
    cum = probs.cumsum(-1)
    rng = np.random.default_rng(seed + 1)
    n = steps * BATCH
    seqs = np.empty((n, SEQ + 1), np.int32)
    seqs[:, 0] = rng.integers(0, VOCAB, n)
    u = rng.random((n, SEQ + 1))
    for t in range(1, SEQ + 1):
        c = cum[seqs[:, t - 1]]
        seqs[:, t] = np.minimum((c < u[:, t, None]).sum(-1), VOCAB - 1)
    return seqs.reshape(steps, BATCH, SEQ + 1)


def init_params(key: jax.Array) -> dict[str, Any]:
    keys = iter(jax.random.split(key, 3 + 4 * LAYERS))
    normal = lambda shape, std: std * jax.random.normal(next(keys), shape, jnp.float32)  # noqa: E731
    layers = []
    for _ in range(LAYERS):
        layers.append(
            {
                "ln1": jnp.ones(DIM),
                "qkv": normal((DIM, 3 * DIM), DIM**-0.5),
                "out": normal((DIM, DIM), DIM**-0.5),
                "ln2": jnp.ones(DIM),
                "up": normal((DIM, 4 * DIM), DIM**-0.5),
                "down": normal((4 * DIM, DIM), (4 * DIM) ** -0.5),
            }
        )
    return {
        "embed": normal((VOCAB, DIM), 1.0),
        "head": normal((DIM, VOCAB), DIM**-0.5),
        "pos": normal((SEQ, DIM), 0.1),
        "layers": layers,
        "ln": jnp.ones(DIM),
    }


def _norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = (x32 - x32.mean(-1, keepdims=True)) * jax.lax.rsqrt(x32.var(-1, keepdims=True) + 1e-5)
    return (x32 * scale.astype(jnp.float32)).astype(x.dtype)


def forward(params: dict[str, Any], tokens: jax.Array) -> jax.Array:
    """Logits (float32) of a pre-norm causal transformer, computed in the params' dtype."""
    x = params["embed"][tokens] + params["pos"][: tokens.shape[-1]]
    b, t, _ = x.shape
    mask = jnp.tril(jnp.ones((t, t), bool))
    for layer in params["layers"]:
        q, k, v = jnp.split(_norm(x, layer["ln1"]) @ layer["qkv"], 3, axis=-1)
        heads = lambda a: a.reshape(b, t, HEADS, DIM // HEADS)  # noqa: E731
        scores = jnp.einsum("bqhd,bkhd->bhqk", heads(q), heads(k)).astype(jnp.float32) / math.sqrt(DIM // HEADS)
        attn = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1).astype(x.dtype)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", attn, heads(v)).reshape(b, t, DIM) @ layer["out"]
        x = x + jax.nn.gelu(_norm(x, layer["ln2"]) @ layer["up"]) @ layer["down"]
    return (_norm(x, params["ln"]) @ params["head"]).astype(jnp.float32)


def loss_fn(params: dict[str, Any], batch: jax.Array) -> jax.Array:
    logits = forward(params, batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def bytes_per_param(params: Any, state: Any) -> dict[str, float]:
    """Bytes per parameter kept in params, Adam's moments, a master copy and Kahan compensation buffers."""
    n = sum(x.size for x in jax.tree.leaves(params))
    kinds = {"mu": "moments", "nu": "moments", "master": "master copy", "compensation": "compensation"}
    out = dict.fromkeys(("params", "moments", "master copy", "compensation"), 0.0)
    out["params"] = sum(x.nbytes for x in jax.tree.leaves(params)) / n
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        names = [getattr(k, "name", None) for k in path]
        kind = next((kinds[k] for k in names if k in kinds), None)
        if kind is not None and leaf.size > 1:
            out[kind] += leaf.nbytes / n
    return out


def train(name: str, tx: optax.GradientTransformation, batches: np.ndarray, seed: int = 0) -> dict[str, Any]:
    """Trains one variant; returns its per-step losses, final loss and bytes per parameter."""
    params = init_params(jax.random.PRNGKey(seed))
    if name != "float32":
        params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    state = tx.init(params)

    @jax.jit
    def run(params, state, batches):
        def body(carry, batch):
            params, state = carry
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            updates, state = tx.update(grads, state, params)
            return (optax.apply_updates(params, updates), state), loss

        return jax.lax.scan(body, (params, state), batches)

    # optax.adamw is not clean under strict dtype promotion (its bias correction raises a float to an int32 power)
    with jax.numpy_dtype_promotion("standard"):
        (params, state), losses = run(params, state, jnp.asarray(batches))
    losses = np.asarray(losses)
    return {"losses": losses, "final": float(losses[-20:].mean()), "bytes": bytes_per_param(params, state)}


def lr_schedule(steps: int, lr: float) -> optax.Schedule:
    """A tenth of the steps warming up, then a cosine decay to ``lr / 30``."""
    return optax.warmup_cosine_decay_schedule(0.0, lr, steps // 10, steps, end_value=lr / 30)


def run_all(steps: int = 300, lr: float = 3e-3, seed: int = 0) -> dict[str, dict[str, Any]]:
    batches = sample_batches(steps, seed)
    return {name: train(name, tx, batches, seed) for name, tx in optimizers(lr_schedule(steps, lr)).items()}


def run_torch(steps: int = 300, lr: float = 3e-3, seed: int = 0) -> dict[str, float]:
    """The same model and data in torch: float32 AdamW, bfloat16 AdamW, torchao's stochastic-rounding AdamW."""
    import torch
    from torchao.optim import _AdamW

    batches = torch.from_numpy(sample_batches(steps, seed)).long()
    with jax.numpy_dtype_promotion("standard"):  # optax's schedules mix float and int32
        factors = np.asarray(lr_schedule(steps, lr)(np.arange(steps + 1))) / lr  # the JAX runs' schedule
    ref = jax.tree.map(lambda x: torch.from_numpy(np.asarray(x).copy()), init_params(jax.random.PRNGKey(seed)))

    def forward_t(p, tokens):
        x = p["embed"][tokens] + p["pos"][: tokens.shape[-1]]
        b, t, _ = x.shape
        norm = lambda x, s: (torch.nn.functional.layer_norm(x.float(), (DIM,), eps=1e-5) * s.float()).to(x.dtype)  # noqa: E731
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        for layer in p["layers"]:
            q, k, v = (norm(x, layer["ln1"]) @ layer["qkv"]).split(DIM, -1)
            heads = lambda a: a.reshape(b, t, HEADS, DIM // HEADS).transpose(1, 2)  # noqa: E731
            scores = (heads(q) @ heads(k).transpose(-1, -2)).float() / math.sqrt(DIM // HEADS)
            attn = scores.masked_fill(~mask, -1e9).softmax(-1).to(x.dtype)
            x = x + (attn @ heads(v)).transpose(1, 2).reshape(b, t, DIM) @ layer["out"]
            x = x + torch.nn.functional.gelu(norm(x, layer["ln2"]) @ layer["up"]) @ layer["down"]
        return (norm(x, p["ln"]) @ p["head"]).float()

    results = {}
    for name, dtype, opt_cls in (
        ("float32", torch.float32, torch.optim.AdamW),
        ("bfloat16", torch.bfloat16, torch.optim.AdamW),
        ("torchao stochastic rounding", torch.bfloat16, _AdamW),
    ):
        torch.manual_seed(seed)
        p = jax.tree.map(lambda x: x.detach().clone().to(dtype).requires_grad_(), ref)  # noqa: B023
        leaves = jax.tree.leaves(p)
        kwargs = {"bf16_stochastic_round": True} if opt_cls is _AdamW else {}
        opt = opt_cls(leaves, lr=lr, weight_decay=0.01, **kwargs)
        lrs = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: factors[min(i, steps)])  # noqa: B023
        losses = []
        for batch in batches:
            logits = forward_t(p, batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            lrs.step()
            losses.append(loss.item())
        results[name] = float(np.mean(losses[-20:]))
    return results


def table(results: dict[str, dict[str, Any]]) -> str:
    ref = results["float32"]["final"]
    head = f"{'variant':36s} {'final loss':>10s} {'vs float32':>10s} {'params':>6s} {'moments':>7s} {'master':>6s} {'comp.':>5s} {'total':>5s}"
    rows = [head]
    for name, r in results.items():
        b = r["bytes"]
        rows.append(
            f"{name:36s} {r['final']:10.4f} {r['final'] / ref:10.3f} {b['params']:6.0f} {b['moments']:7.0f} "
            f"{b['master copy']:6.0f} {b['compensation']:5.0f} {sum(b.values()):5.0f}"
        )
    return "\n".join(rows)


def plot(results: dict[str, dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, diff) = plt.subplots(1, 2, figsize=(11, 4.2))
    ref = results["float32"]["losses"]
    for name, r in results.items():
        style = "--" if name == "bfloat16" else "-"
        smooth = np.convolve(r["losses"], np.ones(10) / 10, mode="valid")
        ax.plot(np.arange(len(smooth)) + 10, smooth, style, label=f"{name} ({r['final']:.4f})", lw=1.3)
        gap = np.convolve(r["losses"] - ref, np.ones(25) / 25, mode="valid")
        diff.plot(np.arange(len(gap)) + 25, gap, style, label=name, lw=1.3)
    low = min(r["final"] for r in results.values())
    ax.set_ylim(low - 0.1, low + 1.0)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (10-step mean)")
    ax.set_title("bfloat16 params: final loss in brackets")
    ax.legend(fontsize=8)
    diff.axhline(0.0, color="black", lw=0.6)
    diff.set_xlabel("step")
    diff.set_ylabel("loss minus the float32 run's (25-step mean)")
    diff.set_title("distance from float32")
    for a in (ax, diff):
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--plot", default=None, help="write the loss curves to this PNG")
    parser.add_argument("--torch", action="store_true", help="also train the same model in torch and torchao")
    args = parser.parse_args()
    results = run_all(args.steps)
    print(table(results))
    if args.plot:
        plot(results, args.plot)
    if args.torch:
        t = run_torch(args.steps)
        ref = t["float32"]
        print("\ntorch (same model and data):")
        for name, final in t.items():
            print(f"{name:36s} {final:10.4f} {final / ref:10.3f}")


if __name__ == "__main__":
    main()
