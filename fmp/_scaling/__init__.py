"""Loss scaling for JAX: the GradScaler pytree, its array ops, checkpoints, finite checks, value_and_grad and scale health."""
