"""One of the JAX processes of ``tests/scaling/test_jax_multiprocess.py`` (2 processes x 4 CPU devices on localhost).

Run as ``python tests/scaling/_jax_multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT CHECKPOINT_DIR`` with
``XLA_FLAGS=--xla_force_host_platform_device_count=4``. Every scenario runs on one global mesh of 8 devices; a
fault (an inf in a batch row, or in a gradient) lives on process 1 only. The process prints one line,
``RESULT {json}``: skip decisions, scales and a digest of the raw bytes of every global array it ends with
(gathered with ``process_allgather``), which the test compares across processes and with a reference that
the process computes alone, on one local device.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
from functools import partial

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_numpy_dtype_promotion", "strict")

PID, NPROC, PORT, CKPT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.distributed.initialize(f"127.0.0.1:{PORT}", num_processes=NPROC, process_id=PID, initialization_timeout=60)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fmp  # noqa: E402
import fmp.optax  # noqa: E402

MESH = jax.make_mesh((jax.device_count(),), ("d",), axis_types=(jax.sharding.AxisType.Auto,))  # XLA places collectives
REP, ROWS, COLS = NamedSharding(MESH, P()), NamedSharding(MESH, P("d")), NamedSharding(MESH, P(None, "d"))
BATCH, STEPS = 32, 6
BAD = {2, 4}  # steps whose batch holds an inf in a row that only the last process feeds
out: dict = {"devices": jax.device_count(), "local_devices": jax.local_device_count()}


def digest(tree) -> str:
    """sha256 of the raw bytes of every leaf, gathered to every process (equal digests: bit-identical)."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(multihost_utils.process_allgather(tree, tiled=True)):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()[:16]


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of ``step`` (every process can build it; each feeds only its rows)."""
    rng = np.random.default_rng(step)
    x = rng.standard_normal((BATCH, 8)).astype(np.float32)
    y = np.sin(x[:, :2]).astype(np.float32)
    if step in BAD:
        x[BATCH - 1, 3] = np.inf  # the last row belongs to the last process
    return x, y


def global_batch(step: int):
    x, y = batch(step)
    rows = slice(PID * BATCH // NPROC, (PID + 1) * BATCH // NPROC)
    return tuple(jax.make_array_from_process_local_data(ROWS, a[rows]) for a in (x, y))


def init_params(dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w1": 0.3 * jax.random.normal(k1, (8, 16), dtype), "w2": 0.3 * jax.random.normal(k2, (16, 2), dtype)}


def loss_fn(p, x, y):
    h = jnp.tanh(x.astype(p["w1"].dtype) @ p["w1"])
    return jnp.mean(((h @ p["w2"]).astype(jnp.float32) - y) ** 2)


def shard_params(p):  # FSDP-like: w1's columns split over all 8 devices (both processes), w2 replicated
    return {"w1": jax.device_put(p["w1"], COLS), "w2": jax.device_put(p["w2"], REP)}


# 1. fmp.value_and_grad + autocast, data parallel under jit: both processes skip the bad steps together.
def vag_run(dist: bool) -> dict:
    @jax.jit
    def step(p, scaler, x, y):
        _, g, finite, scaler = fmp.value_and_grad(fmp.autocast(loss_fn, "mixed_float16"), scaler)(p, x, y)
        return fmp.select_tree(finite, jax.tree.map(lambda a, b: a - 0.1 * b, p, g), p), scaler, finite

    p, scaler = init_params(), fmp.GradScaler(init_scale=2.0**10, growth_interval=2)
    if dist:
        p, scaler = jax.device_put((p, scaler), REP)
    finite, scales = [], []
    for i in range(STEPS):
        x, y = global_batch(i) if dist else batch(i)
        p, scaler, ok = step(p, scaler, x, y)
        finite.append(bool(ok))
        scales.append(float(scaler.loss_scale))  # replicated: readable on every process
    return {"finite": finite, "scales": scales, "params": p}


# 2. loss_scaled around a clipped AdamW, params sharded across both processes.
def optax_run(dist: bool, opt, params, steps=range(STEPS), state=None) -> dict:
    @jax.jit
    def step(p, st, x, y):
        scaler = fmp.optax.current_scaler(st)
        g = jax.grad(lambda q: scaler.scale(loss_fn(q, x, y)))(p)
        u, st = opt.update(g, st, p)
        return optax.apply_updates(p, u), st

    state = opt.init(params) if state is None else state
    if dist:  # global arrays: w1 sharded over both processes, the rest replicated
        params, state = shard_params(params), jax.device_put(state, REP)
    skipped = []
    for i in steps:
        x, y = global_batch(i) if dist else batch(i)
        params, state = step(params, state, x, y)
        skipped.append(fmp.optax.scaler_stats(state)["skipped_steps"])
    return {"skipped": skipped, "stats": fmp.optax.scaler_stats(state), "params": params, "state": state}


def adamw():
    return fmp.optax.loss_scaled(
        optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)), fmp.GradScaler(init_scale=2.0**10)
    )


def stacked():  # master weights around accumulation around loss scaling, on bfloat16 params
    return fmp.optax.master_weights(fmp.optax.accumulate(fmp.optax.loss_scaled(optax.adamw(1e-2)), 2))


def compare(name: str, dist: dict, ref: dict, keys: tuple[str, ...]) -> None:
    """Records what the test checks: cross-process digests, agreement with the one-device reference."""
    out[name] = {k: dist[k] for k in keys}
    out[name]["digest"] = digest(dist["params"])
    local = jax.tree.map(np.asarray, multihost_utils.process_allgather(dist["params"], tiled=True))
    out[name]["same_as_one_device"] = {k: dist[k] == ref[k] for k in keys}
    out[name]["max_abs_diff_to_one_device"] = max(
        float(np.max(np.abs(a.astype(np.float32) - np.asarray(b).astype(np.float32))))
        for a, b in zip(jax.tree.leaves(local), jax.tree.leaves(ref["params"]), strict=True)
    )


with jax.numpy_dtype_promotion("standard"):  # optax 0.2.8's adam mixes int32 and float32 (see tests/_helpers/common.py)
    compare("value_and_grad", vag_run(True), vag_run(False), ("finite", "scales"))
    full = optax_run(True, adamw(), init_params())
    compare("loss_scaled_adamw", full, optax_run(False, adamw(), init_params()), ("skipped", "stats"))
    bf16 = init_params(jnp.bfloat16)
    compare("master_accumulate", optax_run(True, stacked(), bf16), optax_run(False, stacked(), bf16), ("skipped",))

    # 3. a checkpoint written by both processes (orbax), restored onto the same shardings, resumed bitwise.
    half = optax_run(True, adamw(), init_params(), steps=range(STEPS // 2))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.join(CKPT, "state"), {"params": half["params"], "opt_state": half["state"]})
        ckpt.wait_until_finished()
        target = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
            {"params": half["params"], "opt_state": half["state"]},
        )
        restored = ckpt.restore(os.path.join(CKPT, "state"), target)
    out["checkpoint_shardings_kept"] = [str(a.sharding.spec) for a in jax.tree.leaves(restored["params"])]
    resumed = optax_run(True, adamw(), restored["params"], range(STEPS // 2, STEPS), restored["opt_state"])
    out["checkpoint"] = {
        "resumed_digest": digest((resumed["params"], resumed["state"])),
        "uninterrupted_digest": digest((full["params"], full["state"])),
        "stats": [resumed["stats"], full["stats"]],
    }


# 4. shard_map: per-device gradients, all-reduced, then one device of the last process corrupted after the
# all-reduce. With axis_name every device skips; without it the devices diverge.
def shard_map_run(axis_name) -> dict:
    opt = fmp.optax.loss_scaled(optax.sgd(0.1), fmp.GradScaler(init_scale=1024.0), axis_name=axis_name)
    p = jax.device_put(init_params(), REP)
    st = jax.device_put(opt.init(p), REP)

    @jax.jit
    @partial(jax.shard_map, mesh=MESH, in_specs=(P(), P(), P("d"), P("d"), P("d")), out_specs=(P("d"), P("d")))
    def dp_step(p, st, x, y, poison):
        g = jax.grad(lambda q: fmp.optax.current_scaler(st).scale(loss_fn(q, x, y)))(p)
        g = jax.tree.map(lambda a: jax.lax.pmean(a, "d") * poison[0], g)
        u, st = opt.update(g, st, p)
        new = optax.apply_updates(p, u)
        return new["w1"][None], fmp.optax.current_scaler(st).loss_scale[None]

    x, y = global_batch(0)
    n = jax.device_count()
    poison = np.ones(n, np.float32)
    poison[n - 2] = np.inf  # one device of the last process
    local = slice(PID * n // NPROC, (PID + 1) * n // NPROC)
    w, scales = dp_step(p, st, x, y, jax.make_array_from_process_local_data(ROWS, poison[local]))
    w, scales = multihost_utils.process_allgather((w, scales), tiled=True)  # per-device results, global view
    w0 = np.asarray(init_params()["w1"])
    return {"moved": [not np.array_equal(w[i], w0) for i in range(n)], "scales": np.asarray(scales).tolist()}


out["shard_map_axis"] = shard_map_run("d")
out["shard_map_no_axis"] = shard_map_run(None)

# 5. nonfinite_leaves on global gradients whose inf sits in the last process's shard only.
g = {"w1": jnp.zeros((8, 16)).at[2, 15].set(jnp.inf), "w2": jnp.zeros((16, 2))}
out["nonfinite_leaves"] = fmp.nonfinite_leaves(shard_params(g))
out["local_shards_with_inf"] = sum(
    not np.all(np.isfinite(np.asarray(s.data))) for s in shard_params(g)["w1"].addressable_shards
)

# 6. check_scaler_health on a replicated state, and on an alarming one with sharded gradients: same on both.
out["health_ok"] = fmp.check_scaler_health(full["state"])
alarmed = jax.device_put(fmp.GradScaler(max_consecutive_overflows=1), REP).update(jnp.array(False))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out["health_alarm"] = [fmp.check_scaler_health(alarmed, shard_params(g)), str(caught[0].message)]

# 7. scaler_stats refuses, with a fix-it message, a counter sharded over the devices of both processes.
per_device = jax.make_array_from_process_local_data(ROWS, np.zeros(jax.local_device_count(), np.int32))
try:
    fmp.optax.scaler_stats(full["state"]._replace(skipped_steps=per_device))
    out["stats_error"] = None
except ValueError as e:
    out["stats_error"] = str(e)

print("RESULT " + json.dumps(out, sort_keys=True), flush=True)
jax.distributed.shutdown()
