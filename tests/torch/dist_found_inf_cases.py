"""``fmp.torch.GradScaler(process_group=...)`` cases, run on every rank by ``dist_worker`` (2 ranks, gloo).

:func:`found_inf_suite`: the regression matrix of the found_inf flag, against torch's own scalers, for every
place the inf can come from (one rank's gradient, every rank's gradient, spread by DDP's all-reduce, spread by
FSDP2's DTensor check) and every optimizer path (foreach, per-param, fused).
:func:`group_suite`: process groups with and without DDP, a rank without gradients, no group at all.
"""

from __future__ import annotations

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


def found_inf_suite(rank: int) -> dict:
    results = {}
    for where in WHERE:
        for opt_name in OPTIMIZERS:
            if where == "fsdp2" and opt_name == "sgd_fused":
                continue  # torch 2.13: aten._fused_sgd_ has no DTensor sharding strategy
            ours = run(
                where,
                opt_name,
                lambda: fmp.torch.GradScaler("cpu", init_scale=64.0, process_group=dist.group.WORLD),
                rank,
            )
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
    return results


WHERE = ("one", "every", "ddp", "fsdp2")


def _group_loop(rank: int, *, group, ddp: bool, inject: str) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    net = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = fmp.torch.GradScaler("cpu", init_scale=64.0, growth_interval=100, process_group=group)
    torch.manual_seed(1 + rank)
    scales, skipped = [], []
    for step in range(3):
        opt.zero_grad()
        x = torch.randn(8, 4)
        if inject == "input" and step == 1 and rank == 1:
            x[0, 0] = float("inf")
        with fmp.torch.autocast("cpu", dtype=torch.bfloat16):
            loss = net(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        if inject == "grad" and step == 1 and rank == 1:
            model.weight.grad[0, 0] = float("inf")  # after DDP's all-reduce: this rank only
        before = model.weight.detach().clone()
        scaler.step(opt)
        scaler.update()
        skipped.append(bool(torch.equal(before, model.weight.detach())))
        scales.append(scaler.get_scale())
    return {"scales": scales, "skipped": skipped, "w": model.weight.detach().flatten().tolist()}


def group_suite(rank: int) -> dict:
    p = torch.nn.Parameter(torch.ones(2))
    if rank == 0:
        p.grad = torch.tensor([float("inf"), 1.0])
    scaler = fmp.torch.GradScaler("cpu", init_scale=64.0, process_group=dist.group.WORLD)
    scaler.scale(torch.ones(()))
    scaler.step(torch.optim.SGD([p], lr=0.1))
    scaler.update()
    return {
        "no_grads_on_rank1": scaler.get_scale(),
        "synced": _group_loop(rank, group=dist.group.WORLD, ddp=True, inject="grad"),
        "unsynced": _group_loop(rank, group=None, ddp=True, inject="grad"),
        "plain_ddp": _group_loop(rank, group=None, ddp=True, inject="input"),
        "no_ddp_synced": _group_loop(rank, group=dist.group.WORLD, ddp=False, inject="grad"),
    }
