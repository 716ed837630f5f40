"""A flax linen model under fmp, with a per-module override and the ``fmp.explain`` table.

linen opens a ``jax.named_scope`` per module, so ``overrides={"LayerNorm": "float32"}`` keeps every op inside
a LayerNorm in float32 while the rest follows the policy. ``fmp.explain`` prints which dtype each op runs in.

    python examples/flax_linen.py [--steps 200] [--fast]
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import fmp
import fmp.optax


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(64)(x)
        h = nn.LayerNorm()(h)
        return nn.Dense(4)(nn.gelu(h))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    p.add_argument("--fast", action="store_true", help="40 steps (what the test suite runs)")
    args = p.parse_args(argv)
    steps = 40 if args.fast else args.steps

    model = Block()
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (256, 16), jnp.float32)
    y = jnp.argmax(x @ jax.random.normal(kw, (16, 4), jnp.float32), -1)
    params = model.init(jax.random.key(0), x)

    def loss_fn(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()

    overrides = {"LayerNorm": "float32"}
    report = fmp.explain(loss_fn, "mixed_bfloat16", overrides=overrides)(params, x, y)
    print(report)
    in_norm = [r for r in report.records if "LayerNorm" in r.scope and r.category != "cast"]
    dots = [r for r in report.records if r.op == "dot_general"]
    norm_dtypes = sorted({d for r in in_norm for d in r.out_after})
    print(f"ops inside LayerNorm: {len(in_norm)}, output dtypes {norm_dtypes}; "
          f"dot_general outputs {sorted({d for r in dots for d in r.out_after})}")  # fmt: skip
    fn = fmp.autocast(loss_fn, "mixed_bfloat16", overrides=overrides)
    tx = fmp.optax.skip_nonfinite(optax.adam(1e-2))  # bfloat16 needs no loss scale; still never take a NaN step
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    for i in range(steps):
        params, opt_state, loss = step(params, opt_state)
        if i % max(1, steps // 4) == 0:
            print(f"step {i:4d}  loss {float(loss):.4f}")
    acc = float(jnp.mean(jnp.argmax(model.apply(params, x), -1) == y))
    print(f"final loss {float(loss):.4f}; train accuracy {100 * acc:.1f}%")


if __name__ == "__main__":
    with jax.numpy_dtype_promotion("standard"):  # optax.adam mixes dtypes in its bias correction
        main()
