"""One rank of the float8 multi-process test: ``python -m tests.torch.dist_float8_worker``.

Launched on 2 local processes (gloo on 127.0.0.1) by ``tests/torch/float8/test_torch_float8_dist.py``. For each
wrapper (DDP; FSDP2 ``fully_shard`` at the root; FSDP2 per layer and at the root) and recipe (tensorwise, rowwise), this rank
trains the same model twice, once rewritten by ``fmp.torch.autocast_fx`` with torchao's named recipe and once
converted by torchao's ``convert_to_float8_training`` (emulated, under CPU autocast), on this rank's own
batches. Prints ``RESULT <json>``: per case, the losses of both, whether the parameters were bitwise equal
after every step, and a digest of the full parameters (equal on every rank if the replicas agree).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

import fmp
import fmp.torch

STEPS = 5


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial parameters on every rank
    layers = [torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 64)]
    return torch.nn.Sequential(*layers, torch.nn.ReLU(), torch.nn.Linear(64, 16))


def _batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own data, so its own activation amaxes
    return [torch.randn(8, 32, generator=g) * (1 + rank) for _ in range(STEPS)]


def _full(model: torch.nn.Module) -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for p in model.parameters()]


def _shard(model: torch.nn.Module, wrapper: str) -> torch.nn.Module:
    if wrapper == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if wrapper == "fsdp2_per_layer":  # a group per layer: each layer's forward unshards its own parameters
        for child in model.children():
            if any(True for _ in child.parameters()):
                fully_shard(child)
    return fully_shard(model)


def _rewrite(base: torch.nn.Module, x: torch.Tensor, policy: fmp.Policy, wrapper: str) -> torch.nn.Module:
    """The whole model as one graph; for per-layer FSDP2 groups each layer as its own graph (a graph reads its
    submodules' parameters without calling their ``forward``, so only a group at its root would unshard them)."""
    if wrapper != "fsdp2_per_layer":
        return fmp.torch.autocast_fx(base, (x,), policy)
    layers = []
    for layer in base:
        layers.append(fmp.torch.autocast_fx(layer, (x,), policy))
        x = layer(x)
    return torch.nn.Sequential(*layers)


def _train(wrapper: str, scaling: str, library: str, rank: int) -> tuple[list[float], list[list[torch.Tensor]]]:
    base, x0 = _model(), _batches(rank)[0]
    if library == "fmp":
        # outputs in the compute dtype: a layer rewritten on its own hands the next one what autocast would
        policy = fmp.Policy(
            "float32", "bfloat16", "bfloat16", float8=fmp.Float8Recipe.from_peer(f"torchao_{scaling}", emulate=True)
        )
        model = _shard(_rewrite(base, x0, policy, wrapper), wrapper)
        call = model
    else:
        cfg = dataclasses.replace(Float8LinearConfig.from_recipe_name(scaling), emulate=True)
        model = _shard(convert_to_float8_training(base, config=cfg), wrapper)

        def call(x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return model(x)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, params = [], []
    for x in _batches(rank):
        opt.zero_grad()
        loss = call(x).float().square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        params.append([p.clone() for p in _full(model)])
    return losses, params


def main() -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    init_device_mesh("cpu", (dist.get_world_size(),))  # FSDP2's default mesh
    results = {}
    for wrapper in ("ddp", "fsdp2", "fsdp2_per_layer"):
        for scaling in ("tensorwise", "rowwise"):
            ours, ours_params = _train(wrapper, scaling, "fmp", rank)
            ref, ref_params = _train(wrapper, scaling, "torchao", rank)
            equal = all(
                torch.equal(a, b) for step_a, step_b in zip(ours_params, ref_params, strict=True)
                for a, b in zip(step_a, step_b, strict=True)
            )  # fmt: skip
            digest = hashlib.sha256(b"".join(p.numpy().tobytes() for p in ours_params[-1])).hexdigest()
            results[f"{wrapper}-{scaling}"] = {"fmp": ours, "torchao": ref, "equal": equal, "digest": digest}
    dist.barrier()
    print("RESULT " + json.dumps(results), flush=True)
    os._exit(0)  # skip the slow interpreter teardown of gloo's threads


if __name__ == "__main__":
    main()
