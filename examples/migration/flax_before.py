"""A flax training loop with ``DynamicScale``: a float16 model, a dynamic loss scale, non-finite
steps skipped.

The "before" listing of the flax migration page (the pattern of flax's ImageNet example);
``flax_after.py`` is the same loop with ``fmp.GradScaler`` in place of ``DynamicScale``.

    python examples/migration/flax_before.py [--steps 200]
"""

import argparse
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state
from flax.training.dynamic_scale import DynamicScale


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64, dtype=jnp.float16)(x))  # float32 params, float16 compute
        return nn.Dense(3, dtype=jnp.float16)(x)


class TrainState(train_state.TrainState):
    dynamic_scale: DynamicScale


@jax.jit
def train_step(state, x, y):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), y
        ).mean()

    grad_fn = state.dynamic_scale.value_and_grad(loss_fn)
    dynamic_scale, finite, loss, grads = grad_fn(state.params)
    new_state = state.apply_gradients(grads=grads)
    # skip the step if the grads hold inf/NaN
    keep_if_finite = functools.partial(jnp.where, finite)
    new_state = new_state.replace(
        params=jax.tree.map(keep_if_finite, new_state.params, state.params),
        opt_state=jax.tree.map(keep_if_finite, new_state.opt_state, state.opt_state),
        dynamic_scale=dynamic_scale,
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
        dynamic_scale=DynamicScale(),
    )
    for step in range(steps):
        batch = slice(64 * (step % 8), 64 * (step % 8 + 1))
        state, loss = train_step(state, x[batch], y[batch])
        if step % 50 == 0:
            print(
                f"step {step:3d}  loss {float(loss):.4f}  "
                f"scale {float(state.dynamic_scale.scale):g}"
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
