"""Real models through ``autocast_fx``, bitwise against eager ``torch.autocast``.

Each model is built from a config with random weights (nothing is downloaded) and small sizes.
For bfloat16 and float16: the loss and every parameter's gradient (and BatchNorm's running
statistics) equal eager autocast's bit for bit; three SGD steps with ``fmp.torch.GradScaler``
equal three with ``torch.amp.GradScaler`` under eager autocast; ``torch.compile`` (dynamo +
AOTAutograd) and ``torch.export`` of the rewritten module run and give its values and gradients.
A model whose library cannot be imported here is skipped with the import error as the reason.
"""

from __future__ import annotations

import copy
import functools
import importlib

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import fmp.torch  # noqa: E402

pytestmark = pytest.mark.gallery

LOW = [torch.bfloat16, torch.float16]
LOW_IDS = ["bf16", "f16"]
STEPS = 3


def _import(name):
    try:
        return importlib.import_module(name)
    except Exception as err:  # noqa: BLE001  (a broken install raises OSError/RuntimeError, not only ImportError)
        pytest.skip(f"{name} cannot be imported on this machine: {type(err).__name__}: {err}")


class _Classifier(nn.Module):
    """An image or sequence model with a cross-entropy loss: forward(x, target) -> scalar loss."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, target):
        return nn.functional.cross_entropy(self.net(x).float(), target)


class _HFLoss(nn.Module):
    """A Hugging Face model called with labels; returns its loss (``use_cache=False`` for GPT-2)."""

    def __init__(self, model, **call_kwargs):
        super().__init__()
        self.model = model
        self.call_kwargs = call_kwargs

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels, **self.call_kwargs).loss


def _bert():
    transformers = _import("transformers")
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
    )
    model = _HFLoss(transformers.BertForSequenceClassification(config))
    return model, (torch.randint(0, 64, (2, 8)), torch.tensor([0, 2]))


def _gpt2_config(transformers):
    return transformers.GPT2Config(
        vocab_size=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        loss_type="ForCausalLM",
    )


def _gpt2():
    transformers = _import("transformers")
    model = _HFLoss(transformers.GPT2LMHeadModel(_gpt2_config(transformers)), use_cache=False)
    ids = torch.randint(0, 64, (2, 8))
    return model, (ids, ids)


class _LSTMTagger(nn.Module):
    """Embedding, a two-layer LSTM and a linear head: a per-token classifier."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.lstm = nn.LSTM(16, 24, num_layers=2, batch_first=True)
        self.head = nn.Linear(24, 5)

    def forward(self, tokens):
        out, _ = self.lstm(self.embed(tokens))
        return self.head(out).flatten(0, 1)


def _lstm():
    return _Classifier(_LSTMTagger()), (torch.randint(0, 50, (3, 7)), torch.randint(0, 5, (21,)))


def _images(num_classes=10):
    return torch.randn(2, 3, 32, 32), torch.randint(0, num_classes, (2,))


class _Block(nn.Module):
    """A ResNet basic block as torchvision writes it: in-place ReLUs and an in-place residual add."""

    def __init__(self, width):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


def _small_resnet():
    """The layers the timm and torchvision ResNets are made of, in plain torch (runs without torchvision)."""
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        _Block(8),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )
    return _Classifier(net), _images()


def _timm_resnet():
    timm = _import("timm")
    return _Classifier(timm.create_model("resnet18", pretrained=False, num_classes=10)), _images()


def _timm_vit():
    timm = _import("timm")
    net = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2, num_classes=10
    )
    return _Classifier(net), _images()


def _torchvision_resnet18():
    torchvision = _import("torchvision")
    return _Classifier(torchvision.models.resnet18(weights=None, num_classes=10)), _images()


# torch's AOTAutograd cannot differentiate aten::mkldnn_rnn_layer (CPU LSTM) in torch 2.13: a plain
# torch.compile(backend="aot_eager") of the op alone fails its saved-tensor check ("expected all
# tensors_saved_with_vc_check to be Tensors"), autocast or not. For these models the training step is
# compiled by dynamo alone (backend="eager") and AOTAutograd runs the forward under no_grad.
AOT_NEEDS_NO_GRAD = {"lstm"}

# oneDNN builds no float16 LSTM primitive on CPUs without native float16 support: eager autocast
# raises, and the rewritten module must raise the same error (it runs the same kernel).
EAGER_MAY_RAISE = {("lstm", torch.float16): "could not create a primitive descriptor for the LSTM"}

GALLERY = {
    "hf_bert": _bert,
    "hf_gpt2": _gpt2,
    "lstm": _lstm,
    "small_resnet": _small_resnet,
    "timm_resnet18": _timm_resnet,
    "timm_vit": _timm_vit,
    "torchvision_resnet18": _torchvision_resnet18,
}


def _build(name):
    torch.manual_seed(0)
    model, inputs = GALLERY[name]()
    model.train()
    return model, inputs


def _grads(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return dict(zip([n for n, p in model.named_parameters() if p.requires_grad], grads, strict=True))


class _CountCasts(TorchDispatchMode):
    """Counts the ``_to_copy`` calls that reach the kernels (below autograd and autocast)."""

    def __init__(self):
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.casts += func is torch.ops.aten._to_copy.default
        return func(*args, **(kwargs or {}))


def _cast_calls(model, call, inputs):
    params = [p for p in model.parameters() if p.requires_grad]
    with _CountCasts() as counter:
        torch.autograd.grad(call(*inputs), params, allow_unused=True)
    return counter.casts


def _assert_equal(got, expected, what):
    if expected is None:
        assert got is None, what
        return
    assert got.dtype == expected.dtype, f"{what}: {got.dtype} != {expected.dtype}"
    assert torch.equal(got, expected), f"{what} differs"


def _assert_grads_equal(got, expected):
    assert got.keys() == expected.keys()
    for key in expected:
        _assert_equal(got[key], expected[key], f"gradient of {key}")


@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
@pytest.mark.parametrize("name", sorted(GALLERY))
def test_gallery_model_bitwise(name, dtype):
    eager_model, inputs = _build(name)
    model = copy.deepcopy(eager_model)
    gm = fmp.torch.autocast_fx(model, inputs, ("cpu", dtype))

    # forward, loss, every gradient, and buffers (BatchNorm's running statistics)
    try:
        with torch.autocast("cpu", dtype=dtype):
            expected = eager_model(*inputs)
    except RuntimeError as err:
        if (name, dtype) not in EAGER_MAY_RAISE:
            raise
        with pytest.raises(RuntimeError, match=EAGER_MAY_RAISE[name, dtype]):
            gm(*inputs)
        assert EAGER_MAY_RAISE[name, dtype] in str(err)
        return
    loss = gm(*inputs)
    _assert_equal(loss, expected, "loss")
    _assert_grads_equal(_grads(model, loss), _grads(eager_model, expected))
    for (key, got), (_, ref) in zip(model.state_dict().items(), eager_model.state_dict().items(), strict=True):
        _assert_equal(got, ref, key)

    # the same casts as eager autocast makes, one for one, forward and backward (per use / cached)
    def eager(*args):
        with torch.autocast("cpu", dtype=dtype):
            return eager_model(*args)

    assert _cast_calls(model, gm, inputs) == _cast_calls(eager_model, eager, inputs)

    # a few optimizer steps: autocast_fx + fmp's GradScaler vs eager autocast + torch's GradScaler
    opt_eager = torch.optim.SGD(eager_model.parameters(), lr=0.05, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler_eager = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    scaler = fmp.torch.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    start = [p.detach().clone() for p in model.parameters()]
    for _ in range(STEPS):
        opt_eager.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            expected = eager_model(*inputs)
        scaler_eager.scale(expected).backward()
        scaler_eager.step(opt_eager)
        scaler_eager.update()
        loss = gm(*inputs)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        _assert_equal(loss, expected, "loss during training")
        assert scaler.get_scale() == scaler_eager.get_scale()
    for (key, p), ref in zip(model.named_parameters(), eager_model.parameters(), strict=True):
        _assert_equal(p.detach(), ref.detach(), f"{key} after {STEPS} steps")
    assert any(not torch.equal(p, s) for p, s in zip(model.parameters(), start, strict=True)), "no step was taken"

    # torch.compile (dynamo + AOTAutograd; inductor's C++ compile is not bitwise and too slow here)
    torch._dynamo.reset()
    backend = "eager" if name in AOT_NEEDS_NO_GRAD else "aot_eager"
    compiled = torch.compile(gm, backend=backend, fullgraph=True)
    expected = gm(*inputs)
    expected_grads = _grads(model, expected)  # before the next forward updates BatchNorm's buffers in place
    loss = compiled(*inputs)
    _assert_equal(loss, expected, "torch.compile loss")
    _assert_grads_equal(_grads(model, loss), expected_grads)
    if name in AOT_NEEDS_NO_GRAD:
        torch._dynamo.reset()
        with torch.no_grad():
            _assert_equal(torch.compile(gm, backend="aot_eager", fullgraph=True)(*inputs), gm(*inputs), "aot_eager")

    # torch.export of the rewritten module: same values, and it holds the casts, not autocast state
    exported = torch.export.export(gm, inputs)
    _assert_equal(exported.module()(*inputs), gm(*inputs), "torch.export loss")
    assert not any("autocast" in str(n.target) for n in exported.graph.nodes)


def test_gpt2_with_cache_names_use_cache_false():
    transformers = _import("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(_gpt2_config(transformers))
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(TypeError, match=r"DynamicCache.*use_cache=False"):
        fmp.torch.autocast_fx(model, (ids,))
    # the recipe the message gives
    gm = fmp.torch.autocast_fx(functools.partial(model, use_cache=False), (ids,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(ids, use_cache=False).logits
    _assert_equal(gm(ids).logits, expected, "logits")


def test_explain_fx_on_bert_reads_well():
    model, inputs = _build("hf_bert")
    report = fmp.torch.explain_fx(model, inputs, ("cpu", torch.bfloat16))
    gm = fmp.torch.autocast_fx(model, inputs, ("cpu", torch.bfloat16))
    text = str(report)
    # which ops ran in low precision: every Linear (Q, K, V, output, 2 MLP per layer; pooler; classifier)
    linears = report.filter(op="aten::linear").records
    assert len(linears) == 2 * 6 + 2
    assert all(r.category == "lower_precision" and r.out_after == ("bfloat16",) for r in linears)
    assert {r.category for r in report.filter(op="aten::scaled_dot_product_attention").records} == {"lower_precision"}
    assert "lower_precision: aten::linear x14, aten::scaled_dot_product_attention x2" in text
    # the casts inserted: one row per cast node of the rewritten graph, naming the parameter it casts
    casts = report.filter(category="cast").records
    assert len(casts) == report.summary["casts_inserted"]
    assert len(casts) == sum(1 for n in gm.graph.nodes if n.target is torch.ops.aten._to_copy.default)
    params = {name for name, _ in model.named_parameters()}
    weight_casts = {r.scope for r in casts if r.scope in params}
    assert "model.bert.encoder.layer.0.attention.self.query.weight" in weight_casts
    assert "model.classifier.weight" in weight_casts
    assert any(r.scope.endswith("(activation)") for r in casts)
    # float32 islands: the loss, fed by a cast back to float32
    assert report.summary["float32_islands"] == 1
    assert "float32: aten::cross_entropy_loss x1" in text
    (loss,) = report.filter(op="aten::cross_entropy_loss").records
    assert loss.in_after == ("float32",)
    # the source column names our line that calls the model (_HFLoss.forward), not transformers' modeling_bert.py
    assert loss.source_full == f"{__file__}:{_HFLoss.forward.__code__.co_firstlineno + 1} (forward)"
    assert report.summary["low_precision_flop_share"] == 1.0
