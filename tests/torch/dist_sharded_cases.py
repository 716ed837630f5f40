"""``ShardedGradScaler`` cases, run on every rank by ``dist_worker`` (2 ranks, gloo).

Each case trains the same small model twice on this rank, once with torch's
``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` and once with ``fmp.torch.ShardedGradScaler``,
under FSDP1 (``device_id=cpu``) or FSDP2 (``fully_shard``), with an inf written into rank 1's gradient shard
at one step. :func:`sharded_suite` returns, per case, each scaler's skips, scales, loss dtypes and
state_dict, and whether this rank's parameter shards were bitwise equal after every step (or torch's error).
"""

from __future__ import annotations

import functools
import itertools

import torch
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchShardedGradScaler

import fmp.torch

STEPS = 4
INF_STEP = 1
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "none": None}

KEYS = ("skipped", "scales", "loss_dtypes", "state_dict", "flags")

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    # eps=1e-4: float16 parameters keep float16 moments, where the default 1e-8 is 0 (and 0/0 is NaN)
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01, eps=1e-4),
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=0.01, eps=1e-4, fused=True),
    # unscale_ (to clip) before step: the fused optimizer gets the flag unscale_ reduced
    "adam_fused_unscale": lambda ps: torch.optim.Adam(ps, lr=0.01, eps=1e-4, fused=True),
}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _wrap(wrapper: str, param: str, reduce: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if wrapper == "fsdp1":
        mp = MixedPrecision(param_dtype=DTYPES[param], reduce_dtype=DTYPES[reduce], buffer_dtype=DTYPES[param])
        return FullyShardedDataParallel(model, device_id=torch.device("cpu"), mixed_precision=mp)
    if wrapper == "ddp":  # float32, the gradients all-reduced before the inf is written
        return torch.nn.parallel.DistributedDataParallel(model)
    if wrapper == "fsdp1_fp16_model":  # no mixed precision: the model itself is float16, so are its gradients
        return FullyShardedDataParallel(model.half(), device_id=torch.device("cpu"))
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param], reduce_dtype=DTYPES[reduce])
    fully_shard(model[0], mp_policy=mp)
    return fully_shard(model, mp_policy=mp)


def run(wrapper: str, param: str, reduce: str, opt_name: str, make_scaler, rank: int) -> dict:
    net = _wrap(wrapper, param, reduce)
    params = list(net.parameters())
    opt = OPTIMIZERS[opt_name](params)
    scaler = make_scaler()
    torch.manual_seed(1 + rank)
    skipped, scales, snapshots, loss_dtypes = [], [], [], set()
    in_dtype = torch.float16 if wrapper == "fsdp1_fp16_model" else torch.float32
    for step in range(STEPS):
        opt.zero_grad()
        x = torch.randn(8, 6, dtype=in_dtype)
        loss = net(x).pow(2).mean()
        scaled = scaler.scale(loss)
        loss_dtypes.add(str(scaled.dtype))
        scaled.backward()
        if step == INF_STEP and rank == 1:
            _local(params[0].grad).view(-1)[0] = float("inf")  # this rank's shard only
        if opt_name.endswith("_unscale"):
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, 1e3)
        before = [_local(p).detach().clone() for p in params]
        scaler.step(opt)
        if step == INF_STEP:
            flags = [float(f.max()) for f in scaler._found_inf_per_device(opt).values()]
        scaler.update()
        after = [_local(p).detach().clone() for p in params]
        skipped.append(all(torch.equal(a, b) for a, b in zip(before, after, strict=True)))
        scales.append(scaler.get_scale())
        snapshots.append(torch.cat([a.flatten().float() for a in after]))
    return {
        "skipped": skipped,
        "scales": scales,
        "params": torch.stack(snapshots),
        "loss_dtypes": sorted(loss_dtypes),
        "state_dict": scaler.state_dict(),
        "flags": flags,
    }


def cases():
    for wrapper, param, reduce, opt_name in itertools.product(
        ("fsdp1", "fsdp2"), ("bf16", "fp16"), ("fp32", "none"), OPTIMIZERS
    ):
        yield (wrapper, param, reduce, opt_name)
    for opt_name in OPTIMIZERS:
        yield ("fsdp1_fp16_model", "fp16", "none", opt_name)
    for opt_name in ("sgd", "adam_fused"):
        yield ("ddp", "fp32", "none", opt_name)


def sharded_suite(rank: int) -> dict:
    results = {}
    for wrapper, param, reduce, opt_name in cases():
        kw = {"init_scale": 256.0, "growth_interval": 2}
        common = functools.partial(run, wrapper, param, reduce, opt_name, rank=rank)
        ours = common(lambda kw=kw: fmp.torch.ShardedGradScaler("cpu", **kw))
        case = {
            "ours": {k: ours[k] for k in KEYS},
            "finite": bool(ours["params"].isfinite().all()),
        }
        try:
            theirs = common(lambda kw=kw: TorchShardedGradScaler("cpu", **kw))
        except RuntimeError as e:  # torch's fused Adam after its unscale_: a (1,) found_inf vs () step counts
            case["theirs_error"] = str(e)
        else:
            case["theirs"] = {k: theirs[k] for k in KEYS}
            case["equal_steps"] = [
                bool(torch.equal(a, b)) for a, b in zip(ours["params"], theirs["params"], strict=True)
            ]
        results["/".join((wrapper, param, reduce, opt_name))] = case
    return results
