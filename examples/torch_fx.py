"""The FX transform: autocast as a pure rewrite of a torch graph, with the printed precision map.

``fmp.torch.autocast_fx(module, example_inputs, ("cpu", torch.bfloat16))`` traces the module to a pre-dispatch FX
graph and inserts the casts ``torch.autocast`` would make at run time, so the result runs (and compiles) without
an autocast context. ``fmp.torch.explain_fx`` returns the same decisions as a table: one row per op with the rule
that decided it and the dtypes before and after.

    python examples/torch_fx.py [--dtype bfloat16]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import fmp.torch


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return torch.log_softmax(self.fc2(self.norm(h)), dim=-1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="low-precision dtype")
    p.add_argument("--fast", action="store_true", help="accepted for uniformity; this script is already fast")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    model, x = Net(), torch.randn(8, 16)

    report = fmp.torch.explain_fx(model, (x,), ("cpu", dtype))
    print(report)
    print()
    print("precision map (op -> dtype it runs in):")
    for r in report.records:
        if r.category != "cast":
            print(f"  {r.op:<28} {r.category:<16} {','.join(r.out_after) or '-'}")

    gm = fmp.torch.autocast_fx(model, (x,), ("cpu", dtype))
    out = gm(x)
    with torch.autocast("cpu", dtype=dtype):
        ref = model(x)
    print(f"\nrewritten graph output: {out.dtype}; torch.autocast output: {ref.dtype}; "
          f"max abs difference {(out.float() - ref.float()).abs().max().item():.3g}")  # fmt: skip


if __name__ == "__main__":
    main()
