"""``scaler_stats``: the loss scale and the skip counters of an optimizer state, as Python numbers, on any process."""

from __future__ import annotations

import jax
import optax

from fmp.optax._loss_scaled import MSG_NO_SCALER, find_states

_MSG_NOT_READABLE = (
    "scaler_stats(opt_state): {name} is a global array that is neither replicated nor held whole by this "
    "process (sharding {sharding}); the scaler state of one step is a replicated scalar. Keep it replicated: "
    "jax.device_put(opt_state, NamedSharding(mesh, PartitionSpec())), and leave it out of shard_map's "
    "per-device outputs; to inspect a sharded array, gather it with "
    "jax.experimental.multihost_utils.process_allgather(x, tiled=True) on every process."
)


def scaler_stats(opt_state: optax.OptState) -> dict[str, float | int]:
    """Reads the loss scale and the skip counters of a `fmp.optax.loss_scaled` state in one host transfer.

    For logging outside ``jit``. Under ``jax.distributed`` the scaler state is a replicated global array:
    every process holds the whole value, so this works on each process without any communication and
    returns the same numbers everywhere; print them on one process (``jax.process_index() == 0``).

    Args:
      opt_state: An optimizer state holding exactly one ``loss_scaled`` state, nested anywhere (a chain,
        ``fmp.optax.accumulate``, ``fmp.optax.master_weights``, ``MultiSteps``).

    Returns:
      ``{"loss_scale": float, "skipped_steps": int, "consecutive_skipped": int}``: the scale the next loss
      is multiplied by, the total of skipped (non-finite) steps and the length of the current run of them.

    Raises:
      ValueError: there is no ``loss_scaled`` state or more than one, or a counter is a global array that
        this process cannot read whole (sharded over devices of other processes).

    Examples:
      >>> import optax
      >>> import fmp.optax
      >>> opt = fmp.optax.loss_scaled(optax.sgd(0.1), fmp.GradScaler(init_scale=8.0))
      >>> state = opt.init(jnp.zeros(2))
      >>> _, state = opt.update(jnp.array([jnp.inf, 1.0]), state, jnp.zeros(2))
      >>> fmp.optax.scaler_stats(state)
      {'loss_scale': 4.0, 'skipped_steps': 1, 'consecutive_skipped': 1}
      >>> if jax.process_index() == 0:  # log once, not once per process
      ...     print("scale {loss_scale:g}, skipped {skipped_steps}".format(**fmp.optax.scaler_stats(state)))
      scale 4, skipped 1
    """
    found = find_states(opt_state)
    if len(found) != 1:
        raise ValueError(MSG_NO_SCALER if not found else f"opt_state holds {len(found)} loss_scaled states")
    st = found[0]
    leaves = {"loss_scale": st.scaler.loss_scale, "skipped_steps": st.skipped_steps,
              "consecutive_skipped": st.consecutive_skipped}  # fmt: skip
    for name, x in leaves.items():
        if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
            raise ValueError(_MSG_NOT_READABLE.format(name=name, sharding=x.sharding))
    values = jax.device_get(leaves)
    return {"loss_scale": float(values["loss_scale"]), "skipped_steps": int(values["skipped_steps"]),
            "consecutive_skipped": int(values["consecutive_skipped"])}  # fmt: skip
