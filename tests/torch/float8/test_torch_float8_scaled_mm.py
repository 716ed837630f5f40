"""Float8 over FX graphs through ``torch._scaled_mm``: ``autocast_fx`` equals torchao's ``Float8Linear`` with
``emulate=False`` bit for bit (forward, every gradient, 20 SGD and AdamW steps), picks the kernel per device,
and differs from the emulation exactly where the documentation says."""

from __future__ import annotations

import copy
import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")

from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402

import fmp  # noqa: E402
import fmp.torch  # noqa: E402
from fmp.torch._fx import _float8  # noqa: E402

# fmp's spelling of torchao's named recipes, with float32 results as torchao's float32 module gives
PEER = {name: fmp.Float8Recipe.from_peer(f"torchao_{name}", output="float32") for name in ("tensorwise", "rowwise")}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(7)  # every test's data, whatever ran before it


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def _torchao(model: torch.nn.Module, name: str) -> torch.nn.Module:
    cfg = Float8LinearConfig.from_recipe_name(name)
    assert cfg.emulate is False  # torchao's default: torch._scaled_mm
    return convert_to_float8_training(copy.deepcopy(model), config=cfg)


def _fmp(model: torch.nn.Module, x: torch.Tensor, recipe: fmp.Float8Recipe, **kw) -> torch.fx.GraphModule:
    policy = dataclasses.replace(fmp.get_policy("mixed_float8"), float8=recipe, **kw.pop("policy", {}))
    return fmp.torch.autocast_fx(copy.deepcopy(model), (x,), policy, **kw)


def _run(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    out = model(x)
    out.float().square().sum().backward()
    return [out, *(p.grad for p in model.parameters())]


def _kernels(gm: torch.fx.GraphModule) -> list[str]:
    return [n.args[-1] for n in gm.graph.nodes if getattr(n.target, "__name__", "") == "float8_linear"]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(u.dtype == v.dtype and torch.equal(u, v) for u, v in zip(a, b, strict=True))


@pytest.mark.parametrize("shape", [(4, 16), (2, 3, 16)], ids=["2d", "3d"])
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_forward_and_every_gradient_equal_torchao_scaled_mm(scaling, shape):
    torch.manual_seed(1)
    x = torch.randn(shape) * 3
    gm = _fmp(_mlp(), x, PEER[scaling])
    assert _kernels(gm) == ["scaled_mm"] * 2  # "auto" on this CPU: torch._scaled_mm runs here
    ours, ref = _run(gm, x), _run(_torchao(_mlp(), scaling), x)
    assert ours[0].dtype == torch.float32 and _equal(ours, ref)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_twenty_steps_keep_parameters_equal_to_torchao_scaled_mm(scaling, optimizer):
    torch.manual_seed(2)
    xs = torch.randn(20, 4, 16) * 2
    models = [_fmp(_mlp(), xs[0], PEER[scaling], float8_matmul="scaled_mm"), _torchao(_mlp(), scaling)]
    for model in models:
        params = list(model.parameters())
        opt = torch.optim.SGD(params, lr=0.05) if optimizer == "sgd" else torch.optim.AdamW(params, lr=1e-2)
        for x in xs:
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    ours, ref = (list(m.parameters()) for m in models)
    assert _equal(ours, ref)
    assert not _equal(ours, list(_mlp().parameters()))  # they trained


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_each_kernel_equals_its_torchao_mode(scaling):
    """``float8_matmul="emulated"`` is torchao's ``emulate=True``, ``"scaled_mm"`` its ``emulate=False``."""
    x = torch.randn(4, 16) * 3
    for kernel, emulate in (("emulated", True), ("scaled_mm", False)):
        cfg = dataclasses.replace(Float8LinearConfig.from_recipe_name(scaling), emulate=emulate)
        ref = _run(convert_to_float8_training(_mlp(), config=cfg), x)
        assert _equal(_run(_fmp(_mlp(), x, PEER[scaling], float8_matmul=kernel), x), ref), kernel


def test_rowwise_scaled_mm_results_are_the_emulated_ones_rounded_to_bfloat16():
    """The documented difference between the kernels for rowwise: torch._scaled_mm's rowwise products come
    out in bfloat16 (as torchao's), so a float32 result, input gradient and weight gradient are the
    emulated ones rounded to bfloat16 (exactly, with the recipe's power-of-two scales)."""
    torch.manual_seed(4)
    lin, x, g = torch.nn.Linear(16, 8, bias=False), torch.randn(4, 16) * 3, torch.randn(4, 8)
    results = {}
    for kernel in ("scaled_mm", "emulated"):
        xg = x.clone().requires_grad_()
        gm = _fmp(lin, x, PEER["rowwise"], float8_matmul=kernel)
        out = gm(xg)
        out.backward(g)
        results[kernel] = [out, xg.grad, gm.weight.grad]
    for scaled, emulated in zip(results["scaled_mm"], results["emulated"], strict=True):
        assert scaled.dtype == emulated.dtype == torch.float32
        assert not torch.equal(scaled, emulated) and torch.equal(scaled, emulated.bfloat16().float())


def test_tensorwise_kernels_agree_with_power_of_two_scales_and_differ_in_the_last_bits_without():
    """Dividing by a scale (the emulation) and multiplying by its reciprocal (torch._scaled_mm) are the same
    for power-of-two scales (fmp's default), not for torchao's exact ``fp8_max / amax``."""
    x = torch.randn(4, 16) * 3
    for pow2 in (True, False):
        recipe = fmp.Float8Recipe("tensorwise", pow2_scales=pow2, output="float32")
        scaled = _run(_fmp(_mlp(), x, recipe, float8_matmul="scaled_mm"), x)
        emulated = _run(_fmp(_mlp(), x, recipe, float8_matmul="emulated"), x)
        assert _equal(scaled, emulated) is pow2


@pytest.mark.parametrize("kernel", ["scaled_mm", "emulated"])
def test_an_outer_torch_autocast_changes_nothing(kernel):
    """The float8 products run with autocast off: calling the rewritten module (forward and backward) inside
    ``torch.autocast`` computes what it computes outside."""
    x = torch.randn(4, 16) * 3
    gm = _fmp(_mlp(), x, PEER["rowwise"], float8_matmul=kernel)
    plain = _run(gm, x)
    gm.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = _run(gm, x)
    assert _equal(plain, inside)


def test_a_float32_float8_result_is_cast_for_the_next_lower_precision_op():
    """The float8 matmul's float32 result is recorded as float32 in the graph, so the opted-out bfloat16
    layer after it gets its input cast, as under eager autocast."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 8, bias=False), torch.nn.Linear(8, 4))
    x, policy = torch.randn(2, 16), dataclasses.replace(fmp.get_policy("mixed_float8"), float8=PEER["tensorwise"])
    for kernel in ("scaled_mm", "emulated"):
        gm = fmp.torch.autocast_fx(model, (x,), policy, overrides={"1": "mixed_bfloat16"}, float8_matmul=kernel)
        hidden = fmp.torch.autocast_fx(model[0], (x,), policy, float8_matmul=kernel)(x)
        assert hidden.dtype == torch.float32
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref = model[1](hidden)
        assert torch.equal(gm(x), ref), kernel


def test_explain_rows_show_scaling_and_kernel():
    x = torch.randn(4, 16)
    for kernel in ("auto", "emulated"):
        report = fmp.torch.explain_fx(_mlp(), (x,), "p=f32,c=bf16,o=f32,float8=rowwise", float8_matmul=kernel)
        details = [r.detail for r in report.records if r.category == "float8"]
        name = "scaled_mm" if kernel == "auto" else kernel
        assert details == [f"rowwise, {name} (aten::linear)"] * 2
        assert report.summary["float8_flop_share"] == 1.0


def test_auto_falls_back_to_the_emulation_where_scaled_mm_does_not_run(monkeypatch):
    monkeypatch.setattr(_float8, "scaled_mm_error", lambda device, rowwise: "RuntimeError: not on this device")
    x = torch.randn(4, 16)
    assert _kernels(_fmp(_mlp(), x, PEER["rowwise"])) == ["emulated"] * 2
    with pytest.raises(RuntimeError, match=r"float8_matmul='scaled_mm'.*\[4, 16\] @ \[16, 32\].*not on this"):
        _fmp(_mlp(), x, PEER["rowwise"], float8_matmul="scaled_mm")


def test_bad_float8_matmul_values_are_refused():
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match=r"float8_matmul must be 'auto'.*got 'cublas'"):
        _fmp(_mlp(), x, PEER["rowwise"], float8_matmul="cublas")
    with pytest.raises(ValueError, match=r"float8_matmul='emulated'.*'mixed_bfloat16' runs none"):
        fmp.torch.autocast_fx(_mlp(), (x,), "mixed_bfloat16", float8_matmul="emulated")
    with pytest.raises(ValueError, match=r"float8_matmul must be"):
        fmp.torch.explain_fx(_mlp(), (x,), "mixed_float8", float8_matmul="fast")


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_compute_dtype_results_and_gradients_equal_torchao_scaled_mm_under_cpu_autocast(scaling):
    """With the recipe's default bfloat16 output, the products come out in bfloat16 (forward) and in the
    output gradient's bfloat16 (backward), as torchao's run under ``torch.autocast("cpu", bfloat16)``."""
    x = (torch.randn(2, 8, 16) * 3).requires_grad_()
    recipe = fmp.Float8Recipe.from_peer(f"torchao_{scaling}")
    ours = _fmp(_mlp(), x, recipe, policy={"output_dtype": fmp.get_policy("bf16").compute_dtype})  # as autocast
    assert _kernels(ours) == ["scaled_mm"] * 2
    ref = _torchao(_mlp(), scaling)
    results = []
    for model in (ours, ref):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=model is ref):
            out = model(x)
        loss = out.float().square().mean()
        results.append([out, *torch.autograd.grad(loss, [x, *model.parameters()])])
    assert results[0][0].dtype == torch.bfloat16 and _equal(*results)


def test_a_matmul_fed_directly_by_a_float8_matmul_runs_in_float8_too():
    """Two linear layers back to back (a low-rank factorisation) are both float8 layers, as in torchao."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 4, bias=False), torch.nn.Linear(4, 8))
    x = torch.randn(2, 16) * 3
    gm = _fmp(model, x, PEER["tensorwise"])
    assert _kernels(gm) == ["scaled_mm"] * 2
    assert _equal(_run(gm, x), _run(_torchao(model, "tensorwise"), x))


def test_cuda_shapes_off_the_kernels_alignment_take_the_emulation_or_are_refused(monkeypatch):
    """CUDA's float8 GEMMs need m, k and n to be multiples of 16: "auto" emulates such a matmul (the explain
    row says so), "scaled_mm" refuses it at trace time instead of failing in the first call."""
    monkeypatch.setattr(_float8, "scaled_mm_error", lambda device, rowwise: None)
    assert _float8._kernel("auto", "cuda", "rowwise", (32, 64, 16)) == "scaled_mm"
    assert _float8._kernel("auto", "cuda", "rowwise", (4, 64, 16)) == "emulated"
    with pytest.raises(RuntimeError, match=r"\[4, 64\] @ \[64, 16\].*multiples of 16"):
        _float8._kernel("scaled_mm", "cuda", "tensorwise", (4, 64, 16))


def test_the_recipes_emulate_field_chooses_the_kernel_as_on_the_jax_side():
    from fmp.torch._fx._float8 import check_kernel

    pol = "mixed_float8"
    assert check_kernel("auto", fmp.Float8Recipe(emulate=True), pol) == "emulated"
    assert check_kernel("auto", fmp.Float8Recipe(emulate=False), pol) == "scaled_mm"
    assert check_kernel("auto", fmp.Float8Recipe(), pol) == "auto"
    with pytest.raises(ValueError, match=r"contradicts the policy's Float8Recipe\(emulate=True\)"):
        check_kernel("scaled_mm", fmp.Float8Recipe(emulate=True), pol)
