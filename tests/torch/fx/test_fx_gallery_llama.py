"""A Hugging Face Llama with grouped-query attention through ``autocast_fx``: what is bitwise and why.

transformers takes another path while it is traced (``masking_utils.find_packed_sequence_indices``
cannot read ``position_ids`` from a fake tensor, so it builds an explicit causal mask, and SDPA
attention then repeats the key/value heads instead of ``enable_gqa=True``). With
``attn_implementation="eager"`` both paths are the same and the graph equals eager autocast bit for
bit; with ``"sdpa"`` the forward is bitwise and the gradients are summed in another order. The traced
graph equals eager autocast on transformers' tracing path bit for bit, and ``torch.compile`` takes the
same path as the trace. Built from a config with random weights (nothing is downloaded).
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch import nn  # noqa: E402

import fmp.torch  # noqa: E402

pytestmark = pytest.mark.gallery

DTYPE = torch.bfloat16


class _LMLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


def _llama(attn_implementation):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention: 2 query heads per key/value head
        max_position_embeddings=32,
        attn_implementation=attn_implementation,
    )
    ids = torch.randint(0, 64, (2, 8))
    return _LMLoss(transformers.LlamaForCausalLM(config)), (ids, ids)


def _loss_and_grads(model, call, inputs):
    loss = call(*inputs)
    return loss, torch.autograd.grad(loss, list(model.parameters()))


def _eager(model, inputs):
    def call(*args):
        with torch.autocast("cpu", dtype=DTYPE):
            return model(*args)

    return _loss_and_grads(model, call, inputs)


def _fx(model, inputs):
    model = copy.deepcopy(model)
    return _loss_and_grads(model, fmp.torch.autocast_fx(model, inputs, ("cpu", DTYPE)), inputs)


def _differ(got, expected):
    return [i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if not torch.equal(a, b)]


def test_llama_eager_attention_is_bitwise():
    model, inputs = _llama("eager")
    loss, grads = _fx(model, inputs)
    ref_loss, ref_grads = _eager(model, inputs)
    assert torch.equal(loss, ref_loss)
    assert not _differ(grads, ref_grads)


def test_llama_sdpa_gqa_is_bitwise_against_the_traced_path(monkeypatch):
    model, inputs = _llama("sdpa")
    loss, grads = _fx(model, inputs)

    # against eager autocast: the forward is bitwise, gradients are summed in another order
    ref_loss, ref_grads = _eager(model, inputs)
    assert torch.equal(loss, ref_loss)
    assert _differ(grads, ref_grads), "transformers traces GQA as it runs it now: update docs/guides/torch.md"
    for got, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-2 * ref.abs().max().item())

    # torch.compile takes the same path: its gradients are the graph's, bit for bit, and differ from eager too
    torch._dynamo.reset()
    compiled_model = copy.deepcopy(model)
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    with torch.autocast("cpu", dtype=DTYPE):
        compiled_loss = compiled(*inputs)
    compiled_grads = torch.autograd.grad(compiled_loss, list(compiled_model.parameters()))
    torch._dynamo.reset()
    assert torch.equal(compiled_loss, loss)
    assert not _differ(compiled_grads, grads)

    # eager autocast on transformers' tracing path: bitwise, so fmp's casts are not the difference
    with monkeypatch.context() as patch:
        patch.setattr(transformers.masking_utils, "is_tracing", lambda tensor=None: True)
        traced_path_loss, traced_path_grads = _eager(model, inputs)
    assert torch.equal(traced_path_loss, loss)
    assert not _differ(traced_path_grads, grads)

    # the documented way to a bitwise comparison with sdpa: GQA through enable_gqa on both paths
    monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    loss, grads = _fx(model, inputs)
    ref_loss, ref_grads = _eager(model, inputs)
    assert torch.equal(loss, ref_loss)
    assert not _differ(grads, ref_grads)
