"""The flax loop of flax_before.py with ``fmp.GradScaler`` in place of ``DynamicScale``.

The "after" listing of the flax migration page: the scaler, its call and the skip change,
nothing else.

    python examples/migration/flax_after.py [--steps 200]
"""

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import fmp


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64, dtype=jnp.float16)(x))  # float32 params, float16 compute
        return nn.Dense(3, dtype=jnp.float16)(x)


class TrainState(train_state.TrainState):
    scaler: fmp.GradScaler


@jax.jit
def train_step(state, x, y):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), y
        ).mean()

    loss, grads, finite, scaler = fmp.value_and_grad(loss_fn, state.scaler)(state.params)
    new_state = state.apply_gradients(grads=grads)
    # skip the step if the grads hold inf/NaN
    new_state = new_state.replace(
        params=fmp.select_tree(finite, new_state.params, state.params),
        opt_state=fmp.select_tree(finite, new_state.opt_state, state.opt_state),
        scaler=scaler,
    )
    return new_state, loss


def main(steps: int = 200) -> None:
    kx, kw, kp = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (512, 20))
    y = jnp.argmax(x[:, :3] @ jax.random.normal(kw, (3, 3)), axis=1)  # 3 classes, learnable
    model = MLP()
    state = TrainState.create(
        apply_fn=model.apply,
        params=model.init(kp, x[:1])["params"],
        tx=optax.adam(1e-2),
        scaler=fmp.GradScaler(),
    )
    for step in range(steps):
        batch = slice(64 * (step % 8), 64 * (step % 8 + 1))
        state, loss = train_step(state, x[batch], y[batch])
        if step % 50 == 0:
            print(
                f"step {step:3d}  loss {float(loss):.4f}  "
                f"scale {float(state.scaler.loss_scale):g}"
            )
    logits = model.apply({"params": state.params}, x)
    accuracy = float(jnp.mean(jnp.argmax(logits, axis=1) == y))
    print(f"final loss {float(loss)!r}; train accuracy {100 * accuracy:.1f}%")


if __name__ == "__main__":
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=200)
    main(p.parse_args().steps)
