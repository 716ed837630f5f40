"""Float8 matmuls next to autocast: the rewritten graph equals torchao's ``Float8Linear`` (``emulate=True``) run
under ``torch.autocast("cpu", bfloat16)`` bit for bit, gradients included (the gradient products come out in
the output gradient's dtype); the emulated products run in float32 whatever autocast surrounds them; a float32
float8 result feeding an autocast op gets autocast's cast."""

from __future__ import annotations

import copy
import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")

from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402

import fmp  # noqa: E402
import fmp.torch  # noqa: E402


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64, bias=False), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 16)
    )


def _policy(scaling: str, **changes) -> fmp.Policy:
    return dataclasses.replace(
        fmp.get_policy("mixed_float8"), float8=fmp.Float8Recipe.from_peer(f"torchao_{scaling}", emulate=True, **changes)
    )


def _loss_and_grads(model: torch.nn.Module, call, x: torch.Tensor) -> list[torch.Tensor]:
    loss = call(x).float().square().mean()
    return [loss, *torch.autograd.grad(loss, [x, *model.parameters()])]


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_bfloat16_outputs_and_gradients_equal_torchao_under_cpu_autocast(scaling):
    """The output gradient arrives in bfloat16, so dx and dW are rounded to bfloat16 before they reach the float32
    operands, as torchao's (and a bfloat16 linear's) backward does."""
    x = (torch.randn(2, 8, 32) * 3).requires_grad_()
    ours = copy.deepcopy(_mlp())
    got = _loss_and_grads(ours, fmp.torch.autocast_fx(ours, (x,), _policy(scaling)), x)
    cfg = dataclasses.replace(Float8LinearConfig.from_recipe_name(scaling), emulate=True)
    ref_model = convert_to_float8_training(_mlp(), config=cfg)

    def ref_call(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return ref_model(x)

    ref = _loss_and_grads(ref_model, ref_call, x)
    assert len(got) == len(ref) == 7  # loss, dx and five parameters
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


@pytest.mark.parametrize("output", ["compute", "float32"])
def test_float8_products_stay_float32_under_an_ambient_autocast(output):
    model, x = _mlp(), torch.randn(4, 32, requires_grad=True)
    gm = fmp.torch.autocast_fx(model, (x,), _policy("tensorwise", output=output))
    plain = _loss_and_grads(model, gm, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = _loss_and_grads(model, gm, x)
    assert all(torch.equal(a, b) for a, b in zip(plain, inside, strict=True))


def test_a_float32_float8_result_feeding_an_autocast_op_is_cast_as_eager_autocast_casts_it():
    class Gram(torch.nn.Module):
        def forward(self, q):
            return q @ q.mT

    model, x = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), Gram()), torch.randn(2, 4, 8)
    policy = _policy("tensorwise", output="float32")
    q = fmp.torch.autocast_fx(model[0], (x,), policy)(x)
    assert q.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = q @ q.mT
    out = fmp.torch.autocast_fx(model, (x,), policy)(x)
    assert ref.dtype == torch.bfloat16 and torch.equal(out, ref.float())  # out: the policy's float32 output


def test_float8_guide_torch_training_loop_runs():
    import re

    from _helpers.common import ROOT

    text = (ROOT / "docs" / "guides" / "float8.md").read_text()
    blocks = [b for b in re.findall(r"^```python\n(.*?)^```", text, re.M | re.S) if "import torch" in b]
    assert len(blocks) == 1
    namespace: dict = {}
    exec(compile(blocks[0], "docs/guides/float8.md", "exec"), namespace)  # noqa: S102
    assert namespace["losses"][-1] < namespace["losses"][0]
    fp8_model, head_bf16 = namespace["float8_model"], namespace["head_bf16"]
    float8 = [n for n in fp8_model.graph.nodes if getattr(n.target, "__name__", "") == "float8_linear"]
    assert len(float8) == 2
    assert sum(getattr(n.target, "__name__", "") == "float8_linear" for n in head_bf16.graph.nodes) == 1
