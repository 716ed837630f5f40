"""Many devices: every device agrees on the finite flag and all skip together (8 fake CPU devices)."""

from __future__ import annotations

import collections
import json

import pytest
from _helpers.common import run_with_devices

pytest.importorskip("optax")

SCRIPT = """
import json
from functools import partial
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import NamedSharding, PartitionSpec as P
import fmp, fmp.optax

mesh = jax.make_mesh((8,), ("d",))
out = {}

def loss_fn(p, x, y):
    return jnp.mean((x @ p["w"] - y) ** 2)

# 1. jit with sharded params: the finite reduction is global, the scaler stays replicated.
opt = fmp.optax.loss_scaled(optax.sgd(0.1), fmp.GradScaler(init_scale=1024.0))
shard = NamedSharding(mesh, P(None, "d"))
params = {"w": jax.device_put(jnp.ones((4, 16)), shard)}
state = opt.init(params)
x, y = jnp.ones((8, 4)), jnp.zeros((8, 16))

@partial(jax.jit, donate_argnums=(0, 1))
def step(params, state, poison):
    scaler = fmp.optax.current_scaler(state)
    grads = jax.grad(lambda p: scaler.scale(loss_fn(p, x, y)))(params)
    grads = {"w": grads["w"] + poison}  # poison: zeros, with one inf in one device's shard
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

poison = jax.device_put(jnp.zeros((4, 16)).at[2, 13].set(jnp.inf), shard)  # column 13: device 6 only
owners = [d.id for d, idx in shard.addressable_devices_indices_map((4, 16)).items() if 13 in range(16)[idx[1]]]
before = np.asarray(params["w"]).copy()
params, state = step(params, state, poison)
out["jit_owner_devices"] = owners
out["jit_shards"] = len(params["w"].sharding.device_set)
out["jit_params_unchanged"] = bool(np.array_equal(np.asarray(params["w"]), before))
out["jit_scale"] = float(state.scaler.loss_scale)
out["jit_skipped"] = int(state.skipped_steps)
params, state = step(params, state, jax.device_put(jnp.zeros((4, 16)), shard))
out["jit_clean_step_moves"] = not bool(np.array_equal(np.asarray(params["w"]), before))

# 2. shard_map, data parallel: grads are all-reduced, then one device's copy is corrupted (the case
# where plain torch GradScaler diverges across ranks). axis_name makes every device skip together.
def run_shard_map(axis_name):
    opt = fmp.optax.loss_scaled(optax.sgd(0.1), fmp.GradScaler(init_scale=1024.0), axis_name=axis_name)
    p = {"w": jnp.ones((4, 16))}
    st = opt.init(p)

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(), P("d"), P("d"), P("d")), out_specs=(P("d"), P("d")))
    def dp_step(p, st, x, y, poison):
        scaler = fmp.optax.current_scaler(st)
        g = jax.grad(lambda q: scaler.scale(loss_fn(q, x, y)))(p)
        g = jax.lax.pmean(g, "d")
        g = {"w": g["w"] * poison[0]}  # poison: 1 on every device but one, inf there
        u, st = opt.update(g, st, p)
        new = optax.apply_updates(p, u)
        return new["w"][None], fmp.optax.current_scaler(st).loss_scale[None]

    rows, rep = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())
    xs, ys = jax.device_put(jnp.ones((16, 4)), rows), jax.device_put(jnp.zeros((16, 16)), rows)
    poison = jax.device_put(jnp.ones((8,)).at[3].set(jnp.inf), rows)
    w, scales = dp_step(jax.device_put(p, rep), jax.device_put(st, rep), xs, ys, poison)
    w = np.asarray(w)
    moved = [not np.array_equal(w[i], np.ones((4, 16))) for i in range(8)]
    return {"moved": moved, "scales": np.asarray(scales).tolist()}

out["shard_map_axis"] = run_shard_map("d")
out["shard_map_no_axis"] = run_shard_map(None)

# 3. all_finite alone under shard_map
@jax.jit
@partial(jax.shard_map, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
def flags(v):
    return jnp.stack([fmp.all_finite(v), fmp.all_finite(v, axis_name="d")])[None]

v = jax.device_put(jnp.ones(16).at[5].set(jnp.nan), NamedSharding(mesh, P("d")))
out["flags"] = np.asarray(flags(v)).tolist()
print(json.dumps(out))
"""


def test_every_device_skips_together():
    out = json.loads(run_with_devices(SCRIPT).strip().splitlines()[-1])
    # jit + sharded params: an inf in one device's shard skips the step everywhere
    assert len(out["jit_owner_devices"]) == 1 and out["jit_shards"] == 8
    assert out["jit_params_unchanged"] and out["jit_scale"] == 512.0 and out["jit_skipped"] == 1
    assert out["jit_clean_step_moves"]
    # shard_map with axis_name: nobody steps, every device backs off the same way
    assert out["shard_map_axis"] == {"moved": [False] * 8, "scales": [512.0] * 8}
    # without axis_name the devices diverge: the case axis_name exists for
    no_axis = out["shard_map_no_axis"]
    assert no_axis["moved"] == [True, True, True, False, True, True, True, True]
    assert no_axis["scales"] == [1024.0] * 3 + [512.0] + [1024.0] * 4
    # all_finite: local flag on the device holding the NaN only; all-reduced flag everywhere
    assert out["flags"] == [[i != 2, False] for i in range(8)]


COLLECTIVES = """
import json, re
from functools import partial
import jax, jax.numpy as jnp, optax
from jax.sharding import NamedSharding, PartitionSpec as P
import fmp, fmp.optax

mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
params = {**{f"w{i}": jnp.full((64, 64), 0.01) for i in range(4)}, **{f"b{i}": jnp.zeros(64) for i in range(4)}}
x = jax.device_put(jnp.ones((64, 64)), NamedSharding(mesh, P("d")))

def loss_fn(p, x):
    h = x
    for i in range(4):
        h = jnp.tanh(h @ p[f"w{i}"] + p[f"b{i}"])
    return jnp.mean(h ** 2)

def all_reduces(f, *args):
    txt = jax.jit(f).lower(*args).compile().as_text()
    ops = [l.split(" = ", 1)[1].split(" all-reduce")[0] for l in txt.splitlines() if re.search(r" all-reduce(-start)?\\(", l)]
    # XLA combines all-reduces into tuples as it sees fit: count the operands, by shape
    return {"ops": len(ops), "operands": sorted(s for op in ops for s in re.findall(r"[a-z]+[0-9]*\\[[0-9,]*\\]", op))}

def plain(p, x):
    return jax.tree.map(lambda a, g: a - 0.1 * g, p, jax.grad(loss_fn)(p, x))

opt = fmp.optax.loss_scaled(optax.sgd(0.1), fmp.GradScaler())

def fmp_step(p, st, x):
    g = jax.grad(lambda q: fmp.optax.current_scaler(st).scale(loss_fn(q, x)))(p)
    u, st = opt.update(g, st, p)
    return optax.apply_updates(p, u), st

out = {}
rep = NamedSharding(mesh, P())
st = jax.device_put(opt.init(params), rep)
for name, sh in [("data_parallel", lambda v: rep), ("sharded_params", lambda v: NamedSharding(mesh, P(None, "d") if v.ndim == 2 else P()))]:
    p = {k: jax.device_put(v, sh(v)) for k, v in params.items()}
    out[name] = {"plain": all_reduces(plain, p, x), "fmp": all_reduces(fmp_step, p, st, x)}

sm_opt = fmp.optax.loss_scaled(optax.sgd(0.1), fmp.GradScaler(), axis_name="d")
@partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(), P("d")), out_specs=(P(), P()))
def sm_step(p, st, x):
    g = jax.lax.pmean(jax.grad(lambda q: fmp.optax.current_scaler(st).scale(loss_fn(q, x)))(p), "d")
    u, st = sm_opt.update(g, st, p)
    return optax.apply_updates(p, u), st
@partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("d")), out_specs=P())
def sm_plain(p, x):
    return jax.tree.map(lambda a, g: a - 0.1 * g, p, jax.lax.pmean(jax.grad(loss_fn)(p, x), "d"))
p = jax.device_put(params, rep)
out["shard_map"] = {"plain": all_reduces(sm_plain, p, x), "fmp": all_reduces(sm_step, p, jax.device_put(sm_opt.init(params), rep), x)}
print(json.dumps(out))
"""


def test_the_skip_decision_costs_at_most_one_all_reduce_of_scalars():
    """What the finite check adds to a compiled step on 8 devices: nothing, or one all-reduce of a few scalars.

    Data parallel (replicated params): every device holds the all-reduced gradients and computes the same flag
    locally; params sharded: one all-reduce of one scalar per sharded leaf (XLA combines them); shard_map with
    ``axis_name``: one all-reduce of an int32 scalar. Never a gradient-sized collective.
    """
    out = json.loads(run_with_devices(COLLECTIVES).strip().splitlines()[-1])
    for case, extra in [("data_parallel", []), ("sharded_params", ["f32[]"] * 4), ("shard_map", ["s32[]"])]:
        plain, ours = out[case]["plain"], out[case]["fmp"]
        assert plain["operands"], (case, plain)  # the gradient all-reduce is there
        added = list((collections.Counter(ours["operands"]) - collections.Counter(plain["operands"])).elements())
        assert not collections.Counter(plain["operands"]) - collections.Counter(ours["operands"]), (case, out[case])
        assert sorted(added) == extra, (case, out[case])  # scalars only: one per sharded leaf, or one flag
        assert ours["ops"] <= plain["ops"] + (1 if extra else 0), (case, out[case])
