"""fmp.torch.autocast, custom_fwd/custom_bwd and the legacy cuda.amp names against torch."""

from __future__ import annotations

import threading
import warnings

import pytest

torch = pytest.importorskip("torch")

import fmp  # noqa: E402
import fmp.torch  # noqa: E402
from fmp.torch._autocast import _region_stack  # noqa: E402


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv1d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(24, 8), torch.nn.LayerNorm(8), torch.nn.GELU()
    )


def _fwd_bwd(ctx_factory, dtype):
    net = _net()
    torch.manual_seed(1)
    x, y = torch.randn(5, 3, 8), torch.randint(0, 8, (5,))
    with ctx_factory("cpu", dtype=dtype):
        out = net(x)
        loss = torch.nn.functional.cross_entropy(out, y) + torch.einsum("ij,ij->", out, out).float() * 1e-3
    loss.backward()
    return out, loss, [p.grad for p in net.parameters()]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_default_rules_are_bitwise_torch(dtype):
    ref = _fwd_bwd(torch.autocast, dtype)
    got = _fwd_bwd(fmp.torch.autocast, dtype)
    assert ref[0].dtype == got[0].dtype == dtype
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    for a, b in zip(ref[2], got[2], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_default_rules_object_uses_native_path():
    a = torch.randn(4, 4)
    with fmp.torch.autocast("cpu", rules=fmp.DEFAULT_RULES):
        assert torch.is_autocast_enabled("cpu")
        assert (a @ a).dtype == torch.bfloat16


def test_nesting_disable_and_dtype_switch():
    a = torch.randn(4, 4)
    with fmp.torch.autocast("cpu"):
        assert torch.mm(a, a).dtype == torch.bfloat16
        with fmp.torch.autocast("cpu", enabled=False):
            assert torch.mm(a, a).dtype == torch.float32
        with fmp.torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            assert torch.mm(a, a).dtype == torch.float16
        assert torch.mm(a, a).dtype == torch.bfloat16
    assert torch.mm(a, a).dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
    assert _region_stack() == []


def test_thread_local():
    a = torch.randn(4, 4)
    seen = []
    rules = fmp.DEFAULT_RULES.derive(framework="torch", lower_precision=["aten::tanh"])
    with fmp.torch.autocast("cpu"), fmp.torch.autocast("cpu", rules=rules):
        assert torch.tanh(a).dtype == torch.bfloat16
        t = threading.Thread(target=lambda: seen.append((torch.mm(a, a).dtype, torch.tanh(a).dtype)))
        t.start()
        t.join()
    assert seen == [(torch.float32, torch.float32)]


def test_decorator_and_exceptions_propagate():
    @fmp.torch.autocast("cpu")
    def f(a):
        return a @ a

    assert f(torch.ones(2, 2)).dtype == torch.bfloat16
    with pytest.raises(KeyError), fmp.torch.autocast("cpu"):
        raise KeyError("x")
    assert not torch.is_autocast_enabled("cpu")


def _outcome(fn):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        try:
            fn()
            result = "ok"
        except Exception as e:  # noqa: BLE001 - compared with torch's
            result = (type(e), str(e))
    return result, [(x.category, str(x.message)) for x in w]


@pytest.mark.parametrize(
    "call",
    [
        lambda ac: ac(3),
        lambda ac: ac("nodevice"),
        lambda ac: ac("cpu", dtype=torch.float32),
        lambda ac: ac("cpu", dtype=torch.float64, enabled=False),
        lambda ac: ac("cuda"),
        lambda ac: ac("cpu")(3),
    ],
    ids=["non_str", "unknown_device", "cpu_fp32", "cpu_fp64_disabled", "cuda_missing", "decorate_non_callable"],
)
def test_autocast_misuse_like_torch(call):
    if torch.cuda.is_available():
        pytest.skip("expects a CPU-only torch")
    expected = _outcome(lambda: call(torch.autocast))
    got = _outcome(lambda: call(fmp.torch.autocast))
    assert got == expected


def test_custom_rule_changes_op_dtypes():
    a = torch.randn(4, 4)
    rules = fmp.DEFAULT_RULES.derive(framework="torch", unlisted=["aten::mm"], lower_precision=["aten::tanh"])
    with fmp.torch.autocast("cpu"):
        assert torch.mm(a, a).dtype == torch.bfloat16 and torch.tanh(a).dtype == torch.float32
    with fmp.torch.autocast("cpu", rules=rules):
        assert torch.mm(a, a).dtype == torch.float32  # was bf16 under torch's rules
        assert torch.tanh(a).dtype == torch.bfloat16  # was fp32
        assert torch.nn.functional.linear(a, a).dtype == torch.bfloat16  # untouched rules still apply
        assert (a @ a).dtype == torch.bfloat16  # aten::matmul is still lower precision
        assert torch.tanh(a.double()).dtype == torch.float64  # float64 is never cast
        assert torch.equal(torch.argmax(a, 1), a.argmax(1))  # non-float outputs are untouched
        ints = torch.mm(a.long(), a.long())
        assert ints.dtype == torch.int64  # integers are never cast
        with fmp.torch.autocast("cpu", enabled=False):
            assert torch.tanh(a).dtype == torch.float32
    assert torch.tanh(a).dtype == torch.float32


def test_custom_rules_promote_float32_and_bitwise_against_manual_casts():
    a = torch.randn(4, 4)
    b = a.to(torch.bfloat16)
    rules = fmp.DEFAULT_RULES.derive(framework="torch", device="cpu", float32=["aten::linear"], promote=["aten::add"])
    with fmp.torch.autocast("cpu", rules=rules):
        lin = torch.nn.functional.linear(b, b)
        added = torch.add(b, a)
        ce = torch.nn.functional.cross_entropy(a @ a, torch.tensor([0, 1, 2, 3]))
    assert lin.dtype == torch.float32 and torch.equal(lin, torch.nn.functional.linear(b.float(), b.float()))
    assert added.dtype == torch.float32
    # cross_entropy_loss is float32 in the table: the bf16 matmul output goes back to fp32 first, as in torch
    with torch.autocast("cpu"):
        ref = torch.nn.functional.cross_entropy(a @ a, torch.tensor([0, 1, 2, 3]))
    assert ce.dtype == ref.dtype == torch.float32 and torch.equal(ce, ref)


def test_custom_rules_backward_runs_in_forward_dtypes():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4)
    rules = fmp.DEFAULT_RULES.derive(framework="torch", lower_precision=["aten::tanh"])
    with fmp.torch.autocast("cpu", rules=rules):
        y = torch.tanh(lin(x)).sum()
    y.backward()
    assert lin.weight.grad.dtype == torch.float32
    xb = x.to(torch.bfloat16)
    ref = torch.tanh(torch.nn.functional.linear(xb, lin.weight.to(torch.bfloat16), lin.bias.to(torch.bfloat16)))
    with fmp.torch.autocast("cpu", rules=rules):
        out = torch.tanh(lin(x))
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)


def test_rules_and_policy_arguments_are_checked():
    with pytest.raises(TypeError, match="rules"):
        fmp.torch.autocast("cpu", rules={"aten::mm": "float32"})
    with pytest.raises(ValueError, match="policy"):
        fmp.torch.autocast("cpu", dtype=torch.float16, policy="mixed_bfloat16")


def test_policy_sets_dtype_and_output_casts():
    a = torch.randn(2, 2)
    with fmp.torch.autocast("cpu", policy="mixed_float16") as ctx:
        assert torch.mm(a, a).dtype == torch.float16
    assert ctx.fast_dtype == torch.float16
    with fmp.torch.autocast("cpu", policy="float32"):
        assert torch.mm(a, a).dtype == torch.float32

    @fmp.torch.autocast("cpu", policy="p=f32,c=bf16,o=f32")
    def f(x):
        return x @ x, torch.arange(2)

    out, ints = f(a)
    assert out.dtype == torch.float32 and ints.dtype == torch.int64


# --- custom_fwd / custom_bwd ---------------------------------------------------------------------------------


def _functions(custom_fwd, custom_bwd, **fwd_kw):
    seen = {}

    class F(torch.autograd.Function):
        @staticmethod
        @custom_fwd(**fwd_kw)
        def forward(ctx, a, b):
            seen["fwd"] = (a.dtype, torch.is_autocast_enabled("cpu"))
            ctx.save_for_backward(a, b)
            return a.mm(b)

        @staticmethod
        @custom_bwd(device_type="cpu")
        def backward(ctx, g):
            seen["bwd"] = (g.dtype, torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
            a, b = ctx.saved_tensors
            return g.mm(b.t().to(g.dtype)), a.t().to(g.dtype).mm(g)

    return F.apply, seen


@pytest.mark.parametrize("cast_inputs", [None, torch.float32])
def test_custom_fwd_bwd_like_torch(cast_inputs):
    results = []
    for mod, ac in ((torch.amp, torch.autocast), (fmp.torch, fmp.torch.autocast)):
        fn, seen = _functions(mod.custom_fwd, mod.custom_bwd, device_type="cpu", cast_inputs=cast_inputs)
        a = torch.randn(3, 3, requires_grad=True)
        b = torch.randn(3, 3, dtype=torch.bfloat16, requires_grad=True)
        with ac("cpu"):
            out = fn(a, b)
            out.float().sum().backward()
        results.append((out.dtype, dict(seen), a.grad.dtype))
    assert results[0] == results[1]


def test_custom_fwd_misuse_like_torch():
    for mod in (torch.amp, fmp.torch):
        with pytest.raises(TypeError):
            mod.custom_fwd(lambda ctx: None)
    msgs = []
    for mod in (torch.amp, fmp.torch):
        with pytest.raises(ValueError) as e:
            mod.custom_fwd(device_type=1)
        with pytest.raises(ValueError) as e2:
            mod.custom_bwd(device_type=1)
        msgs.append((str(e.value), str(e2.value)))
    assert msgs[0] == msgs[1]


def test_custom_fwd_sees_custom_rule_region():
    rules = fmp.DEFAULT_RULES.derive(framework="torch", lower_precision=["aten::tanh"])
    fn, seen = _functions(fmp.torch.custom_fwd, fmp.torch.custom_bwd, device_type="cpu", cast_inputs=torch.float32)
    a = torch.randn(3, 3, dtype=torch.bfloat16, requires_grad=True)
    with fmp.torch.autocast("cpu", rules=rules):
        out = fn(a, a)
        assert torch.tanh(out).dtype == torch.bfloat16
    assert seen["fwd"] == (torch.float32, False) and out.dtype == torch.float32


# --- legacy torch.cuda.amp names ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.autocast(),
        lambda m: m.autocast(enabled=False),
        lambda m: m.custom_fwd(lambda ctx, x: x),
        lambda m: m.custom_fwd(cast_inputs=torch.float32),
        lambda m: m.custom_bwd(lambda ctx, g: g),
        lambda m: m.GradScaler(enabled=False),
    ],
    ids=["autocast", "autocast_disabled", "custom_fwd", "custom_fwd_cast", "custom_bwd", "scaler_disabled"],
)
def test_legacy_cuda_amp_warns_like_torch(call):
    if torch.cuda.is_available():
        pytest.skip("expects a CPU-only torch")
    expected = _outcome(lambda: call(torch.cuda.amp))
    got = _outcome(lambda: call(fmp.torch.cuda.amp))
    assert got == expected and expected[1][0][0] is FutureWarning


def test_legacy_custom_fwd_without_device_type_runs():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)

        class F(torch.autograd.Function):
            @staticmethod
            @fmp.torch.cuda.amp.custom_fwd
            def forward(ctx, x):
                return x * 2

            @staticmethod
            @fmp.torch.cuda.amp.custom_bwd
            def backward(ctx, g):
                return g * 2

        x = torch.ones(2, requires_grad=True)
        F.apply(x).sum().backward()
    assert x.grad.tolist() == [2.0, 2.0]


def test_custom_rules_promote_documented_difference():
    # torch's promote starts from the autocast dtype and raises on a third float type; fmp's decide does not
    a = torch.ones(2, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="prioritize"), torch.autocast("cpu"):
        torch.cat([a, a])
    rules = fmp.DEFAULT_RULES.derive(framework="torch", unlisted=["aten::mm"])
    with fmp.torch.autocast("cpu", rules=rules):
        assert torch.cat([a, a]).dtype == torch.float16
        assert torch.cat([a, torch.ones(2)]).dtype == torch.float32  # any float32 wins, as in torch
