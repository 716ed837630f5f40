"""Float8 over FX graphs: ``autocast_fx`` with a tensorwise or rowwise float8 policy and
``float8_matmul="emulated"`` equals torchao's ``Float8Linear`` (``emulate=True``) bit for bit, forward, every
gradient and 20 SGD steps (the ``torch._scaled_mm`` kernel: test_torch_float8_scaled_mm.py)."""

from __future__ import annotations

import copy
import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")

from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8.config import CastConfig, ScalingGranularity  # noqa: E402

import fmp  # noqa: E402
import fmp.torch  # noqa: E402


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def _torchao(model: torch.nn.Module, name: str, e5m2_grads: bool = True, **changes) -> torch.nn.Module:
    """torchao's named recipe, emulated; rowwise with e5m2 output gradients (fmp's gradient format)."""
    cfg = dataclasses.replace(Float8LinearConfig.from_recipe_name(name), emulate=True, **changes)
    if name == "rowwise" and e5m2_grads:
        cc = CastConfig(scaling_granularity=ScalingGranularity.AXISWISE, target_dtype=torch.float8_e5m2)
        cfg = dataclasses.replace(cfg, cast_config_grad_output=cc, cast_config_grad_output_for_grad_weight=cc)
    return convert_to_float8_training(copy.deepcopy(model), config=cfg)


def _fmp(model: torch.nn.Module, x: torch.Tensor, recipe: fmp.Float8Recipe) -> torch.nn.Module:
    policy = dataclasses.replace(fmp.get_policy("mixed_float8"), float8=recipe)
    return fmp.torch.autocast_fx(copy.deepcopy(model), (x,), policy, float8_matmul="emulated")


def _run(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = model(x)
    out.float().square().sum().backward()
    return out, [p.grad for p in model.parameters()]


# torchao's scales per recipe: tensorwise exact fp8_max / amax, rowwise rounded down to a power of two
TORCHAO_SCALES = {"tensorwise": False, "rowwise": True}


@pytest.mark.parametrize("shape", [(4, 16), (2, 3, 16)], ids=["2d", "3d"])
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_forward_and_gradients_equal_torchao(scaling, shape):
    torch.manual_seed(1)
    x = torch.randn(shape) * 3
    recipe = fmp.Float8Recipe(scaling, pow2_scales=TORCHAO_SCALES[scaling], output="float32")
    out, grads = _run(_fmp(_mlp(), x, recipe), x)
    ref, ref_grads = _run(_torchao(_mlp(), scaling), x)
    assert out.dtype == torch.float32 and torch.equal(out, ref)
    assert len(grads) == 3 and all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))
    bf16, _ = _run(fmp.torch.autocast_fx(_mlp(), (x,), "mixed_bfloat16"), x)
    assert not torch.equal(out.to(torch.bfloat16), bf16)  # float8 really ran


def test_pow2_scales_are_the_documented_difference_from_torchao_tensorwise():
    """fmp rounds scales down to a power of two by default; torchao's tensorwise uses the exact scale. With
    torchao's ``round_scales_to_power_of_2=True`` the two agree again."""
    x = torch.randn(4, 16) * 3
    out, grads = _run(_fmp(_mlp(), x, fmp.Float8Recipe("tensorwise", output="float32")), x)
    exact, _ = _run(_torchao(_mlp(), "tensorwise"), x)
    pow2, pow2_grads = _run(_torchao(_mlp(), "tensorwise", round_scales_to_power_of_2=True), x)
    assert not torch.equal(out, exact)
    assert torch.equal(out, pow2) and all(torch.equal(a, b) for a, b in zip(grads, pow2_grads, strict=True))


def test_rowwise_gradient_format_is_the_documented_difference_from_torchao_rowwise():
    """torchao's named rowwise recipe quantises output gradients to e4m3, fmp's recipe to e5m2: the forward
    agrees bit for bit, the gradients do not (they do with e5m2 gradients, above)."""
    x = torch.randn(4, 16) * 3
    out, grads = _run(_fmp(_mlp(), x, fmp.Float8Recipe("rowwise", output="float32")), x)
    ref, ref_grads = _run(_torchao(_mlp(), "rowwise", e5m2_grads=False), x)
    assert torch.equal(out, ref)
    assert not torch.equal(grads[0], ref_grads[0])


@pytest.mark.parametrize(
    "recipe",
    [
        fmp.Float8Recipe("rowwise", output="float32", grad_dtype="float8_e4m3fn"),
        fmp.Float8Recipe.from_peer("torchao_rowwise", output="float32"),
    ],
)
def test_e4m3_gradients_equal_torchao_named_rowwise_recipe(recipe):
    """With ``grad_dtype="float8_e4m3fn"`` (what ``from_peer("torchao_rowwise")`` sets), fmp's rowwise equals
    torchao's named rowwise recipe bit for bit, gradients included."""
    x = torch.randn(4, 16) * 3
    out, grads = _run(_fmp(_mlp(), x, recipe), x)
    ref, ref_grads = _run(_torchao(_mlp(), "rowwise", e5m2_grads=False), x)
    assert torch.equal(out, ref)
    assert len(grads) == 3 and all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_twenty_sgd_steps_keep_parameters_equal_to_torchao(scaling):
    torch.manual_seed(2)
    xs = torch.randn(20, 4, 16)
    ours = _fmp(_mlp(), xs[0], fmp.Float8Recipe(scaling, pow2_scales=TORCHAO_SCALES[scaling], output="float32"))
    ref = _torchao(_mlp(), scaling)
    for model in (ours, ref):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for x in xs:
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), ref.parameters(), strict=True))


def test_compute_output_is_the_float32_result_rounded_to_bfloat16():
    lin = torch.nn.Linear(16, 8, bias=False)
    x = torch.randn(4, 16)
    out = fmp.torch.autocast_fx(lin, (x,), "mixed_float8", float8_matmul="emulated")(x)  # tensorwise, pow2
    ref = _torchao(lin, "tensorwise", round_scales_to_power_of_2=True)(x)
    assert out.dtype == torch.float32 and torch.equal(out, ref.to(torch.bfloat16).float())  # policy output: f32


def test_only_matmuls_against_a_parameter_run_in_float8():
    """An activation x activation product stays in the compute dtype, as in torchao's default scope."""

    class Attn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 8, bias=False)

        def forward(self, x):
            q = self.proj(x)
            return torch.matmul(q, q.transpose(-1, -2))

    x = torch.randn(2, 4, 8)
    gm = fmp.torch.autocast_fx(Attn(), (x,), "mixed_float8")
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert sum(getattr(t, "__name__", "") == "float8_linear" for t in targets) == 1
    assert torch.ops.aten.matmul.default in targets
    assert gm(x).dtype == torch.float32  # the policy's output dtype


@pytest.mark.parametrize("scaling", ["blockwise", "delayed"])
def test_recipes_without_a_torch_pass_are_refused(scaling):
    policy = dataclasses.replace(fmp.get_policy("mixed_float8"), float8=fmp.Float8Recipe(scaling))
    with pytest.raises(NotImplementedError, match=rf"tensorwise.*rowwise.*{scaling}"):
        fmp.torch.autocast_fx(torch.nn.Linear(4, 3), (torch.ones(2, 4),), policy)


class _Plain(torch.nn.Module):
    """The same layer written as ``x @ w``, ``torch.mm`` or ``torch.addmm`` against a ``[k, n]`` parameter."""

    def __init__(self, lin: torch.nn.Linear, how: str) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(lin.weight.detach().t().clone())
        self.b = torch.nn.Parameter(lin.bias.detach().clone())
        self.how = how

    def forward(self, x):
        if self.how == "matmul":
            return x @ self.w + self.b
        if self.how == "mm":
            return torch.mm(x, self.w) + self.b
        return torch.addmm(self.b, x, self.w)


@pytest.mark.parametrize("how", ["matmul", "mm", "addmm"])
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_mm_addmm_matmul_against_a_parameter_equal_torchao_linear(scaling, how):
    torch.manual_seed(3)
    lin, x = torch.nn.Linear(16, 8), torch.randn(4, 16)
    recipe = fmp.Float8Recipe(scaling, pow2_scales=TORCHAO_SCALES[scaling], output="float32")
    out, (dw, db) = _run(_fmp(_Plain(lin, how), x, recipe), x)
    ref, (ref_dw, ref_db) = _run(_torchao(lin, scaling), x)
    assert torch.equal(out, ref) and torch.equal(dw, ref_dw.t()) and torch.equal(db, ref_db)


@pytest.mark.parametrize("where", ["input", "weight"])
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_an_inf_gives_non_finite_results_where_torchao_has_them(scaling, where):
    """An overflow stays visible: an inf operand never comes out as a saturated, finite, wrong product."""
    x = torch.randn(4, 16)
    model = _mlp()
    if where == "input":
        x[1, 3] = torch.inf
    else:
        with torch.no_grad():
            model[0].weight[2, 5] = torch.inf
    recipe = fmp.Float8Recipe(scaling, pow2_scales=TORCHAO_SCALES[scaling], output="float32")
    out, grads = _run(_fmp(model, x, recipe), x)
    ref, ref_grads = _run(_torchao(model, scaling), x)
    assert not torch.isfinite(out).all()
    for a, b in zip([out, *grads], [ref, *ref_grads], strict=True):
        assert torch.equal(torch.isfinite(a), torch.isfinite(b))


def _float8_calls(gm: torch.fx.GraphModule) -> int:
    return sum(getattr(n.target, "__name__", "") == "float8_linear" for n in gm.graph.nodes)


def test_overrides_opt_a_module_out_of_float8_by_its_path():
    model, x = _mlp(), torch.randn(4, 16)
    gm = fmp.torch.autocast_fx(model, (x,), "mixed_float8", overrides={"2": "mixed_bfloat16"})
    assert _float8_calls(gm) == 1
    hidden = torch.relu(fmp.torch.autocast_fx(model[0], (x,), "mixed_float8")(x)).bfloat16()  # output f32
    ref = torch.nn.functional.linear(hidden, model[2].weight.bfloat16(), model[2].bias.bfloat16())
    assert torch.equal(gm(x), ref)  # the opted-out layer is the plain bfloat16 linear


def test_overrides_that_ask_for_more_than_an_opt_out_are_refused_and_unused_keys_warn():
    model, x = _mlp(), torch.randn(4, 16)
    for value in ("p=f32,c=bf16,o=f32,float8=rowwise", "mixed_float16"):
        with pytest.raises(NotImplementedError, match="opts modules out of float8"):
            fmp.torch.autocast_fx(model, (x,), "mixed_float8", overrides={"2": value})
    with pytest.raises(NotImplementedError, match="nothing to opt out of"):
        fmp.torch.autocast_fx(model, (x,), "mixed_bfloat16", overrides={"2": "mixed_bfloat16"})
    with pytest.warns(UserWarning, match="'lm_head' matches no module path"):
        gm = fmp.torch.autocast_fx(model, (x,), "mixed_float8", overrides={"lm_head": "mixed_bfloat16"})
    assert _float8_calls(gm) == 2


def test_explain_fx_shows_each_float8_matmul_with_its_recipe_and_the_float8_flop_share():
    report = fmp.torch.explain_fx(_mlp(), (torch.randn(4, 16),), "p=f32,c=bf16,o=f32,float8=rowwise")
    rows = [r for r in report.records if r.category == "float8"]
    assert [(r.op, r.detail, r.in_after, r.out_after) for r in rows] == [
        ("fmp::float8_linear", "rowwise, scaled_mm (aten::linear)", ("float8_e4m3fn", "float8_e4m3fn"), ("bfloat16",))
    ] * 2
    assert [r.flops for r in rows] == [2 * 4 * 16 * 32, 2 * 4 * 32 * 8]
    assert report.summary["float8_flop_share"] == 1.0
    with pytest.raises(NotImplementedError, match="delayed"):
        fmp.torch.explain_fx(_mlp(), (torch.randn(4, 16),), "p=f32,c=bf16,o=f32,float8=delayed")


def test_a_recipe_field_the_torch_pass_does_not_read_is_refused_not_ignored():
    @dataclasses.dataclass(frozen=True)
    class Later(fmp.Float8Recipe):
        extra: str = "default"

    policy = dataclasses.replace(fmp.get_policy("mixed_float8"), float8=Later("tensorwise", extra="other"))
    with pytest.raises(NotImplementedError, match=r"extra='other'"):
        fmp.torch.autocast_fx(torch.nn.Linear(4, 3), (torch.ones(2, 4),), policy)
    ok = dataclasses.replace(policy, float8=Later("tensorwise"))
    assert fmp.torch.autocast_fx(torch.nn.Linear(4, 3), (torch.ones(2, 4),), ok)(torch.ones(2, 4)).isfinite().all()


def test_an_opt_out_key_never_matches_inside_a_number():
    from fmp._core._scopes import matches

    assert matches("layers.1.mlp", "layers.1") and not matches("layers.10.mlp", "layers.1")
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(12)])
    x = torch.randn(4, 16)
    gm = fmp.torch.autocast_fx(model, (x,), "mixed_float8", overrides={"1": "mixed_bfloat16"})
    rep = fmp.torch.explain_fx(model, (x,), "mixed_float8", overrides={"1": "mixed_bfloat16"})
    fp8 = [r.scope for r in rep.records if r.category == "float8"]
    assert "1" not in fp8 and {"10", "11"} <= set(fp8)  # only module 1 opted out, not 10 and 11
    assert gm(x).shape == (4, 16)
