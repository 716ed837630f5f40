"""GradScaler(process_group=...) on torch.distributed gloo, 2 processes on localhost."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

from tests.helpers import ROOT  # noqa: E402

_RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist
    import fmp.torch

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"], rank=rank, world_size=2)
    results = {}

    def loop(name, *, group, ddp, inject, fused=False):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        net = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
        opt = torch.optim.Adam(model.parameters(), lr=0.1, fused=True) if fused else torch.optim.SGD(model.parameters(), lr=0.1)
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
        results[name] = {"scales": scales, "skipped": skipped, "w": model.weight.detach().flatten().tolist()}

    def no_grads_on_rank1():
        p = torch.nn.Parameter(torch.ones(2))
        if rank == 0:
            p.grad = torch.tensor([float("inf"), 1.0])
        scaler = fmp.torch.GradScaler("cpu", init_scale=64.0, process_group=dist.group.WORLD)
        scaler.scale(torch.ones(()))
        scaler.step(torch.optim.SGD([p], lr=0.1))
        scaler.update()
        results["no_grads_on_rank1"] = scaler.get_scale()

    no_grads_on_rank1()
    loop("synced", group=dist.group.WORLD, ddp=True, inject="grad")
    loop("unsynced", group=None, ddp=True, inject="grad")
    loop("plain_ddp", group=None, ddp=True, inject="input")
    loop("no_ddp_synced", group=dist.group.WORLD, ddp=False, inject="grad")
    loop("fused_synced", group=dist.group.WORLD, ddp=False, inject="grad", fused=True)
    dist.barrier()
    print("RESULT " + json.dumps(results), flush=True)
    os._exit(0)  # skip the slow interpreter teardown of gloo's threads
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_found_inf_is_reduced_over_the_group():

    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), PORT=port, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _RANK_SCRIPT], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
        )
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
        line = [x for x in out.decode().splitlines() if x.startswith("RESULT ")][-1]
        outs.append(json.loads(line[len("RESULT ") :]))
    r0, r1 = outs
    # a rank without gradients still takes part in the all-reduce (no deadlock) and backs off too
    assert r0["no_grads_on_rank1"] == r1["no_grads_on_rank1"] == 32.0
    # with the process group every rank skips step 1 and backs off together
    assert r0["synced"]["skipped"] == r1["synced"]["skipped"] == [False, True, False]
    assert r0["synced"]["scales"] == r1["synced"]["scales"] == [64.0, 32.0, 32.0]
    assert r0["synced"]["w"] == r1["synced"]["w"]
    # without it, the rank that saw the inf diverges (the check can fail)
    assert r0["unsynced"]["scales"] != r1["unsynced"]["scales"]
    assert r0["unsynced"]["w"] != r1["unsynced"]["w"]
    # a plain DDP loop works unchanged: the inf reaches every rank through DDP's gradient all-reduce
    assert r0["plain_ddp"]["skipped"] == r1["plain_ddp"]["skipped"] == [False, True, False]
    assert r0["plain_ddp"]["w"] == r1["plain_ddp"]["w"]
    # without DDP (independent params), the group still makes both ranks skip step 1
    assert r0["no_ddp_synced"]["skipped"] == r1["no_ddp_synced"]["skipped"] == [False, True, False]
    # and so does the fused-optimizer path (torch's ShardedGradScaler does not all-reduce there)
    assert r0["fused_synced"]["skipped"] == r1["fused_synced"]["skipped"] == [False, True, False]
    assert r0["fused_synced"]["scales"] == r1["fused_synced"]["scales"] == [64.0, 32.0, 32.0]


def test_found_inf_is_a_flag_for_every_optimizer_path():
    """found_inf stays 0/1 after the cross-rank reduction, wherever the inf came from.

    A SUM gave 2.0 when more than one rank saw the inf; torch's fused Adam/SGD skip only on 1.0 and subtract
    the flag from their step counts, so they stepped on inf gradients (NaN parameters, Adam's step 1 -> -1).
    """
    from tests.torch.dist_launch import launch

    ranks = launch("tests.torch.dist_found_inf_worker", timeout=240)
    assert ranks[0].keys() == ranks[1].keys()
    assert len(ranks[0]) == 4 * 7 - 1  # (one, every, ddp, fsdp2) x 7 optimizer paths; fsdp2 has no fused SGD
    for name, r0 in ranks[0].items():
        r1 = ranks[1][name]
        for r in (r0, r1):
            assert r["skipped"] == [False, True, False], name
            assert r["scales"] == [64.0, 32.0, 32.0], name
            assert r["finite"], name
            # Adam and its fused kernel count only the steps they took
            assert r["steps"] in ([], [2.0] * len(r["steps"])), name
            if "equal_to_torch" in r:
                assert r["ref_scales"] == r["scales"], name
                assert r["equal_to_torch"], name
        # a reference exists for every case except the fused ones with the inf on one rank
        assert ("equal_to_torch" in r0) == (not (name.startswith("one/") and "fused" in name)), name
