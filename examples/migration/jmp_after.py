"""The jmp loop of jmp_before.py on fmp: each jmp call has its fmp counterpart, autocast picks
the dtype per op.

The "after" listing of the jmp migration page.

    python examples/migration/jmp_after.py [--steps 200]
"""

import argparse

import jax
import jax.numpy as jnp
import optax

import fmp


def init(key):
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (20, 64)) / jnp.sqrt(20.0),
        "b1": jnp.zeros(64),
        "w2": jax.random.normal(k2, (64, 3)) / 8.0,
        "b2": jnp.zeros(3),
    }


def mlp(params, x):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"]


policy = fmp.get_policy("params=float32,compute=float16,output=float32")
opt = optax.adam(1e-2)


def loss_fn(params, loss_scale, x, y):
    logits = fmp.autocast(mlp, policy)(
        params, x
    )  # matmuls in float16, the rest as the rule table says
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss_scale.scale(loss), loss


@jax.jit
def train_step(params, opt_state, loss_scale, x, y):
    grads, loss = jax.grad(loss_fn, has_aux=True)(params, loss_scale, x, y)
    grads = loss_scale.unscale(grads)
    finite = fmp.all_finite(grads)
    loss_scale = loss_scale.update(finite)
    updates, new_opt_state = opt.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    new, old = (new_params, new_opt_state), (params, opt_state)
    params, opt_state = fmp.select_tree(finite, new, old)
    return params, opt_state, loss_scale, loss


def main(steps: int = 200) -> None:
    kx, kw, kp = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (512, 20))
    y = jnp.argmax(x[:, :3] @ jax.random.normal(kw, (3, 3)), axis=1)  # 3 classes, learnable
    params = init(kp)
    opt_state = opt.init(params)
    loss_scale = fmp.GradScaler(init_scale=2.0**15)
    for step in range(steps):
        batch = slice(64 * (step % 8), 64 * (step % 8 + 1))
        params, opt_state, loss_scale, loss = train_step(
            params, opt_state, loss_scale, x[batch], y[batch]
        )
        if step % 50 == 0:
            print(
                f"step {step:3d}  loss {float(loss):.4f}  "
                f"scale {float(loss_scale.loss_scale):g}"
            )
    accuracy = float(jnp.mean(jnp.argmax(mlp(params, x), axis=1) == y))
    print(
        f"final loss {float(loss):.4f}; train accuracy {100 * accuracy:.1f}%; "
        f"params {params['w1'].dtype}"
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=200)
    main(p.parse_args().steps)
