"""An apex ``FP16_Optimizer`` training loop: a half-precision model, float32 master weights,
dynamic loss scale.

The "before" listing of the apex migration page. apex's ``fp16_utils`` is gone from recent apex
releases; ``from fmp.torch.fp16_utils import FP16_Optimizer`` runs this file unchanged otherwise
(step 1), and ``apex_after.py`` is the recommended end state: autocast and GradScaler (step 2).

    python examples/migration/apex_before.py [--steps 40]
"""

import argparse

import torch
from apex.fp16_utils import FP16_Optimizer
from torch import nn


def main(steps: int = 40) -> None:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(512, 20, device=device)
    y = (x[:, :3] @ torch.randn(3, 3, device=device)).argmax(dim=1)  # 3 classes, learnable
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 3)).to(device).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    optimizer = FP16_Optimizer(optimizer, dynamic_loss_scale=True, verbose=False)

    for step in range(steps):
        batch = slice(64 * (step % 8), 64 * (step % 8 + 1))
        optimizer.zero_grad()
        logits = model(x[batch].half())
        loss = nn.functional.cross_entropy(
            logits.float(), y[batch]
        )  # the loss in float32, as apex advises
        optimizer.backward(loss)  # scales the loss, unscales the grads into the float32 masters
        optimizer.clip_master_grads(1.0)
        optimizer.step()  # skipped if the gradients hold inf/NaN
        if step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}  scale {optimizer.loss_scale:g}")

    accuracy = (model(x.half()).argmax(dim=1) == y).float().mean().item()
    print(
        f"final loss {loss.item():.4f}; train accuracy {100 * accuracy:.1f}%; "
        f"scale {optimizer.loss_scale:g}"
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=40)
    main(p.parse_args().steps)
