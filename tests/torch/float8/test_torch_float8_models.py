"""Float8 over whole Hugging Face models: ``autocast_fx`` with torchao's named recipes
(``Float8Recipe.from_peer("torchao_tensorwise" / "torchao_rowwise")``) equals torchao's
``convert_to_float8_training`` (``emulate=True``, run under ``torch.autocast("cpu", bfloat16)``) bit for bit on
tiny random BERT and Llama models: loss, every gradient, and the parameters after 20 SGD and AdamW steps.

Module selection: torchao converts every ``nn.Linear`` by default, fmp rewrites every matmul against a 2-D
parameter; on these models both select the same layers (BERT's masked-LM decoder, tied to the word embeddings
and 99 wide, included). torchao's optional dims/size filter (``_auto_filter_for_recipe``) and a
``module_filter_fn`` correspond to fmp's ``overrides`` by module path, shown here for ``lm_head`` and the first
and last decoder layers.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")
transformers = pytest.importorskip("transformers")

from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402

import fmp  # noqa: E402
import fmp.torch  # noqa: E402

pytestmark = pytest.mark.gallery  # CI runs the gallery as its second step
BF16 = {"device_type": "cpu", "dtype": torch.bfloat16}


class _Loss(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


def _bert() -> torch.nn.Module:
    config = transformers.BertConfig(
        vocab_size=99,  # not a multiple of 16: torchao's default still converts the decoder, fmp too
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return _Loss(transformers.BertForMaskedLM(config))


def _llama(layers: int = 2) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attn_implementation="eager",
        use_cache=False,
    )
    return _Loss(transformers.LlamaForCausalLM(config))


MODELS = {"bert": _bert, "llama": _llama}


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[name]()


def _batch(seed: int, vocab: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(seed))
    return ids, ids


def _fmp(model: torch.nn.Module, scaling: str, **kwargs) -> torch.nn.Module:
    recipe = fmp.Float8Recipe.from_peer(f"torchao_{scaling}", emulate=True)
    policy = dataclasses.replace(fmp.get_policy("mixed_float8"), float8=recipe)
    return fmp.torch.autocast_fx(model, _batch(0), policy, **kwargs)


def _torchao(model: torch.nn.Module, scaling: str, module_filter_fn=None):
    """torchao's named recipe, emulated, called under CPU autocast (its ``Float8Linear`` outputs bfloat16 there)."""
    cfg = dataclasses.replace(Float8LinearConfig.from_recipe_name(scaling), emulate=True)
    model = convert_to_float8_training(model, config=cfg, module_filter_fn=module_filter_fn)

    def call(*args):
        with torch.autocast(**BF16):
            return model(*args)

    return call


def _loss_and_grads(model: torch.nn.Module, call, batch) -> list[torch.Tensor]:
    loss = call(*batch)
    return [loss, *torch.autograd.grad(loss, list(model.parameters()))]


def _assert_equal(got: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    assert len(got) == len(ref)
    differ = [i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if not torch.equal(a, b)]
    assert not differ, f"{len(differ)} of {len(got)} differ (0: the loss), first {differ[:5]}"


def _float8_weights(gm: torch.fx.GraphModule) -> list[str]:
    """The parameter names of the float8 matmuls' weights, in graph order."""
    out = []
    for node in gm.graph.nodes:
        if getattr(node.target, "__name__", "") == "float8_linear":
            weight = node.args[1]
            out.append((weight.args[0] if weight.op == "call_function" else weight).target)
    return out


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("name", MODELS)
def test_loss_and_every_gradient_equal_torchao(name, scaling):
    ours, theirs = _model(name), _model(name)
    gm = _fmp(ours, scaling)
    linears = [n for n, m in theirs.named_modules() if isinstance(m, torch.nn.Linear)]
    assert len(_float8_weights(gm)) == len(linears)  # the same layers run in float8
    call = _torchao(theirs, scaling)
    for seed in (1, 2):
        _assert_equal(_loss_and_grads(ours, gm, _batch(seed)), _loss_and_grads(theirs, call, _batch(seed)))
    bf16 = fmp.torch.autocast_fx(_model(name), _batch(0), "mixed_bfloat16")
    assert not torch.equal(gm(*_batch(1)), bf16(*_batch(1)))  # float8 really ran


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2),
}


@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("name", MODELS)
def test_twenty_optimizer_steps_keep_parameters_equal_to_torchao(name, scaling, opt):
    ours, theirs = _model(name), _model(name)
    calls = {id(ours): _fmp(ours, scaling), id(theirs): _torchao(theirs, scaling)}
    losses = {}
    for model in (ours, theirs):
        optimizer = OPTIMIZERS[opt](model.parameters())
        losses[id(model)] = []
        for step in range(20):
            optimizer.zero_grad()
            loss = calls[id(model)](*_batch(100 + step % 2))  # two batches, alternating
            loss.backward()
            optimizer.step()
            losses[id(model)].append(loss.item())
    assert losses[id(ours)] == losses[id(theirs)]
    assert losses[id(ours)][-1] < losses[id(ours)][0]  # it trains
    theirs_params = dict(theirs.named_parameters())
    for key, param in ours.named_parameters():
        assert torch.equal(param, theirs_params[key]), key


OPT_OUTS = {
    "lm_head": ["lm_head"],
    "first_and_last_layers": ["layers.0.", "layers.2.", "lm_head"],
}


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("keys", OPT_OUTS.values(), ids=OPT_OUTS)
def test_opt_outs_by_module_path_equal_torchao_module_filter(keys, scaling):
    """``overrides={path: "mixed_bfloat16"}`` keeps those layers bfloat16 linears, exactly what torchao's
    ``module_filter_fn`` leaving them plain ``nn.Linear`` under autocast computes."""
    torch.manual_seed(0)
    ours = _llama(layers=3)
    theirs = copy.deepcopy(ours)
    gm = _fmp(ours, scaling, overrides=dict.fromkeys(keys, "mixed_bfloat16"))
    call = _torchao(theirs, scaling, module_filter_fn=lambda _, fqn: not any(k in fqn for k in keys))
    kept = [n for n, m in theirs.named_modules() if isinstance(m, torch.nn.Linear) and type(m) is torch.nn.Linear]
    assert sorted(f"{n}.weight" for n in kept) == sorted(
        p
        for p in dict(ours.named_parameters())
        if p.endswith(".weight") and p not in _float8_weights(gm) and "norm" not in p and "embed" not in p
    )
    _assert_equal(_loss_and_grads(ours, gm, _batch(1)), _loss_and_grads(theirs, call, _batch(1)))
    head = [n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert head and all(n.args[0].meta["val"].dtype == torch.bfloat16 for n in head)
    assert any("lm_head" in str(n.args[1].args[0].target) for n in head)  # lm_head stays a bfloat16 linear
