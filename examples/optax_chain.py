"""An optax chain under ``fmp.optax.loss_scaled``: clipping and AdamW see unscaled gradients.

``loss_scaled(inner)`` unscales the gradients of the scaled loss, checks them with one reduction, applies
``inner`` only on finite steps (zero updates otherwise, ``inner``'s state untouched) and updates the scale.
Everything that keeps state or looks at gradient norms (clipping) goes *inside* it. Gradient accumulation with
``optax.MultiSteps`` is in ``examples/accumulation.py``.

    python examples/optax_chain.py [--steps 300] [--fast]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax

import fmp
import fmp.optax


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--fast", action="store_true", help="60 steps (what the test suite runs)")
    args = p.parse_args(argv)
    steps = 60 if args.fast else args.steps

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k1, (512, 32), jnp.float32)
    y = jnp.tanh(x @ jax.random.normal(k2, (32, 1), jnp.float32))
    params = {
        "w1": 0.1 * jax.random.normal(k3, (32, 64), jnp.float32),
        "w2": jnp.zeros((64, 1), jnp.float32),
    }

    @fmp.autocast(policy="mixed_float16")
    def loss_fn(params, x, y):
        h = jax.nn.relu(x @ params["w1"])
        return jnp.mean((h @ params["w2"] - y) ** 2)

    opt = fmp.optax.loss_scaled(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, weight_decay=1e-4)),
        fmp.GradScaler(growth_interval=50),
    )
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        scaler = fmp.optax.current_scaler(opt_state)
        loss, grads = jax.value_and_grad(lambda p: scaler.scale(loss_fn(p, x, y)))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss / scaler.loss_scale

    for i in range(steps):
        params, opt_state, loss = step(params, opt_state, x, y)
        if i % max(1, steps // 5) == 0:
            print(
                f"step {i:4d}  loss {float(loss):.5f}  scale {float(fmp.optax.current_scaler(opt_state).loss_scale):g}"
            )
    state = opt_state  # the LossScaledState
    print(
        f"final loss {float(loss):.5f}; skipped steps {int(state.skipped_steps)}; "
        f"final scale {float(fmp.optax.current_scaler(state).loss_scale):g}"
    )


if __name__ == "__main__":
    # optax.adamw's bias correction mixes dtypes, which JAX's default (standard) promotion allows
    with jax.numpy_dtype_promotion("standard"):
        main()
