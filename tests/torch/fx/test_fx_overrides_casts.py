"""A float32 override in an FX autocast graph: the overridden layer runs as written in float32, and the layer after
it still gets its input cast to the compute dtype, as the dtype its producer yields after the rewrite asks."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import fmp  # noqa: E402
import fmp.torch  # noqa: E402

LOW = {"mixed_bfloat16": torch.bfloat16, "mixed_float16": torch.float16}
LINEAR = torch.ops.aten.linear.default


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 8))
    return model, torch.randn(4, 16)


class _Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
        self.head = nn.Linear(16, 8)

    def forward(self, x):
        return self.head(torch.relu(self.block(x)))


class _Capture(torch.fx.Interpreter):
    """Runs a graph module and keeps each aten.linear call's input and output."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.linears: list[tuple[torch.Tensor, torch.Tensor]] = []

    def call_function(self, target, args, kwargs):
        out = super().call_function(target, args, kwargs)
        if target is LINEAR:
            self.linears.append((args[0], out))
        return out


def _linears(gm, x):
    cap = _Capture(gm)
    out = cap.run(x)
    return out, cap.linears


def _hand(layers, x, overridden, low):
    """The program by hand: an overridden linear in float32 on a float32 input, any other in ``low``."""
    h = x
    for i, layer in layers:
        if isinstance(layer, nn.Linear):
            if i in overridden:
                h = F.linear(h.float(), layer.weight, layer.bias)
            else:
                h = F.linear(h.to(low), layer.weight.to(low), layer.bias.to(low))
        else:
            h = layer(h)
    return h.float()


@pytest.mark.parametrize("policy", sorted(LOW))
@pytest.mark.parametrize("key", ["0", "2", "3"])
def test_the_layer_after_a_float32_override_runs_in_the_compute_dtype(policy, key):
    model, x = _model()
    low = LOW[policy]
    gm = fmp.torch.autocast_fx(model, (x,), policy, overrides={key: "float32"})
    out, linears = _linears(gm, x)
    assert out.dtype == torch.float32
    assert torch.equal(out, _hand(enumerate(model), x, {int(key)}, low))
    layers = [i for i, m in enumerate(model) if isinstance(m, nn.Linear)]
    assert len(linears) == len(layers) == 3
    for pos, (i, (inp, got)) in enumerate(zip(layers, linears, strict=True)):
        if str(i) == key:
            assert inp.dtype == got.dtype == torch.float32
            with torch.no_grad():
                assert torch.equal(got, model[i](inp))  # eager float32 of that layer on the same input
        else:
            lin = model[i]
            assert inp.dtype == got.dtype == low
            assert torch.equal(got, F.linear(inp, lin.weight.to(low), lin.bias.to(low)))
        if pos > 0 and str(layers[pos - 1]) == key:  # the layer right after the override
            produced = linears[pos - 1][1] if i == layers[pos - 1] + 1 else torch.relu(linears[pos - 1][1])
            assert torch.equal(got, F.linear(produced.to(low), model[i].weight.to(low), model[i].bias.to(low)))


@pytest.mark.parametrize("policy", sorted(LOW))
@pytest.mark.parametrize("key", ["0", "2", "3"])
def test_explain_fx_rows_read_the_dtypes_that_ran(policy, key):
    model, x = _model()
    low = str(LOW[policy]).removeprefix("torch.")
    rep = fmp.torch.explain_fx(model, (x,), policy, overrides={key: "float32"}, compare=True)
    rows = [r for r in rep.records if r.op == "aten::linear"]
    assert [r.scope for r in rows] == ["0", "2", "3"]
    _, linears = _linears(fmp.torch.autocast_fx(model, (x,), policy, overrides={key: "float32"}), x)
    for row, (inp, got) in zip(rows, linears, strict=True):
        assert row.in_after[0] == str(inp.dtype).removeprefix("torch.")  # the rows read what the graph ran
        assert row.out_after == (str(got.dtype).removeprefix("torch."),)
        if row.scope == key:
            assert row.category == "override" and row.in_after == ("float32",) * 3 and row.out_after == ("float32",)
            assert row.added_error == 0.0
        else:
            assert row.category == "lower_precision" and row.in_after == (low,) * 3 and row.out_after == (low,)
            assert row.added_error > 0.0
    assert all(r.error is not None for r in rows)  # compare ran


@pytest.mark.parametrize("policy", sorted(LOW))
def test_a_nested_module_path_override(policy):
    torch.manual_seed(0)
    model, x = _Nested(), torch.randn(4, 16)
    low = LOW[policy]
    gm = fmp.torch.autocast_fx(model, (x,), policy, overrides={"block.0": "float32"})
    out, linears = _linears(gm, x)
    first, second, head = linears
    assert first[1].dtype == torch.float32 and second[1].dtype == head[1].dtype == low
    with torch.no_grad():
        assert torch.equal(first[1], model.block[0](x))
    b1 = model.block[1]
    assert torch.equal(second[1], F.linear(first[1].to(low), b1.weight.to(low), b1.bias.to(low)))
    layers = [(0, model.block[0]), (1, model.block[1]), (2, nn.ReLU()), (3, model.head)]
    assert torch.equal(out, _hand(layers, x, {0}, low))
    rep = fmp.torch.explain_fx(model, (x,), policy, overrides={"block.0": "float32"})
    rows = {r.scope: r for r in rep.records if r.op == "aten::linear"}
    assert rows["block.0"].category == "override" and rows["block.0"].out_after == ("float32",)
    assert rows["block.1"].in_after == (str(low).removeprefix("torch."),) * 3


@pytest.mark.parametrize("key", ["0", "2", "3"])
def test_a_float32_override_under_a_float8_policy_runs_next_to_float8_matmuls(key):
    model, x = _model()
    gm = fmp.torch.autocast_fx(model, (x,), "mixed_float8", overrides={key: "float32"})
    out, linears = _linears(gm, x)
    ((inp, got),) = linears  # the float32 layer is the one aten.linear left; the others are float8 matmuls
    assert inp.dtype == got.dtype == torch.float32 and out.dtype == torch.float32 and out.isfinite().all()
    with torch.no_grad():
        assert torch.equal(got, model[int(key)](inp))
    assert sum(getattr(n.target, "__name__", "") == "float8_linear" for n in gm.graph.nodes) == 2


def test_a_per_module_float8_recipe_is_refused():
    model, x = _model()
    with pytest.raises(NotImplementedError, match="different float8 recipe per module"):
        fmp.torch.autocast_fx(model, (x,), "mixed_float8", overrides={"2": "p=f32,c=bf16,o=f32,float8=rowwise"})
