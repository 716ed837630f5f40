"""Higher-order primitives under autocast: scan, while, cond, remat, pjit, custom derivatives, shard_map, and jnp helper calls."""
