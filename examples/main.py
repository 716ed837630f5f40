"""fmp's main job (placeholder until the training run lands): a short working demo.

Shows a policy parsed from a string, which dtype each kind of op runs in under
the shared rule table, and a parameter tree cast for the forward pass.

    python examples/main.py
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import fmp


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="mixed_bfloat16", help="policy spec, e.g. 'p=f32,c=bf16,o=f32'")
    args = parser.parse_args(argv)

    policy = fmp.get_policy(args.policy)
    print(f"policy: {policy}")
    rules = fmp.DEFAULT_RULES
    print(f"rule table: {rules}")
    for op in ("dot_general", "conv_general_dilated", "exp", "reduce_sum", "add", "tanh"):
        print(f"  {op:<22} {rules.category(op).value}")
    params = {"w": jnp.ones((4, 4)), "b": jnp.zeros(4), "step": jnp.int32(0), "key": jax.random.key(0)}
    cast = policy.cast_to_compute(params)
    print("params cast for the forward pass:")
    for name, leaf in cast.items():
        print(f"  {name:<5} {params[name].dtype} -> {leaf.dtype}")


if __name__ == "__main__":
    main()
