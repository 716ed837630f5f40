"""Multi-process training on one machine: 2 processes agree on every skipped step (JAX, torch DDP, torch FSDP2).

The script launches itself on 2 local processes per run, over localhost:

* ``jax``: ``jax.distributed`` with gloo CPU collectives, 4 CPU devices per process (8 in the mesh), a
  data-parallel ``fmp.optax.loss_scaled`` AdamW step in float16 (``fmp.autocast``) under ``jax.jit``;
* ``ddp``: torch ``DistributedDataParallel`` (gloo) with ``fmp.torch.autocast`` and ``fmp.torch.GradScaler``;
* ``fsdp2``: torch ``fully_shard`` (FSDP2, params as DTensor shards) with the same scaler.

On one step (``--fault-step``) process 1 alone feeds a batch holding an inf. Every process must skip that
step and back off the scale: process 0 logs the scale and the skip count, and the launcher checks that the
processes end with bit-identical parameters.

    python examples/multiprocess.py [--runs jax,ddp,fsdp2] [--steps 40] [--fault-step 5] [--fast]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import subprocess
import sys
import tempfile
import time

NPROC = 2


# --- the launcher ------------------------------------------------------------------------------------------------
def launch(run: str, args: argparse.Namespace) -> list[str]:
    """Starts the 2 processes of one run; kills both if one fails or the time runs out; returns their stdout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ, OMP_NUM_THREADS="1", JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"  # 4 CPU devices per JAX process
    argv = [sys.executable, os.path.abspath(__file__), "--worker", run, "--port", port]
    argv += ["--steps", str(args.steps), "--fault-step", str(args.fault_step)]
    logs = [tempfile.TemporaryFile("w+") for _ in range(NPROC)]  # files, not pipes: nothing can block on a full pipe
    procs = [
        subprocess.Popen([*argv, "--rank", str(r)], env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        for r, log in enumerate(logs)
    ]
    deadline = time.monotonic() + args.timeout
    try:  # wait for all; stop early when one fails (its peers would wait for it until their own timeouts)
        while None in (codes := [p.poll() for p in procs]) and not any(codes):  # poll every process each time
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outs = []
    for log in logs:
        log.seek(0)
        outs.append(log.read())
        log.close()
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        if p.returncode != 0:
            sys.exit(f"{run}: process {r} exited {p.returncode} (killed after {args.timeout:g} s or when a peer "
                     f"failed: -9):\n{out[-4000:]}")  # fmt: skip
    return outs


# --- JAX: one controller per process, one global mesh --------------------------------------------------------------
def jax_worker(rank: int, port: str, steps: int, fault_step: int) -> str:
    import jax

    # --8<-- [start:jax]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=NPROC, process_id=rank)

    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec

    import fmp
    import fmp.optax

    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rows, replicated = NamedSharding(mesh, PartitionSpec("data")), NamedSharding(mesh, PartitionSpec())

    def loss_fn(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    opt = fmp.optax.loss_scaled(optax.adamw(3e-3), fmp.GradScaler(growth_interval=10))
    k1, k2 = jax.random.split(jax.random.key(0))  # same key on every process: same initial params
    params = {"w1": 0.3 * jax.random.normal(k1, (16, 64)), "w2": 0.3 * jax.random.normal(k2, (64, 1))}
    # Params and the optimizer state (scaler included) are global, replicated arrays.
    params, state = jax.device_put((params, opt.init(params)), replicated)

    fp16_loss = fmp.autocast(loss_fn, "mixed_float16")

    @jax.jit  # the same step as on one device
    def step(params, state, x, y):
        scaler = fmp.optax.current_scaler(state)
        loss, grads = jax.value_and_grad(lambda p: scaler.scale(fp16_loss(p, x, y)))(params)
        updates, state = opt.update(grads, state, params)  # one finite flag for the whole global batch
        return optax.apply_updates(params, updates), state, loss / scaler.loss_scale

    rng = np.random.default_rng(100 + rank)  # each process reads its own rows of the global batch
    teacher = np.random.default_rng(0).standard_normal((16, 1)).astype(np.float32)
    for i in range(steps):
        x = rng.standard_normal((64, 16)).astype(np.float32)
        if i == fault_step and rank == 1:
            x[3, 7] = np.inf
        x_global = jax.make_array_from_process_local_data(rows, x)  # (128, 16) over 8 devices
        y_global = jax.make_array_from_process_local_data(rows, np.sin(x @ teacher))
        params, state, loss = step(params, state, x_global, y_global)
        stats = fmp.optax.scaler_stats(state)  # replicated: every process reads the same numbers
        if rank == 0 and (i % max(1, steps // 4) == 0 or i in (fault_step - 1, fault_step)):
            print(f"jax step {i:3d}  loss {float(loss):.4f}  scale {stats['loss_scale']:g}  "
                  f"skipped {stats['skipped_steps']}", flush=True)  # fmt: skip
    # --8<-- [end:jax]
    host = multihost_utils.process_allgather(params, tiled=True)  # a no-op for replicated params
    digest = hashlib.sha256(b"".join(np.asarray(v).tobytes() for v in jax.tree.leaves(host))).hexdigest()[:16]
    stats = fmp.optax.scaler_stats(state)
    jax.distributed.shutdown()
    return f"skipped {stats['skipped_steps']} of {steps}; final scale {stats['loss_scale']:g}; params {digest}"


# --- torch: DDP and FSDP2, the loop of torch's AMP examples with fmp.torch -------------------------------------------
def torch_worker(run: str, rank: int, port: str, steps: int, fault_step: int) -> str:
    import torch
    import torch.distributed as dist

    import fmp.torch as amp

    # --8<-- [start:torch]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=NPROC)
    torch.manual_seed(0)  # same initial params on every rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    if run == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)  # all-reduces gradients in backward
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (NPROC,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        net = fully_shard(model, mesh=mesh)  # params become DTensor shards; grads are reduce-scattered
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)  # foreach (not fused)
    # Every rank sees the inf: DDP's all-reduce spreads it to every gradient, and FSDP2's unscale
    # runs on DTensors, whose flag is reduced over the mesh. No process_group is needed here.
    scaler = amp.GradScaler("cpu", growth_interval=10)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank reads its own batch
    teacher = torch.randn(16, 1, generator=torch.Generator().manual_seed(0))
    skipped = 0
    for i in range(steps):
        x = torch.randn(64, 16, generator=gen)
        y = torch.sin(x @ teacher)
        if i == fault_step and rank == 1:
            x[3, 7] = float("inf")
        opt.zero_grad()
        with amp.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(net(x).float(), y)
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < scale  # the scale backs off exactly on skipped steps
        if rank == 0 and (i % max(1, steps // 4) == 0 or i in (fault_step - 1, fault_step)):
            now = scaler.get_scale()
            print(f"{run} step {i:3d}  loss {loss.item():.4f}  scale {now:g}  skipped {skipped}")
    # --8<-- [end:torch]
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]  # gathers shards
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in full)).hexdigest()[:16]
    dist.barrier()
    dist.destroy_process_group()
    return f"skipped {skipped} of {steps}; final scale {scaler.get_scale():g}; params {digest}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default="jax,ddp,fsdp2", help="comma-separated: jax, ddp, fsdp2 (default all)")
    p.add_argument("--steps", type=int, default=40, help="training steps per run (default 40)")
    p.add_argument("--fault-step", type=int, default=5, help="the step where process 1 feeds an inf")
    p.add_argument("--timeout", type=float, default=300, help="seconds per run before both processes are killed")
    p.add_argument("--fast", action="store_true", help="12 steps (what the test suite runs)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.fast:
        args.steps = 12
    if args.worker:  # one of the launched processes
        work = jax_worker if args.worker == "jax" else lambda *a: torch_worker(args.worker, *a)
        print("FINAL " + work(args.rank, args.port, args.steps, args.fault_step), flush=True)
        sys.stderr.flush()
        # the work is done and reported, the process group destroyed: skip the interpreter's teardown, where
        # torch's gloo threads can abort the process ("terminate called without an active exception")
        os._exit(0)
    runs = args.runs.split(",")
    if not set(runs) <= {"jax", "ddp", "fsdp2"}:
        p.error(f"--runs: expected a comma-separated subset of jax,ddp,fsdp2, got {args.runs!r}")
    for run in runs:
        outs = launch(run, args)
        finals = [[line for line in out.splitlines() if line.startswith("FINAL ")][-1][6:] for out in outs]
        print("\n".join(line for line in outs[0].splitlines() if line.startswith(run)))
        agree = all(f == finals[0] for f in finals)
        print(f"{run}: {NPROC} processes, {finals[0]}")
        print(f"{run}: processes agree bit for bit: {agree}")
        if not agree:
            sys.exit(f"{run}: the processes diverged: {finals}")


if __name__ == "__main__":
    main()
