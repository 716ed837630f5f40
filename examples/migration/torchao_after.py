"""The torchao loop of torchao_before.py on fmp: the conversion line changed, nothing else.

The "after" listing of the torchao migration page: ``fmp.torch.autocast_fx`` rewrites the
model's graph instead of swapping modules, and prints exactly the losses ``torchao_before.py``
prints.

    python examples/migration/torchao_after.py [--steps 40]
"""

import argparse

import torch
from torch import nn

import fmp
import fmp.torch  # was: from torchao.float8 import convert_to_float8_training


def main(steps: int = 40) -> None:
    torch.manual_seed(0)
    x = torch.randn(512, 32)
    y = (x[:, :4] @ torch.randn(4, 16)).argmax(dim=1)  # 16 classes, a learnable rule
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    recipe = fmp.Float8Recipe.from_peer("torchao_rowwise")  # torchao's "rowwise", exactly
    policy = fmp.Policy("f32", "bf16", "f32", float8=recipe)
    model = fmp.torch.autocast_fx(model, (x[:64],), policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    for step in range(steps):
        batch = slice(64 * (step % 8), 64 * (step % 8 + 1))
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
        loss.backward()
        optimizer.step()
        if step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}")

    with torch.autocast("cpu", dtype=torch.bfloat16):
        accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    print(f"final loss {loss.item()!r}; train accuracy {100 * accuracy:.1f}%")


if __name__ == "__main__":
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=40)
    main(p.parse_args().steps)
