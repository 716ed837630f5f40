"""Many devices: a data-parallel, loss-scaled float16 step on 8 devices (fake CPU devices here).

Under ``jax.jit`` with sharded arrays nothing else is needed: the finite check in ``fmp.value_and_grad`` reduces
over the global gradients, so every device sees the same flag and skips (or takes) the step together, and the
scaler stays replicated. This script sets ``XLA_FLAGS`` itself, before importing JAX, to get 8 CPU devices.

    python examples/sharding.py [--steps 100] [--fast]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import fmp  # noqa: E402


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["w1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100, help="training steps (default 100)")
    p.add_argument("--fast", action="store_true", help="30 steps (what the test suite runs)")
    args = p.parse_args(argv)
    steps = 30 if args.fast else args.steps

    devices = jax.devices()
    print(f"{len(devices)} devices: {devices[0].platform}")
    mesh = jax.make_mesh((len(devices),), ("data",))
    data = NamedSharding(mesh, PartitionSpec("data"))  # batch split over the devices
    replicated = NamedSharding(mesh, PartitionSpec())

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.device_put(jax.random.normal(k1, (1024, 32), jnp.float32), data)
    y = jax.device_put(jnp.sin(x @ jax.random.normal(k2, (32, 1), jnp.float32)), data)
    params = jax.device_put({"w1": 0.2 * jax.random.normal(k3, (32, 64)), "w2": jnp.zeros((64, 1))}, replicated)
    scaler = jax.device_put(fmp.GradScaler(growth_interval=10), replicated)

    @jax.jit
    def step(params, scaler, x, y):
        loss, grads, finite, scaler = fmp.value_and_grad(fmp.autocast(loss_fn, "mixed_float16"), scaler)(params, x, y)
        new = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return fmp.select_tree(finite, new, params), scaler, loss, finite

    skipped = 0
    for i in range(steps):
        params, scaler, loss, finite = step(params, scaler, x, y)
        skipped += int(not finite)
        if i % max(1, steps // 3) == 0:
            print(f"step {i:4d}  loss {float(loss):.5f}  scale {float(scaler.loss_scale):g}")
    print(f"x sharding: {x.sharding.spec}; params sharding: {params['w1'].sharding.spec}; "
          f"scaler sharding: {scaler.loss_scale.sharding.spec}")  # fmt: skip
    print(f"final loss {float(loss):.5f}; skipped {skipped} of {steps}; final scale {float(scaler.loss_scale):g}")


if __name__ == "__main__":
    main()
