"""Migrating from apex ``FP16_Optimizer``: the apex loop on ``fmp.torch.fp16_utils``, then the torch.amp loop.

Step 1 (no code change but the import): an apex-era loop - half-precision model, ``FP16_Optimizer`` with dynamic
loss scaling and float32 master weights, ``optimizer.backward(loss)``, ``clip_master_grads`` - runs on
``from fmp.torch.fp16_utils import FP16_Optimizer`` (apex's fp16_utils is gone from recent apex releases).

Step 2 (the recommended end state): the model stays float32, ``fmp.torch.autocast`` picks the precision per op
and ``fmp.torch.GradScaler`` scales the loss. Both loops train the same model on the same data; the script
prints their losses side by side.

    python examples/apex_migration.py [--steps 60] [--fast]
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

import fmp.torch as amp
from fmp.torch.fp16_utils import FP16_Optimizer  # was: from apex.fp16_utils import FP16_Optimizer


def make_data(steps: int):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 1, generator=g)
    return [(x, x @ w) for x in (torch.randn(64, 16, generator=g) for _ in range(steps))]


def apex_style(model: nn.Module, data, dtype: torch.dtype) -> list[float]:
    """The apex recipe: low-precision model, FP16_Optimizer owns the backward pass and the master weights."""
    model = model.to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    optimizer = FP16_Optimizer(optimizer, dynamic_loss_scale=True, verbose=False)
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x.to(dtype)).float(), y)  # loss computed in float32, as apex advises
        optimizer.backward(loss)  # was: loss.backward()
        optimizer.clip_master_grads(1.0)
        optimizer.step()
        losses.append(loss.item())
    print(f"apex-style: model params {next(model.parameters()).dtype}, final loss scale {optimizer.loss_scale:g}")
    return losses


def amp_style(model: nn.Module, data, dtype: torch.dtype) -> list[float]:
    """The torch.amp recipe: float32 model, autocast per op, GradScaler; unscale before clipping."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = amp.GradScaler("cpu")
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        with amp.autocast("cpu", dtype=dtype):
            loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # clip the true gradients, like clip_master_grads
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
    print(f"amp-style:  model params {next(model.parameters()).dtype}, final loss scale {scaler.get_scale():g}")
    return losses


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    p.add_argument("--fast", action="store_true", help="20 steps (what the test suite runs)")
    args = p.parse_args(argv)
    steps = 20 if args.fast else args.steps
    torch.manual_seed(0)
    # float16 matmuls run on CPU in recent torch; the autocast loop uses bfloat16, CPU autocast's default
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    data = make_data(steps)
    a = apex_style(copy.deepcopy(model), data, torch.float16)
    b = amp_style(copy.deepcopy(model), data, torch.bfloat16)
    print("step  apex FP16_Optimizer  fmp.torch autocast+GradScaler")
    for i in range(0, steps, max(1, steps // 5)):
        print(f"{i:4d}  {a[i]:19.4f}  {b[i]:.4f}")
    print(f"final {a[-1]:18.4f}  {b[-1]:.4f}")


if __name__ == "__main__":
    main()
