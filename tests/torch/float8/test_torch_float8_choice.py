"""``explain_fx`` under a float8 policy marks the matmuls too small for float8 to pay on a GPU, and
``suggested(small_float8=True)`` keeps them in bfloat16, as ``fmp.explain`` does."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import fmp  # noqa: E402
import fmp.torch  # noqa: E402


class _Wide(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(64, 1040)  # K = 64, N = 1040: tensorwise pays, rowwise does not
        self.down = torch.nn.Linear(1040, 64)  # small under both
        self.lm_head = torch.nn.Linear(64, 1000)  # N not a multiple of 16

    def forward(self, x):
        return self.lm_head(self.down(torch.relu(self.up(x))))


@pytest.mark.parametrize(
    ("policy", "small"),
    [("mixed_float8", ["down", "lm_head"]), ("p=f32,c=bf16,o=f32,float8=rowwise", ["up", "down", "lm_head"])],
)
def test_explain_fx_marks_float8_matmuls_too_small_for_a_gpu(policy, small):
    model, x = _Wide(), torch.randn(8, 64)
    rep = fmp.torch.explain_fx(model, (x,), policy)
    rows = {r.scope: r for r in rep.records if r.category == "float8"}
    assert [rows[s].gemm for s in ("up", "down", "lm_head")] == [(8, 64, 1040), (8, 1040, 64), (8, 64, 1000)]
    assert [s for s, r in rows.items() if r.float8_too_small] == small
    assert rows["lm_head"].float8_too_small == "K or N not a multiple of 16"
    assert f"{len(small)} of 3 float8 matmuls are below the size where float8 pays on a GPU" in str(rep)
    keep = rep.suggested(small_float8=True)
    assert keep == {"overrides": dict.fromkeys(small, "mixed_bfloat16")}
    kept = fmp.torch.explain_fx(model, (x,), policy, **keep)
    assert [r.scope for r in kept.records if r.category == "float8"] == [s for s in ("up",) if s not in small]
