"""autocast_fx / autocast_graph: real models, decompositions, traced regions, params, policy, compile, export."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

import fmp  # noqa: E402
import fmp.torch  # noqa: E402

LOW = [torch.bfloat16, torch.float16]
LOW_IDS = ["bf16", "f16"]
TO_COPY = torch.ops.aten._to_copy.default


def _casts(gm):
    return [n for n in gm.graph.nodes if n.target is TO_COPY]


def _node_dtypes(gm, target):
    return [n.meta["val"].dtype for n in gm.graph.nodes if n.target is target]


def _leaves(tree):
    return [x for x in torch.utils._pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _assert_same(got, expected):
    got, expected = _leaves(got), _leaves(expected)
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype
        assert torch.equal(g, e)


# ---- real models: outputs, gradients and buffers bitwise equal to eager torch.autocast -----------


class _Loss(nn.Module):
    """An MLP with LayerNorm and a cross-entropy loss."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 5))

    def forward(self, x, target):
        return nn.functional.cross_entropy(self.net(x), target)


def _encoder():
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), (torch.randn(2, 5, 16),)


def _cnn():
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 10),
    )
    return net, (torch.randn(4, 3, 8, 8),)


def _mlp():
    return _Loss(), (torch.randn(8, 12), torch.randint(0, 5, (8,)))


MODELS = {"transformer_encoder": _encoder, "cnn_batchnorm": _cnn, "mlp_layernorm_ce": _mlp}


def _train_step(model, call, inputs):
    out = call(*inputs)
    loss = out if out.dim() == 0 else out.float().square().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out.detach(), grads, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_outputs_and_gradients_bitwise(name, dtype):
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    gm = fmp.torch.autocast_fx(model, inputs, ("cpu", dtype))

    def eager(*args):
        with torch.autocast("cpu", dtype=dtype):
            return model(*args)

    out_ref, grads_ref, state_ref = _train_step(model, eager, inputs)
    model.load_state_dict(start)  # BatchNorm's running stats moved: start again
    out, grads, state = _train_step(model, gm, inputs)
    _assert_same(out, out_ref)
    assert grads.keys() == grads_ref.keys()
    for key in grads:
        _assert_same(grads[key], grads_ref[key])
    for key in state:  # running_mean / running_var / num_batches_tracked updated the same way
        _assert_same(state[key], state_ref[key])
    assert _casts(gm), "the policy inserted no cast"
    assert not any("autocast" in str(n.target) for n in gm.graph.nodes)


def test_parameters_are_the_modules_own():
    torch.manual_seed(0)
    model, (x, t) = _mlp()
    gm = fmp.torch.autocast_fx(model, (x, t))
    assert dict(gm.named_parameters()).keys() == dict(model.named_parameters()).keys()
    for (_, p), (_, q) in zip(gm.named_parameters(), model.named_parameters(), strict=True):
        assert p is q
    before = gm(x, t)
    with torch.no_grad():  # an optimizer step on the original module is seen by the graph
        model.net[0].weight.mul_(0.5)
    assert not torch.equal(gm(x, t), before)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x, t)
    assert torch.equal(gm(x, t), expected)


def test_calling_convention_is_kept():
    def f(x, pair, scale):
        return {"sum": x * scale + pair[0], "mm": x @ pair[1]}

    args = (torch.randn(3, 3), (torch.randn(3, 3), torch.randn(3, 3)), 2.0)
    gm = fmp.torch.autocast_fx(f, args)
    out = gm(*args)
    assert set(out) == {"sum", "mm"}
    assert out["mm"].dtype == torch.bfloat16 and out["sum"].dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _assert_same(out, f(*args))


# ---- the functional cast cache ------------------------------------------------------------------


class _Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        a = x @ self.w
        b = torch.mm(a, self.w)  # the same weight, the same dtype: one cast
        return torch.cat([b, self.w])  # promote: w in float32 next to a bf16 b


def test_one_cast_per_parameter_per_dtype():
    model, x = _Shared(), torch.randn(3, 4)
    gm = fmp.torch.autocast_fx(model, (x,))
    weight_casts = [n for n in _casts(gm) if n.args[0].op == "get_attr"]
    assert [n.kwargs["dtype"] for n in weight_casts] == [torch.bfloat16]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    _assert_same(gm(x), expected)
    assert gm(x).dtype == torch.float32  # cat promotes to the widest input


# ---- CompositeImplicitAutograd ops: autocast sees their decomposition on CPU --------------------

COMPOSITES = {
    "einsum": (lambda a, b: torch.einsum("ij,jk->ik", a, b), torch.bfloat16),
    "tensordot": (lambda a, b: torch.tensordot(a, b, dims=1), torch.bfloat16),
    "inner": (lambda a, b: torch.inner(a, b.T), torch.bfloat16),
    "multi_dot": (lambda a, b: torch.linalg.multi_dot([a, b, b.T]), torch.bfloat16),
    "kron": (lambda a, b: torch.kron(a, b), torch.float32),  # decomposes into no listed op
    "outer_einsum": (lambda a, b: torch.einsum("i,j->ij", a[0], b[0]), torch.float32),
    # contractions summing one element per output: torch's CPU autocast runs einsum and outer as a mul
    # (float32, as fmp's JAX rule), but matmul and mm as listed ops (bfloat16); FX follows torch
    "outer": (lambda a, b: torch.outer(a[0], b[0]), torch.float32),
    "batch_only_einsum": (lambda a, b: torch.einsum("bi,bj->bij", a, b[:3]), torch.float32),
    "size1_einsum": (lambda a, b: torch.einsum("ik,kj->ij", a[:, :1], b[:1]), torch.float32),
    "size1_matmul": (lambda a, b: a[:, :1] @ b[:1], torch.bfloat16),
}


@pytest.mark.parametrize("name", sorted(COMPOSITES))
def test_composite_ops_match_eager(name):
    fn, out_dtype = COMPOSITES[name]
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = fn(a, b)
    gm = fmp.torch.autocast_fx(fn, (a, b))
    got = gm(a, b)
    assert expected.dtype == out_dtype
    _assert_same(got, expected)


def test_composite_left_whole_when_nothing_changes():
    a = torch.randn(3, 4, dtype=torch.bfloat16)
    gm = fmp.torch.autocast_fx(lambda x: torch.einsum("ij,kj->ik", x, x), (a,))
    assert torch.ops.aten.einsum.default in [n.target for n in gm.graph.nodes]
    assert not _casts(gm)


# ---- traced autocast regions keep their own settings ----------------------------------------------


class _Regions(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        with torch.autocast("cpu", dtype=torch.float16):
            z = y @ y.T
            with torch.autocast("cpu", enabled=False):
                w = z.float() @ y.float()
        return z.float().sum() + w.sum() + (y @ y.T).float().sum()


def test_traced_autocast_regions_keep_their_settings():
    model, x = _Regions(), torch.randn(3, 4)
    gm = fmp.torch.autocast_fx(model, (x,))
    assert not any("autocast" in str(n.target) for n in gm.graph.nodes)
    matmuls = _node_dtypes(gm, torch.ops.aten.matmul.default)
    assert matmuls == [torch.float16, torch.float32, torch.bfloat16]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    _assert_same(gm(x), expected)


def test_export_graph_with_wrap_with_autocast():
    model, x = _Regions(), torch.randn(3, 4)
    ep = torch.export.export(model, (x,))
    hops = [n for n in ep.module().graph.nodes if "wrap_with_autocast" in str(n.target)]
    assert hops, "torch.export no longer emits wrap_with_autocast; update this test"
    gm = fmp.torch.autocast_graph(ep.module(), ("cpu", torch.bfloat16))
    assert not any("wrap_with_autocast" in str(n.target) for n in gm.graph.nodes)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    _assert_same(gm(x), expected)


def test_autocast_graph_does_not_modify_its_input():
    gm = make_fx(lambda a: torch.mm(a, a).exp(), pre_dispatch=True)(torch.ones(2, 2))
    code = gm.code
    out = fmp.torch.autocast_graph(gm, "cpu")
    assert gm.code == code and out is not gm
    assert gm(torch.ones(2, 2)).dtype == torch.float32
    assert out(torch.ones(2, 2)).dtype == torch.bfloat16


# ---- promote and its error ----------------------------------------------------------------------


def test_promote_error_matches_torch():
    a, b = torch.randn(2), torch.randn(2)
    with pytest.raises(RuntimeError, match="prioritize"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.cat([a.half(), b.bfloat16()])
    with pytest.raises(RuntimeError, match="prioritize"):
        fmp.torch.autocast_fx(lambda x, y: torch.cat([x.half(), y.bfloat16()]), (a, b))


def test_float64_is_never_cast():
    a = torch.randn(3, 3, dtype=torch.float64)
    gm = fmp.torch.autocast_fx(lambda x: x @ x, (a,))
    assert not _casts(gm)
    assert gm(a).dtype == torch.float64


# ---- the rule table is the one source of truth -------------------------------------------------


def test_custom_rules_and_teeth():
    a = torch.randn(4, 4)
    rules = fmp.DEFAULT_RULES.derive(framework="torch", device="cpu", float32=["aten::mm"])
    gm = fmp.torch.autocast_fx(lambda x: torch.mm(x, x), (a,), rules=rules)
    assert gm(a).dtype == torch.float32 and not _casts(gm)
    # the bitwise comparisons would notice a missing cast: eager bf16 differs from float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = torch.mm(a, a)
    assert not torch.equal(eager.float(), gm(a))


def test_rules_of_every_cpu_op_are_read_from_default_rules():
    table = fmp.DEFAULT_RULES.table("torch", "cpu")
    assert table["aten::linear"] is fmp.Category.LOWER_PRECISION
    gm = fmp.torch.autocast_fx(lambda x: nn.functional.mse_loss(x @ x, x), (torch.randn(3, 3),))
    assert _node_dtypes(gm, torch.ops.aten.mse_loss.default) == [torch.float32]


# ---- CUDA lists on this CPU machine: fake CUDA tensors, torch's AutocastCUDA kernels as the oracle --

CUDA_CASES = {
    "mm": lambda a: torch.mm(a, a),
    "softmax": lambda a: torch.softmax(a, -1),  # fp32_set_opt_dtype
    "sum": lambda a: a.half().sum(),  # fp32_set_opt_dtype on a half input
    "norm": lambda a: torch.ops.aten.norm.Scalar(a.half(), 2),  # fp32_append_dtype
    "exp_of_mm": lambda a: torch.exp(a @ a),
    "layer_norm": lambda a: nn.functional.layer_norm(a @ a, (4,)),
    "addcmul": lambda a: torch.addcmul(a, a.half(), a.half()),  # promote
    "mv": lambda a: torch.mv(a, a.sum(0)),
    "pow": lambda a: torch.pow(a.half(), 2),
    "einsum": lambda a: torch.einsum("ij,jk->ik", a, a),
    "cat": lambda a: torch.cat([a, a.half()]),  # not listed on CUDA: type promotion
}


def _fake_cuda(shape):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(shape, device="cuda")


@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
@pytest.mark.parametrize("name", sorted(CUDA_CASES))
def test_cuda_rules_on_fake_cuda_tensors(name, dtype):
    from fmp.torch._fx._common import ambient_autocast

    fn = CUDA_CASES[name]
    a = _fake_cuda((4, 4))
    gm = make_fx(fn, pre_dispatch=True)(a)
    with ambient_autocast({"cuda": (True, dtype)}):  # torch's own AutocastCUDA kernels
        expected = fn(a)
    out = fmp.torch.autocast_graph(gm, ("cuda", dtype))
    result = [n for n in out.graph.nodes if n.op == "output"][0].args[0]
    assert result.meta["val"].dtype == expected.dtype
    assert result.meta["val"].device.type == "cuda"


def test_cuda_variants_rewrite_the_call():
    a = _fake_cuda((4, 4))
    gm = make_fx(lambda x: (torch.softmax(x, -1), torch.ops.aten.norm.Scalar(x, 2)), pre_dispatch=True)(a)
    out = fmp.torch.autocast_graph(gm, ("cuda", torch.float16))
    targets = {n.target: n for n in out.graph.nodes if n.op == "call_function"}
    assert targets[torch.ops.aten.softmax.int].kwargs["dtype"] is torch.float32
    assert torch.ops.aten.norm.ScalarOpt_dtype in targets and torch.ops.aten.norm.Scalar not in targets
    assert not _casts(out)  # set_opt_dtype / append_dtype pass a dtype instead of casting


def test_cuda_banned_op_raises_torch_message():
    a = _fake_cuda((4, 4))
    gm = make_fx(lambda x: nn.functional.binary_cross_entropy(x.sigmoid(), x), pre_dispatch=True)(a)
    with pytest.raises(RuntimeError, match="unsafe to autocast"):
        fmp.torch.autocast_graph(gm, ("cuda", torch.float16))
    fmp.torch.autocast_graph(gm, ("cpu", torch.float16))  # CPU lists it as float32, not banned


def test_policy_only_touches_its_device():
    a = _fake_cuda((4, 4))
    gm = make_fx(lambda x: torch.mm(x, x), pre_dispatch=True)(a)
    assert not _casts(fmp.torch.autocast_graph(gm, ("cpu", torch.bfloat16)))


# ---- policy spellings and errors ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "compute", "output"),
    [
        ({"policy": ("cpu", torch.float16)}, torch.float16, torch.float16),
        ({"policy": "cpu"}, torch.bfloat16, torch.bfloat16),
        ({"policy": fmp.get_policy("mixed_float16")}, torch.float16, torch.float32),  # an fmp policy's output
        ({"policy": "mixed_bfloat16"}, torch.bfloat16, torch.float32),
        ({"device_type": "cpu", "dtype": torch.float16}, torch.float16, torch.float16),
        ({"dtype": "f16"}, torch.float16, torch.float16),
        ({}, torch.bfloat16, torch.bfloat16),
    ],
)
def test_policy_spellings(kwargs, compute, output):
    a = torch.randn(2, 2)
    gm = fmp.torch.autocast_fx(lambda x: x @ x, (a,), **kwargs)
    assert _node_dtypes(gm, torch.ops.aten.matmul.default) == [compute] and gm(a).dtype == output


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"policy": ("cpu", torch.float32)}, ValueError, "bfloat16 or torch.float16"),
        ({"policy": ("tpu", torch.float16)}, ValueError, "device_type must be one of"),
        ({"policy": ("cpu", torch.float16), "dtype": torch.float16}, ValueError, "exclusive"),
        ({"policy": 3}, TypeError, "policy must be"),
        ({"policy": "nonsense"}, ValueError, "policy must be"),
        ({"rules": {"aten::mm": "float32"}}, TypeError, "rules must be an fmp.RuleSet"),
    ],
)
def test_policy_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        fmp.torch.autocast_fx(lambda x: x @ x, (torch.randn(2, 2),), **kwargs)


def test_argument_errors():
    with pytest.raises(TypeError, match="example_inputs must be a tuple"):
        fmp.torch.autocast_fx(lambda x: x, torch.randn(2))
    with pytest.raises(TypeError, match="graph_module must be a torch.fx.GraphModule"):
        fmp.torch.autocast_graph(lambda x: x, "cpu")
    # graphs without node metadata: tests/torch/fx/test_fx_errors.py


# ---- explain ------------------------------------------------------------------------------------


def test_explain_fx_report():
    torch.manual_seed(0)
    model, (x, t) = _mlp()
    report = fmp.torch.explain_fx(model, (x, t), ("cpu", torch.bfloat16))
    assert isinstance(report, fmp._report._records.Report)
    assert report.framework == "torch"
    by_op = {r.op: r for r in report.records}
    linear = by_op["aten::linear"]
    assert linear.category == "lower_precision"
    assert linear.in_before == ("float32",) * 3 and linear.out_after == ("bfloat16",)
    assert linear.flops == 2 * 8 * 12 * 32 or linear.flops == 2 * 8 * 32 * 5
    ce = by_op["aten::cross_entropy_loss"]
    assert ce.category == "float32" and ce.in_after == ("float32",)
    # the row shows the path relative to the working directory; the full path is kept
    assert ce.source_full.startswith(__file__ + ":") and "forward" in ce.source
    assert ce.source == os.path.relpath(__file__) + ce.source_full.removeprefix(__file__)
    gm = fmp.torch.autocast_fx(model, (x, t), ("cpu", torch.bfloat16))
    assert report.summary["casts_inserted"] == len(_casts(gm))
    assert "aten::cross_entropy_loss" in str(report)
    assert report.to_dict()["framework"] == "torch"


# ---- torch.compile and torch.export of the result ------------------------------------------------


def test_transformed_module_exports():
    torch.manual_seed(0)
    model, inputs = _cnn()
    model.eval()
    gm = fmp.torch.autocast_fx(model, inputs)
    ep = torch.export.export(gm, inputs)
    _assert_same(ep.module()(*inputs), gm(*inputs))
    dtypes = {n.meta["val"].dtype for n in ep.graph.nodes if n.target is torch.ops.aten.conv2d.default}
    assert dtypes == {torch.bfloat16}


def test_transformed_module_compiles_aot_eager():
    # dynamo + AOTAutograd (the part of torch.compile a graph must survive), without inductor's
    # C++ compile: about 4 s here. The inductor run below takes ~35 s on this machine, so it is slow.
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, inputs = _mlp()
    gm = fmp.torch.autocast_fx(model, inputs)
    compiled = torch.compile(gm, backend="aot_eager", fullgraph=True)
    out = compiled(*inputs)
    out.backward()
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, gm(*inputs), rtol=0, atol=0)


# torch's inductor imports torch.jit.script_method internally, which warns (warnings are errors here)
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_transformed_module_compiles_with_inductor():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, inputs = _mlp()
    gm = fmp.torch.autocast_fx(model, inputs)
    expected = gm(*inputs)
    expected.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    out = torch.compile(gm, fullgraph=True)(*inputs)  # inductor
    out.backward()
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)  # inductor fuses: not bitwise
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=5e-2, atol=5e-2)


# ---- on a GPU: bitwise against eager CUDA autocast ------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_bitwise_on_cuda(name, dtype):
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model = model.cuda()
    inputs = tuple(x.cuda() for x in inputs)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    gm = fmp.torch.autocast_fx(model, inputs, ("cuda", dtype))

    def eager(*args):
        with torch.autocast("cuda", dtype=dtype):
            return model(*args)

    out_ref, grads_ref, _ = _train_step(model, eager, inputs)
    model.load_state_dict(start)
    out, grads, _ = _train_step(model, gm, inputs)
    _assert_same(out, out_ref)
    for key in grads:
        _assert_same(grads[key], grads_ref[key])


def test_cast_made_under_no_grad_is_not_reused_with_grad():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 3))

        def forward(self, x):
            with torch.no_grad():
                stat = (x @ self.w).abs().mean()
            return (x @ self.w).sum() * stat

    model, x = M(), torch.randn(2, 3)
    gm = fmp.torch.autocast_fx(model, (x,))
    gm(x).float().backward()
    grad = model.w.grad.clone()
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    out.float().backward()
    assert torch.equal(grad, model.w.grad)


def test_rewrite_is_idempotent():
    torch.manual_seed(0)
    model, inputs = _mlp()
    gm = fmp.torch.autocast_fx(model, inputs)
    again = fmp.torch.autocast_graph(gm, "cpu")
    assert len(_casts(again)) == len(_casts(gm))
    _assert_same(again(*inputs), gm(*inputs))


def test_python_code_that_asks_for_autocast_takes_the_eager_path():
    def f(x):
        if torch.is_autocast_enabled("cpu"):  # library code does this (e.g. to pick a dtype)
            return (x @ x).float() * 2
        return x @ x

    x = torch.randn(3, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = f(x)
    gm = fmp.torch.autocast_fx(f, (x,))
    _assert_same(gm(x), expected)
    report = fmp.torch.explain_fx(f, (x,))
    mm = report.filter(op="aten::matmul").records[0]
    assert mm.in_before == ("float32", "float32") and mm.out_after == ("bfloat16",)
