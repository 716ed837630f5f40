"""The torch facade running torch's "Typical Mixed Precision Training" loop with one import changed.

The loop is the one in torch's AMP examples (create model and optimizer, a GradScaler once, then per batch:
``zero_grad``, forward under autocast, ``scaler.scale(loss).backward()``, ``scaler.step``, ``scaler.update``).
Only the import differs: ``import fmp.torch as amp`` instead of ``torch.amp``. It runs on CPU in bfloat16 (or
``--dtype float16``), and on CUDA when there is one (``--device cuda``).

    python examples/torch_facade.py [--epochs 3] [--dtype bfloat16] [--fast]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn, optim

import fmp.torch as amp  # instead of: import torch.amp as amp


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 3))

    def forward(self, x):
        return self.body(x)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=3, help="epochs over 64 batches (default 3)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="autocast dtype")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--fast", action="store_true", help="1 epoch of 16 batches (what the test suite runs)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    n_batches = 16 if args.fast else 64
    epochs = 1 if args.fast else args.epochs

    teacher = torch.randn(20, 3)
    data = []
    for _ in range(n_batches):
        x = torch.randn(32, 20)
        data.append((x.to(args.device), (x @ teacher).argmax(-1).to(args.device)))

    # Creates model and optimizer in default precision
    model = Net().to(args.device)
    optimizer = optim.SGD(model.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()
    # Creates a GradScaler once at the beginning of training.
    scaler = amp.GradScaler(args.device)

    for epoch in range(epochs):
        for input, target in data:
            optimizer.zero_grad()
            # Runs the forward pass with autocasting.
            with amp.autocast(device_type=args.device, dtype=dtype):
                output = model(input)
                loss = loss_fn(output, target)
            # Scales loss. Calls backward() on scaled loss to create scaled gradients.
            scaler.scale(loss).backward()
            # Unscales the gradients; skips optimizer.step() if they contain infs or NaNs.
            scaler.step(optimizer)
            # Updates the scale for next iteration.
            scaler.update()
        print(f"epoch {epoch}: last loss {loss.item():.4f} (computed in {output.dtype}), scale {scaler.get_scale():g}")

    with torch.no_grad():
        correct = sum(int((model(x).argmax(-1) == t).sum()) for x, t in data)
    print(f"train accuracy {100 * correct / (32 * n_batches):.1f}%; params stay {next(model.parameters()).dtype}")
    print(f"scaler state_dict: {scaler.state_dict()}")


if __name__ == "__main__":
    main()
