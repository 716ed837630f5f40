"""explain_fx(compare=True) on Hugging Face models built from configs (random weights, nothing downloaded)."""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _helpers.common import ROOT  # noqa: E402

import fmp.torch  # noqa: E402

pytestmark = pytest.mark.gallery


class _LMLoss(torch.nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids):
        return self.lm(input_ids=input_ids, labels=input_ids, use_cache=False).loss


def test_llama_every_op_and_gradient_compared():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = _LMLoss(transformers.LlamaForCausalLM(config)).eval()
    ids = torch.randint(0, 128, (2, 16))
    rep = fmp.torch.explain_fx(model, (ids,), "cpu", compare=True, grads=True)
    linears = rep.filter(op="aten::linear").records
    assert len(linears) == 2 * 7 + 1 and all(0 < r.added_error < 2**-7 for r in linears)
    assert all(r.scope.startswith("lm.") for r in linears)
    (embedding,) = rep.filter(op="aten::embedding").records
    assert embedding.error == 0.0  # before any cast: exact
    assert not any(r.nonfinite or r.flips or r.suggestion for r in rep.records)  # a healthy model: nothing to fix
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(rep.grad_errors) == names
    assert all(g.cosine > 0.999 and g.error < 0.05 for g in rep.grad_errors.values())
    with torch.no_grad():
        got, want = float(fmp.torch.autocast_fx(model, (ids,), "cpu")(ids)), float(model(ids))
    (ce,) = rep.filter(op="aten::cross_entropy_loss").records
    assert ce.error == pytest.approx(abs(got - want) / abs(want), rel=1e-5)  # the loss's own relative error


def test_guide_example_runs():
    page = (ROOT / "docs" / "guides" / "precision-loss-torch.md").read_text()
    code = "\n".join(re.findall(r"```python\n(.*?)```", page, flags=re.S))
    exec(compile(code, "precision-loss-torch.md", "exec"), {"__name__": "docs"})  # noqa: S102
