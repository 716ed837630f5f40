"""A flax NNX model under fmp: split the module, autocast the pure loss, train with ``loss_scaled``.

NNX modules are stateful Python objects; ``nnx.split`` turns one into a static graph definition and a
pytree of parameters, and ``nnx.merge`` rebuilds it inside the loss. The loss is then an ordinary pure
function of the parameters, which ``fmp.autocast`` rewrites like any other.

    python examples/flax_nnx.py [--steps 200] [--fast]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import fmp
import fmp.optax


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(16, 64, rngs=rngs)
        self.norm = nnx.LayerNorm(64, rngs=rngs)
        self.l2 = nnx.Linear(64, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.gelu(self.norm(self.l1(x))))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    p.add_argument("--policy", default="mixed_float16", help="fmp policy (default mixed_float16)")
    p.add_argument("--fast", action="store_true", help="40 steps (what the test suite runs)")
    args = p.parse_args(argv)
    steps = 40 if args.fast else args.steps

    graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (256, 16), jnp.float32)
    y = jnp.argmax(x @ jax.random.normal(kw, (16, 4), jnp.float32), -1)

    def loss_fn(params, x, y):
        logits = nnx.merge(graphdef, params)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    report = fmp.explain(loss_fn, args.policy)(params, x, y)
    print(f"explain: {100 * report.summary['low_precision_flop_share']:.0f}% of FLOPs in low precision, "
          f"{report.summary['float32_islands']} float32 islands")  # fmt: skip

    fn = fmp.autocast(loss_fn, args.policy)
    opt = fmp.optax.loss_scaled(optax.adam(1e-2))
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state):
        scaler = fmp.optax.current_scaler(opt_state)
        loss, grads = jax.value_and_grad(lambda p: scaler.scale(fn(p, x, y)))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss / scaler.loss_scale

    for i in range(steps):
        params, opt_state, loss = step(params, opt_state)
        if i % max(1, steps // 4) == 0:
            print(f"step {i:4d}  loss {float(loss):.4f}")
    acc = float(jnp.mean(jnp.argmax(nnx.merge(graphdef, params)(x), -1) == y))
    print(
        f"final loss {float(loss):.4f}; train accuracy {100 * acc:.1f}%; skipped steps {int(opt_state.skipped_steps)}"
    )
    model = nnx.merge(graphdef, params)  # back to a stateful module with the trained float32 params
    print(f"model param dtype: {model.l1.kernel[...].dtype}")


if __name__ == "__main__":
    with jax.numpy_dtype_promotion("standard"):  # optax.adam mixes dtypes in its bias correction
        main()
