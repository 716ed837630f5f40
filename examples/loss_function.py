"""Wrap a loss function: ``fmp.autocast`` + ``fmp.value_and_grad`` + ``fmp.select_tree`` in a jitted step.

A linear least-squares model trained with plain SGD in float16 autocast with a dynamic loss scale. The first
steps overflow at torch's initial scale (2**16) and are skipped while the scale backs off; then it trains.

    python examples/loss_function.py [--steps 200] [--fast]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import fmp


def loss_fn(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


@jax.jit
def train_step(params, scaler, x, y):
    loss, grads, finite, scaler = fmp.value_and_grad(fmp.autocast(loss_fn, "mixed_float16"), scaler)(params, x, y)
    new = jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)
    return fmp.select_tree(finite, new, params), scaler, loss, finite


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    p.add_argument("--fast", action="store_true", help="50 steps (what the test suite runs)")
    args = p.parse_args(argv)
    steps = 50 if args.fast else args.steps

    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (256, 16), jnp.float32)
    y = x @ jax.random.normal(kw, (16, 1), jnp.float32)
    params = {"w": jnp.zeros((16, 1), jnp.float32), "b": jnp.zeros((1,), jnp.float32)}
    scaler = fmp.GradScaler()

    skipped = 0
    for i in range(steps):
        params, scaler, loss, finite = train_step(params, scaler, x, y)
        skipped += int(not finite)
        if i % max(1, steps // 5) == 0:
            print(f"step {i:4d}  loss {float(loss):.5f}  scale {float(scaler.loss_scale):g}  finite {bool(finite)}")
    print(f"final loss {float(loss):.5f}; skipped {skipped} of {steps} steps; final scale {float(scaler.loss_scale):g}")
    print(f"params dtype: {params['w'].dtype} (float32 params, float16 matmuls)")


if __name__ == "__main__":
    main()
