"""A float8-rewritten module works with what works today: ``torch.compile`` (aot_eager; inductor in the slow
suite), ``torch.export`` and ``fmp.torch.GradScaler`` under a float16 policy, with both float8 kernels."""

from __future__ import annotations

import copy
import dataclasses

import pytest

torch = pytest.importorskip("torch")

import fmp  # noqa: E402
import fmp.torch  # noqa: E402

# torch 2.13's dynamo warns this for every autograd.Function it traces (a plain one too), not for ours alone
pytestmark = pytest.mark.filterwarnings("ignore:.*autograd.function.Function'> should not be instantiated")

F16 = "p=f32,c=f16,o=f16,float8={}"  # the JAX side's policy string: float16 compute and outputs, float8 matmuls
CASES = [(s, k) for s in ("tensorwise", "rowwise") for k in ("scaled_mm", "emulated")]
IDS = [f"{s}-{k}" for s, k in CASES]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(3)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))


def _gm(scaling: str, kernel: str, x: torch.Tensor, policy: str = "p=f32,c=bf16,o=f32,float8={}"):
    return fmp.torch.autocast_fx(_mlp(), (x,), policy.format(scaling), float8_matmul=kernel)


def _run(fn, model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    out = fn(x)
    out.float().square().mean().backward()
    return [out.detach(), *(p.grad.clone() for p in model.parameters())]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(u.dtype == v.dtype and torch.equal(u, v) for u, v in zip(a, b, strict=True))


@pytest.mark.parametrize(
    ("scaling", "kernel"),
    [pytest.param(s, k, marks=[] if (s, k) == ("rowwise", "scaled_mm") else [pytest.mark.slow]) for s, k in CASES],
    ids=IDS,
)  # one case in the default suite: a first dynamo compile takes seconds
def test_aot_eager_compile_equals_the_module_bit_for_bit(scaling, kernel):
    x = torch.randn(8, 16) * 2
    gm = _gm(scaling, kernel, x)
    compiled = torch.compile(gm, backend="aot_eager", fullgraph=True)
    assert _equal(_run(compiled, gm, x), _run(gm, gm, x))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's import
@pytest.mark.parametrize(
    ("scaling", "kernel", "output"),
    [("tensorwise", "scaled_mm", "compute"), ("rowwise", "scaled_mm", "float32"),
     ("tensorwise", "emulated", "float32"), ("rowwise", "emulated", "compute")],
)  # fmt: skip
def test_inductor_compile_equals_the_module_bit_for_bit(scaling, kernel, output):
    """Inductor keeps the float8 arithmetic bit for bit. Two inductor habits that are not float8's are set
    aside: it skips intermediate bfloat16 roundings unless ``emulate_precision_casts`` is on, and it sums a
    float32 bias gradient in its own order (the float32-output case has no bias)."""
    torch._dynamo.reset()
    x = torch.randn(8, 16) * 2
    pol = dataclasses.replace(fmp.get_policy("mixed_float8"), float8=fmp.Float8Recipe(scaling, output=output))
    model = _mlp() if output == "compute" else torch.nn.Sequential(*(_strip_bias(m) for m in _mlp()))
    gm = fmp.torch.autocast_fx(model, (x,), pol, float8_matmul=kernel)
    with torch._inductor.config.patch(emulate_precision_casts=True):
        compiled = torch.compile(gm, backend="inductor", fullgraph=True)
        assert _equal(_run(compiled, gm, x), _run(gm, gm, x))


def _strip_bias(m: torch.nn.Module) -> torch.nn.Module:
    if isinstance(m, torch.nn.Linear):
        m.bias = None
    return m


@pytest.mark.parametrize(("scaling", "kernel"), CASES, ids=IDS)
def test_export_keeps_the_float8_matmuls(scaling, kernel):
    x = torch.randn(8, 16) * 2
    gm = _gm(scaling, kernel, x)
    ep = torch.export.export(gm, (x,))
    nodes = [n for g in ep.graph_module.modules() if isinstance(g, torch.fx.GraphModule) for n in g.graph.nodes]
    ops = {str(n.target) for n in nodes if n.op == "call_function"}
    assert ("aten._scaled_mm.default" in ops) is (kernel == "scaled_mm")
    assert ("aten.mm.default" in ops) is (kernel == "emulated")
    assert any("float8_e4m3fn" in str(n.meta.get("val", "")) for n in nodes)  # quantised operands
    y = torch.randn(8, 16)
    with torch.no_grad():
        assert torch.equal(ep.module()(y), gm(y))


@pytest.mark.parametrize(("scaling", "kernel"), CASES, ids=IDS)
def test_grad_scaler_with_a_float16_policy_trains_as_torch_amp_and_whatever_the_loss_scale(scaling, kernel):
    """``fmp.torch.GradScaler`` drives the float8 module as ``torch.amp.GradScaler`` does, and current
    scaling takes the loss scale out of every float8 quantisation exactly (a power of two moves the amax and
    the scale together), so two loss scales that neither overflow nor underflow float16 train the same."""
    xs = torch.randn(6, 8, 16)
    runs = []
    for scaler_cls, init_scale in ((fmp.torch.GradScaler, 2.0**10), (torch.amp.GradScaler, 2.0**10),
                                   (fmp.torch.GradScaler, 2.0**13)):  # fmt: skip
        gm = _gm(scaling, kernel, xs[0], F16)
        opt = torch.optim.SGD(gm.parameters(), lr=0.1)
        scaler = scaler_cls("cpu", init_scale=init_scale)
        for x in xs:
            opt.zero_grad()
            out = gm(x)
            assert out.dtype == torch.float16
            scaler.scale(out.float().square().mean()).backward()
            scaler.step(opt)
            scaler.update()
        assert scaler.get_scale() == init_scale  # no step was skipped
        runs.append([p.detach().clone() for p in gm.parameters()])
    assert _equal(runs[0], runs[1]) and _equal(runs[0], runs[2])
    assert not _equal(runs[0], list(_mlp().parameters()))


@pytest.mark.parametrize(("scaling", "kernel"), CASES, ids=IDS)
def test_grad_scaler_skips_a_float16_overflow_the_float8_backward_sees(scaling, kernel):
    """An output gradient that overflows float16 reaches the float8 backward as inf: its quantisation gives
    NaN (never a saturated finite gradient), so the scaler skips the step and backs off, as under float16."""
    x = torch.randn(8, 16) * 4
    gm = _gm(scaling, kernel, x, F16)
    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    scaler = fmp.torch.GradScaler("cpu", init_scale=2.0**24)
    before = copy.deepcopy(list(gm.parameters()))
    opt.zero_grad()
    scaler.scale(gm(x).float().square().mean()).backward()
    assert not torch.isfinite(gm.get_submodule("0").weight.grad).all()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**23
    assert _equal([p.detach() for p in gm.parameters()], [p.detach() for p in before])
