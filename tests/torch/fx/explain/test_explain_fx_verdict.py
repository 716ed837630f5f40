"""explain_fx(compare=True) gives the same verdict as fmp.explain: a healthy torch model needs no fix."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import fmp.torch  # noqa: E402


class _Block(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.norm2(x))
        return torch.log_softmax(x, -1)


def test_a_healthy_torch_model_needs_no_fix():
    torch.manual_seed(0)
    model, x = _Block().eval(), torch.randn(2, 8, 32)
    rep = fmp.torch.explain_fx(model, (x,), ("cpu", torch.bfloat16), compare=True)
    assert rep.needs_fix == []
    assert str(rep).startswith("no op needs a fix (bfloat16 unit roundoff u = 3.9e-03;")
    assert max(r.added_error or 0.0 for r in rep.records) > 2.0**-12


def test_a_planted_softmax_in_bfloat16_needs_a_fix():
    torch.manual_seed(0)
    rules = fmp.DEFAULT_RULES.derive(framework="torch", lower_precision=["aten::softmax.int"])
    x = torch.randn(16, 32) * 3 + 100.0
    rep = fmp.torch.explain_fx(lambda x: torch.softmax(x, -1), (x,), ("cpu", torch.bfloat16), rules=rules, compare=True)
    assert [r.op for r in rep.needs_fix] == ["aten::softmax.int"]
    assert str(rep).startswith("1 op needs a fix (bfloat16")
