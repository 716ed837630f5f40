"""Which uses share a cast in the rewritten graph: torch's autocast cast cache, and its gradients.

Eager autocast casts an activation once per use and a float32 leaf that requires grad once per
autocast region. The difference shows only in the backward pass (a shared cast sums its uses'
gradients in the low dtype), so every case compares all gradients bitwise with eager autocast.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import fmp.torch  # noqa: E402

LOW = [torch.bfloat16, torch.float16]
LOW_IDS = ["bf16", "f16"]
TO_COPY = torch.ops.aten._to_copy.default


def _casts_of(gm, name):
    return [n for n in gm.graph.nodes if n.target is TO_COPY and n.args[0].name == name]


def _grads_eager_and_fx(model, inputs, dtype):
    """Loss and the gradients of every parameter and of the inputs that require grad, both ways."""
    wrt = [*model.parameters(), *[x for x in inputs if x.requires_grad]]
    with torch.autocast("cpu", dtype=dtype):
        expected = model(*inputs)
    expected_grads = torch.autograd.grad(expected.float().sum(), wrt)
    gm = fmp.torch.autocast_fx(model, inputs, ("cpu", dtype))
    got = gm(*inputs)
    got_grads = torch.autograd.grad(got.float().sum(), wrt)
    assert got.dtype == expected.dtype
    assert torch.equal(got, expected)
    for g, e in zip(got_grads, expected_grads, strict=True):
        assert g.dtype == e.dtype
        assert torch.equal(g, e), "gradients differ"
    return gm


class _FanOut(nn.Module):
    """A float32 activation feeding three Linears (attention's Q, K, V) and a matrix product."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.norm(x)  # float32 under autocast: a float32 activation
        square = torch.mm(h, h.t())  # h and a view of it, each cast on its own
        return (self.q(h) * self.k(h)).softmax(-1) @ self.v(h).t() + square


@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
def test_fan_out_activation_cast_per_use(dtype):
    torch.manual_seed(0)
    gm = _grads_eager_and_fx(_FanOut(), (torch.randn(16, 16),), dtype)
    assert len(_casts_of(gm, "layer_norm")) == 4  # q, k, v and mm's first argument (its second is h.t())


@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
def test_fan_out_gradients_differ_when_the_cast_is_shared(dtype):
    # The teeth of the test above: one shared cast (the rule before) sums the three gradients in
    # the low dtype, and the input gradient of the LayerNorm no longer matches eager autocast.
    torch.manual_seed(0)
    model, x = _FanOut(), torch.randn(16, 16)
    with torch.autocast("cpu", dtype=dtype):
        eager = torch.autograd.grad(model(x).float().sum(), model.norm.weight)[0]
    h = model.norm(x)
    hc = h.to(dtype)  # one cast for every use
    out = (model.q.weight.to(dtype) @ hc.t()).t() + model.q.bias.to(dtype)
    out = out * ((model.k.weight.to(dtype) @ hc.t()).t() + model.k.bias.to(dtype))
    v = (model.v.weight.to(dtype) @ hc.t()).t() + model.v.bias.to(dtype)
    shared = out.softmax(-1) @ v.t() + torch.mm(hc, hc.t())
    assert not torch.equal(torch.autograd.grad(shared.float().sum(), model.norm.weight)[0], eager)


class _Tied(nn.Module):
    """One Parameter used by three ops (and tied into a second module): one cast, as torch caches it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x)) @ self.a.weight


@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
def test_parameter_cast_once_per_forward(dtype):
    torch.manual_seed(0)
    gm = _grads_eager_and_fx(_Tied(), (torch.randn(4, 8),), dtype)
    weight_casts = [n for n in gm.graph.nodes if n.target is TO_COPY and n.args[0].op == "get_attr"]
    assert len([n for n in weight_casts if "weight" in n.args[0].name]) == 1


class _TwoUses(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x) + self.b(x)


@pytest.mark.parametrize("requires_grad", [False, True], ids=["plain_input", "grad_leaf_input"])
@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
def test_input_cast_follows_the_example_input(dtype, requires_grad):
    # torch caches the cast of an input that is a leaf requiring grad, like a weight's
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=requires_grad)
    gm = _grads_eager_and_fx(_TwoUses(), (x,), dtype)
    input_casts = [n for n in gm.graph.nodes if n.target is TO_COPY and n.args[0].op == "placeholder"]
    assert len(input_casts) == (1 if requires_grad else 2)


class _Bilinear(nn.Module):
    """nn.Bilinear after a Linear: CPU autocast reaches inside the unlisted _trilinear kernel."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.bilinear = nn.Bilinear(6, 6, 4)

    def forward(self, x):
        h = self.proj(x).float()
        return self.bilinear(h, x)


@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
def test_bilinear_runs_with_autocast_inside_its_kernel(dtype):
    torch.manual_seed(0)
    gm = _grads_eager_and_fx(_Bilinear(), (torch.randn(5, 6, requires_grad=True),), dtype)
    trilinear = [n for n in gm.graph.nodes if n.target is torch.ops.aten._trilinear.default]
    assert len(trilinear) == 1
    assert trilinear[0].prev.target is torch.amp.autocast_mode._enter_autocast
    assert trilinear[0].prev.args[:3] == ("cpu", dtype, True)


@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
def test_bilinear_differs_without_the_region(dtype):
    # the teeth of the test above: run plainly, _trilinear gives other float32 values than eager autocast
    torch.manual_seed(0)
    a, b, w, bias = torch.randn(5, 6), torch.randn(5, 6), torch.randn(4, 6, 6), torch.randn(4)
    with torch.autocast("cpu", dtype=dtype):
        eager = nn.functional.bilinear(a, b, w, bias)
    plain = nn.functional.bilinear(a, b, w, bias)
    assert eager.dtype == plain.dtype == torch.float32
    assert not torch.equal(eager, plain)
