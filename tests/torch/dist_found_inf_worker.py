"""One rank of the found_inf regression matrix (launched by test_torch_process_group.py, 2 ranks, gloo).

``fmp.torch.GradScaler(process_group=WORLD)`` against torch's own scalers, for every place the inf can come
from (one rank's gradient, every rank's gradient, spread by DDP's all-reduce, spread by FSDP2's DTensor
check) and every optimizer path (foreach, per-param, fused). Prints ``RESULT <json>``.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchShardedGradScaler

import fmp.torch

STEPS = 3
INF_STEP = 1

OPTIMIZERS = {
    "sgd_foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    "sgd_per_param": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False),
    "sgd_fused": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=True),
    "adam_per_param": lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=False),
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True),
    # unscale_ before step: the fused optimizer gets the flag unscale_ all-reduced, not a fresh check
    "adam_fused_unscale": lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True),
}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def run(where: str, opt_name: str, make_scaler, rank: int) -> dict:
    """Three steps with an inf at step 1; returns per-step skips, scales, params and the optimizer's step count."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    if where == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
    elif where == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[0])
        net = fully_shard(model)
    else:
        net = model
    params = list(model.parameters())
    opt = OPTIMIZERS[opt_name](params)
    scaler = make_scaler()
    torch.manual_seed(1 + rank)
    skipped, scales, snapshots = [], [], []
    for step in range(STEPS):
        opt.zero_grad()
        x = torch.randn(8, 4)
        if step == INF_STEP and where in ("ddp", "fsdp2") and rank == 1:
            x[0, 0] = float("inf")  # the collective spreads it: every rank's gradients hold inf/NaN
        loss = net(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        if step == INF_STEP and (where == "every" or (where == "one" and rank == 1)):
            _local(params[0].grad)[0, 0] = float("inf")
        if opt_name.endswith("_unscale"):
            scaler.unscale_(opt)
        before = [_local(p).detach().clone() for p in params]
        scaler.step(opt)
        scaler.update()
        after = [_local(p).detach().clone() for p in params]
        skipped.append(all(torch.equal(a, b) for a, b in zip(before, after, strict=True)))
        scales.append(scaler.get_scale())
        snapshots.append(torch.cat([a.flatten() for a in after]))
    steps = [float(opt.state[p]["step"]) for p in params if "step" in opt.state[p]]
    return {"skipped": skipped, "scales": scales, "params": torch.stack(snapshots), "steps": steps}


def main() -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    if "fsdp2" in WHERE:
        from torch.distributed.device_mesh import init_device_mesh

        init_device_mesh("cpu", (dist.get_world_size(),))
    results = {}
    for where in WHERE:
        for opt_name in OPTIMIZERS:
            if where == "fsdp2" and opt_name == "sgd_fused":
                continue  # torch 2.13: aten._fused_sgd_ has no DTensor sharding strategy
            ours = run(where, opt_name, lambda: fmp.torch.GradScaler("cpu", init_scale=64.0, process_group=dist.group.WORLD), rank)
            case = {
                "skipped": ours["skipped"],
                "scales": ours["scales"],
                "finite": bool(ours["params"].isfinite().all()),
                "steps": ours["steps"],
            }
            # torch's GradScaler is right when every rank sees the inf; its ShardedGradScaler when one rank
            # does and the optimizer is not fused (its fused path checks without all-reducing)
            if where != "one":
                ref = run(where, opt_name, lambda: torch.amp.GradScaler("cpu", init_scale=64.0), rank)
            elif "fused" not in opt_name:
                ref = run(where, opt_name, lambda: TorchShardedGradScaler("cpu", init_scale=64.0), rank)
            else:
                ref = None
            if ref is not None:
                case["ref_scales"] = ref["scales"]
                case["equal_to_torch"] = bool(torch.equal(ours["params"], ref["params"]))
            results[f"{where}/{opt_name}"] = case
    dist.barrier()
    print("RESULT " + json.dumps(results), flush=True)
    os._exit(0)  # skip the slow interpreter teardown of gloo's threads


WHERE = ("one", "every", "ddp", "fsdp2")

if __name__ == "__main__":
    main()
