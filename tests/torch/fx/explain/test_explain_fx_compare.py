"""explain_fx(compare=True): every op of the autocast graph against the graph as written, gradients, fixes."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import fmp  # noqa: E402
import fmp.torch  # noqa: E402

CPU = ("cpu", torch.bfloat16)


def _apply(fix: str, rules=None) -> dict:
    """The keyword argument a suggestion names, built by running its code."""
    scope = {"fmp": fmp, "rules": rules}
    exec(fix, scope)  # noqa: S102 - the suggestion is code written for the user to paste
    return {k: scope[k] for k in ("overrides", "rules") if k in fix.split("=", 1)[0]}


def _rel(got, want) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want))


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8)), torch.randn(16, 32)


class _Attention(nn.Module):
    """Scores in float32 (the program opts them out of autocast) plus a large position bias."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        with torch.autocast("cpu", enabled=False):
            scores = q.float() @ k.float().transpose(-1, -2) * 0.25 + 100.0
        return torch.softmax(scores, -1) @ v


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre, self.attn, self.out = nn.Linear(16, 16), _Attention(), nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.attn(torch.tanh(self.pre(x))))


# a rule table that runs softmax in bfloat16: the planted defect
SOFTMAX_BF16 = fmp.DEFAULT_RULES.derive(framework="torch", lower_precision=["aten::softmax.int"])


def test_same_rows_as_without_compare():
    model, x = _mlp()
    plain = fmp.torch.explain_fx(model, (x,), CPU)
    rep = fmp.torch.explain_fx(model, (x,), CPU, compare=True)
    assert [(r.op, r.category, r.in_after, r.out_after, r.scope) for r in rep.records] == [
        (r.op, r.category, r.in_after, r.out_after, r.scope) for r in plain.records
    ]
    assert rep.compared and not plain.compared and rep.to_dict()["compared"]
    assert all(r.error is not None for r in rep.records if r.category != "cast")
    with pytest.raises(ValueError, match="compare=True"):
        plain.worst()


def test_error_is_the_relative_l2_against_float32_eager():
    model, x = _mlp()
    rep = fmp.torch.explain_fx(model[0], (x,), CPU, compare=True)
    (row,) = [r for r in rep.records if r.op == "aten::linear"]
    with torch.no_grad():
        want = model[0](x)
        got = nn.functional.linear(x.bfloat16(), model[0].weight.bfloat16(), model[0].bias.bfloat16())
    assert row.error == pytest.approx(_rel(got, want), rel=1e-6)
    assert row.added_error == pytest.approx(row.error)  # exact inputs, cast by its own rule: all its own
    assert row.max_abs_error == pytest.approx(float((got.double() - want.double()).abs().max()), rel=1e-6)
    assert row.sqnr_db == pytest.approx(-20 * math.log10(row.error), rel=1e-6)
    assert 0 < row.error < 2**-8 and row.suggestion is None and not row.nonfinite and row.flips == 0


def test_inherited_error_is_not_added_error_and_exact_ops_report_zero():
    torch.manual_seed(1)
    lin, x = nn.Linear(8, 8), torch.randn(4, 8)

    def f(x):
        return torch.tanh(lin(x.relu())).float() * 2.0

    rep = fmp.torch.explain_fx(f, (x,), CPU, compare=True)
    ops = {r.op: r for r in rep.records if r.category != "cast"}
    relu, tanh, mul = ops["aten::relu"], ops["aten::tanh"], ops["aten::mul.Tensor"]
    assert relu.error == 0.0 and relu.added_error == 0.0 and relu.sqnr_db == math.inf  # before any cast
    assert tanh.error > 0 and 0 < tanh.added_error < 2**-8  # one bfloat16 rounding of its own
    assert mul.error > 0 and mul.added_error == 0.0  # a float32 op on the policy's values adds nothing
    with torch.autocast("cpu", torch.bfloat16):
        eager = f(x)
    assert mul.error == pytest.approx(_rel(eager, _f32(f, x)), rel=1e-6)


def _f32(f, x):
    with torch.autocast("cpu", enabled=False):
        return f(x)


def test_planted_softmax_in_bfloat16_ranks_first_and_the_suggestion_fixes_it():
    torch.manual_seed(0)
    model, x = _Block(), torch.randn(32, 16) * 3
    rep = fmp.torch.explain_fx(model, (x,), CPU, rules=SOFTMAX_BF16, compare=True)
    top = rep.worst(1)[0]
    assert top.op == "aten::softmax.int" and top.scope == "attn" and top.added_error > 4 * 2**-8
    # the softmax's own line: the attn scope also holds the q, k, v matmuls, which stay in bfloat16
    line = top.source.split(" (")[0]
    src, start = inspect.getsourcelines(_Attention.forward)
    softmax_line = start + next(i for i, text in enumerate(src) if "torch.softmax" in text)
    assert line.endswith(f".py:{softmax_line}") and top.suggestion == f'overrides={{"{line}": "float32"}}'
    assert all(r.suggestion is None for r in rep.records if r is not top)
    text = str(rep)
    assert text.index("aten::softmax.int") < text.index("fmp precision report") and "fix: overrides=" in text
    fix = _apply(top.suggestion)
    fixed = fmp.torch.explain_fx(model, (x,), CPU, rules=SOFTMAX_BF16, compare=True, **fix)
    (softmax,) = [r for r in fixed.records if r.op == "aten::softmax.int"]
    assert softmax.category == "override" and softmax.added_error == 0.0 and softmax.out_after == ("float32",)
    linears = [r for r in fixed.records if r.scope.startswith("attn.") and r.op.startswith("aten::linear")]
    assert len(linears) == 3 and all(r.out_after == ("bfloat16",) for r in linears)
    want = model(x)
    broken = fmp.torch.autocast_fx(model, (x,), CPU, rules=SOFTMAX_BF16)(x)
    repaired = fmp.torch.autocast_fx(model, (x,), CPU, rules=SOFTMAX_BF16, **fix)(x)
    assert _rel(repaired, want) < _rel(broken, want) / 10


def test_rule_table_suggestion_for_an_op_outside_any_submodule():
    torch.manual_seed(0)
    x = torch.randn(16, 32) * 3 + 100.0

    def f(x):
        return torch.softmax(x, -1)

    rep = fmp.torch.explain_fx(f, (x,), CPU, rules=SOFTMAX_BF16, compare=True)
    top = rep.worst(1)[0]
    assert top.op == "aten::softmax.int" and top.scope == ""
    # no source line for a traced function's op: the rules it ran under, spelled in full, with the op moved
    assert top.suggestion == 'rules=fmp.DEFAULT_RULES.derive(framework="torch", float32=["aten::softmax.int"])'
    fixed = fmp.torch.explain_fx(f, (x,), CPU, compare=True, **_apply(top.suggestion))
    assert fixed.worst(1)[0].added_error < top.added_error / 100


class _Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(32, 8, bias=False)
        with torch.no_grad():  # near-tied experts: bfloat16 logits reorder them
            self.router.weight.copy_(torch.randn(1, 32) + 1e-3 * torch.randn(8, 32))

    def forward(self, x):
        return torch.topk(self.router(x), 2).indices


def test_planted_router_flips_found_and_fixed():
    torch.manual_seed(0)
    model, x = _Router(), torch.randn(256, 32)
    rep = fmp.torch.explain_fx(model, (x,), CPU, compare=True)
    (topk,) = [r for r in rep.records if r.op == "aten::topk"]
    assert topk.flips > 0 and topk in rep.worst(2)
    assert topk.suggestion == 'overrides={"router": "float32"}'  # where the logits lost their precision
    want = model(x)
    assert topk.flips == int((fmp.torch.autocast_fx(model, (x,), CPU)(x) != want).sum())
    fix = _apply(topk.suggestion)
    assert all(r.flips == 0 for r in fmp.torch.explain_fx(model, (x,), CPU, compare=True, **fix).records)
    assert torch.equal(fmp.torch.autocast_fx(model, (x,), CPU, **fix)(x), want)


def test_float16_overflow_is_flagged_first():
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)
    with torch.no_grad():
        lin.weight.fill_(20.0)
    x = torch.rand(8, 16) + 1.0

    def f(x):
        h = lin(x)  # about 500: fine in float16
        return torch.sqrt(h * h + 1.0).mean()  # h*h about 2.5e5: inf in float16

    rep = fmp.torch.explain_fx(f, (x,), ("cpu", torch.float16), compare=True)
    top = rep.worst(1)[0]
    assert top.op == "aten::mul.Tensor" and top.nonfinite and top.added_error == math.inf
    assert top.suggestion == 'rules=fmp.DEFAULT_RULES.derive(framework="torch", float32=["aten::mul.Tensor"])'
    downstream = [r for r in rep.records if r.nonfinite and r is not top]
    assert downstream and all(r.suggestion is None for r in downstream)  # they only inherit the inf
    # the report states the overflow's size and folds the rows that inherit it into it
    head = str(rep).split("\n\nfmp precision report", 1)[0]
    assert top.ref_max > 65504 and f"|x| up to {top.ref_max:.1e}, float16 max 65504" in head
    assert "downstream inherit" in head and head.count("NON-FINITE") == 1


class _Loss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x).square().mean()


def test_gradients_against_float32_eager_backward():
    model, x = _mlp()
    loss = _Loss(model)
    rep = fmp.torch.explain_fx(loss, (x,), CPU, compare=True, grads=True)
    names = [n for n, _ in loss.named_parameters()]
    assert sorted(rep.grad_errors) == sorted(names)
    ref = torch.autograd.grad(loss(x), list(loss.parameters()))
    with torch.autocast("cpu", torch.bfloat16):
        out = loss(x).float()
    got = torch.autograd.grad(out, list(loss.parameters()))
    for name, g, r in zip(names, got, ref, strict=True):
        ge = rep.grad_errors[name]
        cos = float(torch.nn.functional.cosine_similarity(g.double().flatten(), r.double().flatten(), dim=0))
        assert ge.error == pytest.approx(_rel(g, r), rel=1e-6, abs=1e-12)
        assert ge.cosine == pytest.approx(cos, abs=1e-9) and ge.cosine > 0.99 and not ge.nonfinite
    assert "gradients (under the policy" in str(rep) and rep.to_dict()["grads"]["errors"][names[0]]["cosine"] > 0.99


def test_refusals_name_the_way_out():
    model, x = _mlp()
    with pytest.raises(ValueError, match="add compare=True"):
        fmp.torch.explain_fx(model, (x,), CPU, grads=True)
    with pytest.raises(ValueError, match="one floating scalar"):
        fmp.torch.explain_fx(model, (x,), CPU, compare=True, grads=True)
    with pytest.raises(NotImplementedError, match="float8"):
        fmp.torch.explain_fx(model, (x,), "mixed_float8", compare=True)
    drop = nn.Sequential(model, nn.Dropout(0.1))
    with pytest.raises(ValueError, match=r"model\.eval\(\)"):
        fmp.torch.explain_fx(drop, (x,), CPU, compare=True)
    assert fmp.torch.explain_fx(drop.eval(), (x,), CPU, compare=True).compared


def test_buffers_and_inputs_are_left_as_they_were():
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)), torch.randn(16, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x0 = x.clone()
    rep = fmp.torch.explain_fx(model, (x,), CPU, compare=True)
    assert any(r.error for r in rep.records)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and torch.equal(x, x0)


def test_torch_and_jax_statistics_agree():
    jnp = pytest.importorskip("jax.numpy")
    from fmp._autocast._explain import _stats as js
    from fmp.torch._fx._explain import _compare as ts

    rng = np.random.default_rng(0)
    for n in (100, 1 << 17):  # NumPy and compiled paths on the JAX side
        r = rng.standard_normal(n).astype(np.float32) * 1e20  # squares beyond float32: the sums are scaled
        p = (r * (1 + 1e-3 * rng.standard_normal(n))).astype(np.float32)
        p[5], p[6], r[6] = np.inf, np.nan, np.nan
        for a in (p, np.where(np.isinf(p), r, p)):
            want = js.output_stats([jnp.asarray(a), jnp.asarray([1, 2])], [jnp.asarray(r), jnp.asarray([1, 3])])
            got = ts.output_stats(
                [torch.from_numpy(a), torch.tensor([1, 2])], [torch.from_numpy(r), torch.tensor([1, 3])]
            )
            assert got[3:] == want[3:] and got[4] == 1
            assert np.allclose(got[:3], want[:3], rtol=1e-5, equal_nan=True)


def test_autocast_fx_float32_override_runs_the_module_as_written():
    model, x = _mlp()
    gm = fmp.torch.autocast_fx(model, (x,), CPU, overrides={"2": "float32"})
    hidden = fmp.torch.autocast_fx(model[:2], (x,), CPU)(x)
    assert torch.equal(gm(x), model[2](hidden.float()))  # the last layer as written, on its float32 input
    with pytest.raises(NotImplementedError, match="other than float32"):
        fmp.torch.autocast_fx(model, (x,), "mixed_float8", overrides={"2": "mixed_float16"})


def test_the_runs_stream_values_not_every_intermediate(monkeypatch):
    from fmp.torch._fx._explain._runner import Runner

    peak = []
    until = Runner.until

    def counted(self, target):
        out = until(self, target)
        peak.append(sum(1 for n in self.env if n.op == "call_function"))  # parameters cost nothing
        return out

    monkeypatch.setattr(Runner, "until", counted)
    lin = nn.Linear(16, 16)

    def deep(x):
        for _ in range(40):
            x = torch.tanh(lin(x))
        return x

    rep = fmp.torch.explain_fx(deep, (torch.randn(4, 16),), CPU, compare=True)
    assert len([r for r in rep.records if r.op == "aten::tanh"]) == 40
    assert max(peak) <= 8  # a few live values per run, not the 80+ intermediates


def test_a_model_run_as_written_reports_zero_everywhere():
    torch.manual_seed(0)
    model, x = nn.Sequential(_Block()), torch.randn(32, 16)  # every op inside submodule "0"
    rep = fmp.torch.explain_fx(
        model, (x,), CPU, rules=SOFTMAX_BF16, compare=True, grads=False, overrides={"0": "float32"}
    )
    compared = [r for r in rep.records if r.error is not None]
    assert len(compared) > 10 and all(r.category in ("override", "cast", "user_cast") for r in rep.records)
    assert all(r.error == 0.0 and r.added_error == 0.0 and r.suggestion is None for r in compared)


class _Rotary(nn.Module):
    """Rotary angles from a matmul with one contracted element: bfloat16 under torch's autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000.0 ** (torch.arange(16).float() / 16)))

    def forward(self, x):
        pos = torch.arange(x.shape[0], dtype=torch.float32)
        angles = pos[:, None] @ self.inv_freq[None, :]
        x1, x2 = x.chunk(2, -1)
        return torch.cat([x1 * angles.cos() - x2 * angles.sin(), x1 * angles.sin() + x2 * angles.cos()], -1).sum(0)


def test_rotary_angles_rounded_to_bfloat16_are_found_at_cos_and_sin_and_fixed_at_the_matmul():
    # the matmul's own error is one bfloat16 rounding, far below a suggestion; cos and sin of angles up to
    # 2047 rad magnify it to ~0.5 and name the scope of the op that rounded them
    model, x = nn.Sequential(nn.Identity(), _Rotary()), torch.randn(2048, 32)
    rep = fmp.torch.explain_fx(model, (x,), CPU, compare=True)
    top = rep.worst(1)[0]
    mm = [r for r in rep.records if r.op == "aten::matmul"][0]
    assert top.op in ("aten::cos", "aten::sin") and top.error > 0.1 > top.added_error
    assert mm.suggestion is None and mm.added_error < 2**-8 and top.suggestion == 'overrides={"1": "float32"}'
    fixed = fmp.torch.explain_fx(model, (x,), CPU, compare=True, **_apply(top.suggestion))
    assert max(r.error for r in fixed.records if r.op in ("aten::cos", "aten::sin")) < 1e-6
    assert not any(r.suggestion for r in fixed.records)
