"""The torch facade's GradScaler and ShardedGradScaler: state, found-inf checks, messages and the torch array ops for the shared update rule."""
