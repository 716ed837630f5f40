"""The apex loop of apex_before.py as autocast + GradScaler on fmp.torch (the torch.amp recipe).

The "after" listing of the apex migration page: the model stays float32, autocast picks the
dtype per op, ``GradScaler`` scales the loss and skips non-finite steps.
``import torch.amp as amp`` runs it unchanged.

    python examples/migration/apex_after.py [--steps 40]
"""

import argparse

import torch
from torch import nn

import fmp.torch as amp


def main(steps: int = 40) -> None:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = (
        torch.float16 if device == "cuda" else torch.bfloat16
    )  # bfloat16 is CPU autocast's default
    x = torch.randn(512, 20, device=device)
    y = (x[:, :3] @ torch.randn(3, 3, device=device)).argmax(dim=1)  # 3 classes, learnable
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 3)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    scaler = amp.GradScaler(device)

    for step in range(steps):
        batch = slice(64 * (step % 8), 64 * (step % 8 + 1))
        optimizer.zero_grad()
        with amp.autocast(device, dtype=dtype):
            logits = model(x[batch])
            loss = nn.functional.cross_entropy(logits, y[batch])  # autocast runs it in float32
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # clip the true gradients, like clip_master_grads
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)  # skipped if the gradients hold inf/NaN
        scaler.update()
        if step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}  scale {scaler.get_scale():g}")

    accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    print(
        f"final loss {loss.item():.4f}; train accuracy {100 * accuracy:.1f}%; "
        f"scale {scaler.get_scale():g}"
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=40)
    main(p.parse_args().steps)
