"""Float8 training against bfloat16: a digits MLP classifier and a small pre-LN transformer, every recipe.

Each model is trained from the same initial parameters on the same batches with Adam, once under
``mixed_bfloat16`` and once per float8 recipe (``tensorwise``, ``rowwise``, ``blockwise`` and ``delayed``
through an ``fmp.Float8State``). Prints, per run, the final loss (evaluated in float32 at the final parameters:
the whole training set for the MLP, 256 held-out sequences for the transformer) and its relative difference
to bfloat16's, and the mean and largest per-step relative difference of the batch loss;
writes the curves to ``float8_training.png`` in the output folder.

    python examples/float8_training.py --out docs/assets
    python examples/float8_training.py --models transformer --recipes float32,tensorwise --no-plot
    python examples/float8_training.py --models mlp --seeds 0,1,2,3,4,5,6,7   # final losses over seeds
"""

from __future__ import annotations

import argparse
import json
import sys
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fmp  # noqa: E402
import fmp.optax  # noqa: E402

RECIPES = ("tensorwise", "rowwise", "blockwise", "delayed")  # "float32" also accepted: the no-autocast noise floor


class MLP(nn.Module):
    """A classifier of scikit-learn's digits: 64 -> 256 -> 256 -> 256 -> 10, GELU."""

    width: int = 256
    depth: int = 3

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for _ in range(self.depth):
            x = nn.gelu(nn.Dense(self.width)(x))
        return nn.Dense(10)(x)


def load_data(seed: int) -> tuple[np.ndarray, ...]:
    """Digits (1797 8x8 images), scaled to [0, 1], split 75/25 stratified: ``(x_tr, x_te, y_tr, y_te)``."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    return tuple(train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(LN(x)), x + mlp(LN(x))."""

    d: int
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(self.heads)(h, h, mask=nn.make_causal_mask(x[..., 0]))
        h = nn.LayerNorm()(x)
        return x + nn.Dense(self.d)(nn.gelu(nn.Dense(4 * self.d)(h)))


class Transformer(nn.Module):
    vocab: int = 64
    d: int = 64
    heads: int = 4
    depth: int = 2
    seq: int = 32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(self.vocab, self.d)(tokens) + self.param("pos", nn.initializers.normal(0.02), (self.seq, self.d))
        for _ in range(self.depth):
            x = Block(self.d, self.heads)(x)
        return nn.Dense(self.vocab, name="lm_head")(nn.LayerNorm()(x))


def markov_tokens(rng: np.random.Generator, n: int, seq: int, vocab: int) -> np.ndarray:
    """Sequences from a fixed sparse random Markov chain: learnable, not trivial."""
    table = np.random.default_rng(0).dirichlet(np.full(vocab, 0.1), size=vocab)
    out = np.empty((n, seq), np.int32)
    out[:, 0] = rng.integers(0, vocab, n)
    for t in range(1, seq):
        cum = table[out[:, t - 1]].cumsum(-1)
        out[:, t] = np.minimum((cum < rng.random((n, 1))).sum(-1), vocab - 1)
    return out


def tasks(args) -> dict[str, dict[str, Any]]:
    x_tr, _, y_tr, _ = load_data(args.seed)
    rng = np.random.default_rng(args.seed)
    mlp_batches = [rng.choice(len(x_tr), 128, replace=False) for _ in range(args.mlp_steps)]
    mlp = MLP()
    tf = Transformer()
    toks = markov_tokens(rng, args.tf_steps * 16, tf.seq, tf.vocab).reshape(args.tf_steps, 16, tf.seq)
    held_out = markov_tokens(np.random.default_rng(args.seed + 1), 256, tf.seq, tf.vocab)

    def mlp_loss(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(mlp.apply(params, x), y).mean()

    def tf_loss(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(tf.apply(params, x)[:, :-1], y[:, 1:]).mean()

    return {
        "mlp": {
            "loss": mlp_loss,
            "init": mlp.init(jax.random.PRNGKey(args.seed), jnp.zeros((1, 64))),
            "batches": [(x_tr[b], y_tr[b]) for b in mlp_batches],
            "eval": (x_tr, y_tr),  # the whole training set
            "lr": 1e-3,
        },
        "transformer": {
            "loss": tf_loss,
            "init": tf.init(jax.random.PRNGKey(args.seed), jnp.zeros((1, tf.seq), jnp.int32)),
            "batches": [(t, t) for t in toks],
            "eval": (held_out, held_out),
            "lr": 3e-3,
        },
    }


def policy_for(
    recipe: str | None, keep: tuple[str, ...] = (), pow2: bool = True
) -> tuple[str | fmp.Policy, dict[str, str] | None]:
    """The policy of a run (``None``: bfloat16; ``"float32"``: no autocast) and its bf16 opt-outs; ``pow2=False``
    gives a float8 recipe the exact scales ``fp8_max / amax`` instead of powers of two."""
    policy = {None: "mixed_bfloat16", "float32": "float32"}.get(recipe)
    if policy is None:
        policy = fmp.Policy("f32", "bf16", "f32", float8=fmp.Float8Recipe(recipe, pow2_scales=pow2))
    over = {k: "mixed_bfloat16" for k in keep} if keep and recipe not in (None, "float32") else None
    return policy, over


def make_step(task: dict[str, Any], recipe: str | None, keep: tuple[str, ...] = (), pow2: bool = True):
    """``(optimizer, state, step)``: one Adam step under the run's policy; ``state`` is the Float8State of
    ``delayed`` (else None), and ``step(params, opt_state, state, x, y) -> (params, opt_state, state, loss)``."""
    tx = optax.adam(task["lr"])
    policy, over = policy_for(recipe, keep, pow2)
    x0, y0 = map(jnp.asarray, task["batches"][0])
    state = (
        fmp.float8_state(task["loss"], policy, overrides=over)(task["init"], x0, y0) if recipe == "delayed" else None
    )

    def step(params, opt_state, state, x, y):
        if state is None:
            loss, grads = jax.value_and_grad(fmp.autocast(task["loss"], policy, overrides=over))(params, x, y)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, state, loss
        fn = lambda p, s: fmp.autocast(task["loss"], policy, overrides=over, float8_state=s)(p, x, y)  # noqa: E731
        loss, grads = jax.value_and_grad(fn, argnums=(0, 1))(params, state)
        return (*fmp.optax.float8_step(tx, grads, opt_state, params, state), loss)

    return tx, state, step


def train(task: dict[str, Any], recipe: str | None, keep: tuple[str, ...] = (), pow2: bool = True) -> dict[str, Any]:
    """Trains one model under ``mixed_bfloat16`` (recipe None) or a float8 recipe; returns the loss curve."""
    tx, state, step = make_step(task, recipe, keep, pow2)
    params = task["init"]
    opt_state = tx.init(params)
    step = jax.jit(step)
    t0 = time.perf_counter()
    losses = []
    for x, y in task["batches"]:
        params, opt_state, state, loss = step(params, opt_state, state, jnp.asarray(x), jnp.asarray(y))
        losses.append(loss)
    losses = np.asarray(jax.device_get(losses), np.float64)
    seconds = time.perf_counter() - t0
    final = float(jax.jit(task["loss"])(params, *map(jnp.asarray, task["eval"])))  # float32, no autocast
    return {"recipe": recipe or "bfloat16", "loss": losses, "final": final, "seconds": seconds}


def train_seeds(
    per_seed: list[dict[str, Any]], recipe: str | None, keep: tuple[str, ...] = (), pow2: bool = True
) -> np.ndarray:
    """Final losses of one run per seed (same model, shapes and policy), as one program: ``vmap`` over the
    seeds of a ``scan`` over the steps. Each seed's run is the run ``train`` makes, batched."""
    tx, state, step = make_step(per_seed[0], recipe, keep, pow2)
    stack = lambda *xs: jnp.stack([jnp.asarray(x) for x in xs])  # noqa: E731
    params = jax.tree.map(stack, *[t["init"] for t in per_seed])
    xs, ys = (stack(*[stack(*[b[i] for b in t["batches"]]) for t in per_seed]) for i in (0, 1))
    ex, ey = (stack(*[t["eval"][i] for t in per_seed]) for i in (0, 1))

    def one_seed(params, xs, ys, ex, ey):
        def body(carry, batch):
            *carry, _ = step(*carry, *batch)
            return tuple(carry), None

        (params, _, _), _ = jax.lax.scan(body, (params, tx.init(params), state), (xs, ys))
        return per_seed[0]["loss"](params, ex, ey)  # float32, no autocast

    return np.asarray(jax.jit(jax.vmap(one_seed))(params, xs, ys, ex, ey), np.float64)


def compare(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Final loss (in float32 at the final parameters, on the evaluation data) and per-step relative difference
    of the batch loss to the bfloat16 run."""
    ref = runs[0]["loss"]
    ref_final = runs[0]["final"]
    rows = []
    for r in runs:
        rel = np.abs(r["loss"] - ref) / np.abs(ref)
        final = r["final"]
        rows.append(
            {
                "recipe": r["recipe"],
                "final_loss": final,
                "final_rel_diff": abs(final - ref_final) / ref_final,
                "step_rel_diff_mean": float(rel.mean()),
                "step_rel_diff_max": float(rel.max()),
                "seconds": r["seconds"],
            }
        )
    return rows


def plot(results: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(6 * len(results), 7), sharex="col")
    for col, (name, runs) in enumerate(results.items()):
        ref = runs[0]["loss"]
        for i, r in enumerate(runs):
            axes[0, col].plot(r["loss"], label=r["recipe"], lw=1, color=f"C{i}")
            if i:
                axes[1, col].plot(100 * (r["loss"] - ref) / ref, label=r["recipe"], lw=0.8, color=f"C{i}")
        axes[0, col].set(title=f"{name}: training loss", yscale="log")
        axes[1, col].set(title="relative difference to bfloat16 (%)", xlabel="step")
        axes[0, col].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def over_seeds(args: argparse.Namespace, recipes: list[str], seeds: list[int]) -> dict[str, dict[str, list[float]]]:
    """Final losses per model and policy, one run per seed (initial parameters, batches and data split);
    prints each policy's mean, the relative difference of the means to bfloat16's with its standard error
    (paired by seed), and the largest per-seed relative difference."""
    per_seed = [tasks(argparse.Namespace(**{**vars(args), "seed": s})) for s in seeds]
    keep = tuple(k for k in args.keep_bf16.split(",") if k)
    finals: dict[str, dict[str, list[float]]] = {}
    for name in args.models.split(","):
        runs = [t[name] for t in per_seed]
        finals[name] = {
            r or "bfloat16": train_seeds(runs, r, keep, not args.exact_scales).tolist() for r in [None, *recipes]
        }
    for name, by_policy in finals.items():
        ref = np.asarray(by_policy["bfloat16"])
        print(f"\n{name}: final loss over seeds {seeds}")
        print(f"{'policy':<11} {'mean':>8} {'means vs bf16':>14} {'paired s.e.':>12} {'largest per-seed diff':>22}")
        for policy, vals in by_policy.items():
            v = np.asarray(vals)
            rel = (v - ref) / ref
            se = rel.std(ddof=1) / np.sqrt(len(rel)) if len(rel) > 1 else float("nan")
            print(
                f"{policy:<11} {v.mean():>8.4f} {(v.mean() - ref.mean()) / ref.mean():>+14.2%} {se:>12.2%} "
                f"{np.max(np.abs(rel)):>22.2%}"
            )
    if args.json:
        print(json.dumps(finals))
    return finals


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mlp-steps", type=int, default=150)
    p.add_argument("--tf-steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--models", default="mlp,transformer")
    p.add_argument("--keep-bf16", default="", help="comma-separated name scopes kept in bf16, e.g. Dense_3,lm_head")
    p.add_argument("--exact-scales", action="store_true", help="float8 scales fp8_max / amax, not powers of two")
    p.add_argument("--out", default=".")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON (one line)")
    p.add_argument("--seeds", default="", help="comma-separated seeds: only final losses, one run per seed")
    args = p.parse_args(argv)
    recipes = [r for r in args.recipes.split(",") if r]
    if args.seeds:
        over_seeds(args, recipes, [int(s) for s in args.seeds.split(",")])
        return {}
    results, table = {}, {}
    for name, task in tasks(args).items():
        if name not in args.models.split(","):
            continue
        keep = tuple(k for k in args.keep_bf16.split(",") if k)
        results[name] = [train(task, None)] + [train(task, r, keep, not args.exact_scales) for r in recipes]
        table[name] = compare(results[name])
        if not args.json:
            print(f"\n{name}: {len(task['batches'])} steps")
            print(f"{'recipe':<11} {'final loss':>10} {'vs bf16':>8} {'step diff mean':>15} {'max':>8} {'s':>6}")
            for row in table[name]:
                print(
                    f"{row['recipe']:<11} {row['final_loss']:>10.4f} {row['final_rel_diff']:>8.2%} "
                    f"{row['step_rel_diff_mean']:>15.2%} {row['step_rel_diff_max']:>8.2%} {row['seconds']:>6.1f}"
                )
    if args.json:
        print(json.dumps(table))
    if not args.no_plot:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        plot(results, Path(args.out) / "float8_training.png")
    return results


if __name__ == "__main__":
    main()
