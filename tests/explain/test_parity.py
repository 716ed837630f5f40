"""fmp.explain(compare=True) and fmp.torch.explain_fx(compare=True) answer alike: the same small models written
in JAX and in torch, under the same policy, flag the same rows, rank them alike and suggest the same fixes
(up to the op names: ``dot_general`` is ``aten::linear``), forward and in the gradients."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fmp

torch = pytest.importorskip("torch")
import fmp.torch  # noqa: E402

nn = torch.nn
BF16 = ("mixed_bfloat16", ("cpu", torch.bfloat16))
F16 = ("mixed_float16", ("cpu", torch.float16))
OP = {  # the JAX primitive of each torch op these models use
    "aten::linear": "dot_general",
    "aten::matmul": "dot_general",
    "aten::mul.Tensor": "mul",
    "aten::cos": "cos",
    "aten::sin": "sin",
    "aten::topk": "top_k",
    "aten::exp": "exp",
}
RNG = np.random.default_rng(0)


def _op(name: str) -> str:
    return OP.get(name, name)


def _fix(code: str | None) -> str | None:
    """A suggestion up to the op names, the rule table's ``framework=`` argument and a source location's
    line (each program writes the op on its own line; torch's stack traces give no column)."""
    if code is None:
        return None
    code = code.replace('framework="torch", ', "")
    code = re.sub(r'"([^"]+\.py):\d+(?::\d+)?"', r'"\1:LINE"', code)
    return re.sub(r'"(aten::[^"]+)"', lambda m: f'"{_op(m.group(1))}"', code)


def _flagged(rep) -> list[tuple]:
    """The rows that need attention, in rank order: scope, category, non-finite, flips, the fix."""
    ranked = rep.worst(len(rep.records))
    return [(r.scope, r.category, r.nonfinite, r.flips > 0, _fix(r.suggestion)) for r in ranked if r.suggestion]


def _matmuls(rep) -> list[tuple]:
    return [(r.scope, r.category, r.out_after) for r in rep.records if _op(r.op) == "dot_general"]


def _both(jax_fn, jax_args, module, torch_args, policy, jax_rules=None, torch_rules=None, **kw):
    j = fmp.explain(jax_fn, policy[0], rules=jax_rules, compare=True, **kw)(*jax_args)
    t = fmp.torch.explain_fx(module, torch_args, policy[1], rules=torch_rules, compare=True, **kw)
    return j, t


def _linear(w: np.ndarray) -> nn.Linear:
    lin = nn.Linear(*w.shape, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w.T))
    return lin


# a 2-layer MLP with a layer norm and a softmax; with ``offset`` its softmax input is large, so bfloat16
# rounds it (a planted defect: the softmax magnifies that rounding)
D, H, OUT = 16, 32, 8
W1 = RNG.standard_normal((D, H)).astype(np.float32) / 4
W2 = RNG.standard_normal((H, OUT)).astype(np.float32) / 4
X = RNG.standard_normal((64, D)).astype(np.float32)


def _jax_mlp(offset):
    def mlp(params, x):
        with jax.named_scope("fc1"):
            h = x @ params["fc1"]
        with jax.named_scope("norm"):
            mu = h.mean(-1, keepdims=True)
            h = (h - mu) / jnp.sqrt(((h - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
        with jax.named_scope("fc2"):
            logits = jnp.tanh(h) @ params["fc2"]
        with jax.named_scope("attn"):
            return jax.nn.softmax(logits + offset, -1)

    return mlp


class _Softmax(nn.Module):
    def __init__(self, offset: float) -> None:
        super().__init__()
        self.offset = offset

    def forward(self, x):
        return (x + self.offset).softmax(-1)


class _MLP(nn.Module):
    def __init__(self, offset: float, loss: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2 = _linear(W1), _linear(W2)
        self.norm, self.attn = nn.LayerNorm(H, elementwise_affine=False), _Softmax(offset)
        self.loss = loss  # return the sum of squares (a scalar loss, for the gradients)

    def forward(self, x):
        y = self.attn(self.fc2(torch.tanh(self.norm(self.fc1(x)))))
        return y.square().sum() if self.loss else y


@pytest.mark.parametrize("offset", [0.0, 100.0])
def test_mlp_with_layer_norm_and_softmax(offset):
    params = {"fc1": jnp.asarray(W1), "fc2": jnp.asarray(W2)}
    j, t = _both(_jax_mlp(offset), (params, X), _MLP(offset), (torch.from_numpy(X),), BF16)
    assert (
        _matmuls(j)
        == _matmuls(t)
        == [
            ("fc1", "lower_precision", ("bfloat16",)),
            ("fc2", "lower_precision", ("bfloat16",)),
        ]
    )
    if not offset:  # healthy: nothing to fix, and the two matmuls rank first in both
        assert _flagged(j) == _flagged(t) == []
        assert {_op(r.op) for r in j.worst(2)} == {_op(r.op) for r in t.worst(2)} == {"dot_general"}
        return
    # the softmax magnifies the rounding of its large inputs, made in its own module: fixed there
    assert _flagged(t) == [("attn", "unlisted", False, False, 'overrides={"attn": "float32"}')]
    assert {f[-1] for f in _flagged(j)} == {'overrides={"attn": "float32"}'}
    assert j.worst(1)[0].scope == t.worst(1)[0].scope == "attn"


# float16 overflow: h*h of values near 500 is inf in float16
XO = RNG.uniform(1.0, 2.0, (8, 16)).astype(np.float32)
WO = np.full((16, 16), 20.0, np.float32)


def _jax_overflow(w, x):
    with jax.named_scope("lin"):
        h = x @ w
    return jnp.sqrt(h * h + 1.0).mean()


class _Overflow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = _linear(WO)

    def forward(self, x):
        h = self.lin(x)
        return torch.sqrt(h * h + 1.0).mean()


def test_float16_overflow():
    j, t = _both(_jax_overflow, (WO, XO), _Overflow(), (torch.from_numpy(XO),), F16)
    fix = 'overrides={"tests/explain/test_parity.py:LINE": "float32"}'  # the line of h * h, not every mul
    assert _flagged(j) == [("", "promote", True, False, fix)] and _flagged(t) == [("", "unlisted", True, False, fix)]
    for rep in (j, t):
        top = rep.worst(1)[0]
        assert _op(top.op) == "mul" and top.nonfinite and top.added_error == float("inf")
        downstream = [r for r in rep.records if r.nonfinite and r is not top]
        assert downstream and not any(r.suggestion for r in downstream)  # they inherit the inf
    assert _matmuls(j) == _matmuls(t) == [("lin", "lower_precision", ("float16",))]


# rotary angles t * f for positions up to 2047, made by a matmul (rounded to bfloat16 there), then cos and sin
T, F = 2048, 16
POS = np.stack([np.arange(T, dtype=np.float32), np.zeros(T, np.float32)], 1)
FREQ = np.stack([1.0 / 10000.0 ** (np.arange(F, dtype=np.float32) / F), np.ones(F, np.float32)], 0)
XR = RNG.standard_normal((T, 2 * F)).astype(np.float32)


def _jax_rotary(x, pos, freq):
    with jax.named_scope("angles"):
        a = pos @ freq
    with jax.named_scope("use"):
        x1, x2 = jnp.split(x, 2, -1)
        return jnp.concatenate([x1 * jnp.cos(a) - x2 * jnp.sin(a), x1 * jnp.sin(a) + x2 * jnp.cos(a)], -1).sum(0)


class _Angles(nn.Module):
    def forward(self, pos):
        return pos @ torch.from_numpy(FREQ)


class _Use(nn.Module):
    def forward(self, x, a):
        x1, x2 = x.chunk(2, -1)
        return torch.cat([x1 * a.cos() - x2 * a.sin(), x1 * a.sin() + x2 * a.cos()], -1).sum(0)


class _Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.angles, self.use = _Angles(), _Use()

    def forward(self, x, pos):
        return self.use(x, self.angles(pos))


def test_rotary_cos_of_rounded_angles():
    j, t = _both(_jax_rotary, (XR, POS, FREQ), _Rotary(), (torch.from_numpy(XR), torch.from_numpy(POS)), BF16)
    # cos and sin magnify the angles' rounding (one bfloat16 rounding, far below a fix of its own): the fix
    # is the matmul that rounded them
    assert _flagged(j) == _flagged(t) == [("use", "unlisted", False, False, 'overrides={"angles": "float32"}')] * 4
    assert [_op(r.op) for r in j.worst(4)] == [_op(r.op) for r in t.worst(4)] == ["sin", "sin", "cos", "cos"]
    assert _matmuls(j) == _matmuls(t) == [("angles", "lower_precision", ("bfloat16",))]
    (mm,) = [r for r in t.records if _op(r.op) == "dot_general"]
    assert mm.suggestion is None and mm.added_error < 2**-8


# a router's near-tied bfloat16 logits, through a float32 op, then top_k: the flips are fixed at the router
XT = RNG.standard_normal((256, 32)).astype(np.float32)
WT = (RNG.standard_normal((32, 1)) + 1e-3 * RNG.standard_normal((32, 8))).astype(np.float32)


def _jax_router(w, x):
    with jax.named_scope("router"):
        logits = x @ w
    return jax.lax.top_k(jnp.exp(logits), 2)[1]


class _Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = _linear(WT)

    def forward(self, x):
        return torch.topk(self.router(x).exp(), 2).indices


def test_router_flips_through_a_float32_op():
    # exp runs in float32 in both (JAX's rule table has it there; torch's CPU table is told so)
    torch_rules = fmp.DEFAULT_RULES.derive(framework="torch", float32=["aten::exp"])
    j, t = _both(_jax_router, (WT, XT), _Router(), (torch.from_numpy(XT),), BF16, torch_rules=torch_rules)
    assert [(_op(r.op), r.category) for r in j.records if _op(r.op) == "exp"] == [("exp", "float32")]
    assert [(_op(r.op), r.category) for r in t.records if _op(r.op) == "exp"] == [("exp", "override")]  # moved
    fix = 'overrides={"router": "float32"}'
    assert _flagged(j) == _flagged(t) == [("", "unlisted", False, True, fix)]
    assert _op(j.worst(1)[0].op) == _op(t.worst(1)[0].op) == "top_k"
    fixed_j = fmp.explain(_jax_router, "mixed_bfloat16", compare=True, overrides={"router": "float32"})(WT, XT)
    fixed_t = fmp.torch.explain_fx(
        _Router(), (torch.from_numpy(XT),), BF16[1], rules=torch_rules, compare=True, overrides={"router": "float32"}
    )
    assert not any(r.flips for r in (*fixed_j.records, *fixed_t.records))


# gradients: each parameter's gradient error against the program as written, alike in both
def test_gradients_of_the_mlp_agree():
    mlp = _jax_mlp(0.0)
    params = {"fc1": jnp.asarray(W1), "fc2": jnp.asarray(W2)}
    j = fmp.explain(lambda p, x: jnp.square(mlp(p, x)).sum(), BF16[0], compare=True, grads=True)(params, X)
    t = fmp.torch.explain_fx(_MLP(0.0, loss=True), (torch.from_numpy(X),), BF16[1], compare=True, grads=True)
    for name in ("fc1", "fc2"):
        a, b = j.grad_errors[f"['{name}']"], t.grad_errors[f"{name}.weight"]
        assert not a.nonfinite and not b.nonfinite and a.cosine > 0.999 and b.cosine > 0.999
        assert 0 < a.error < 0.05 and 0 < b.error < 0.05 and 0.25 < a.error / b.error < 4, (name, a, b)


def test_gradients_of_the_float16_overflow_agree():
    # sqrt(inf) has a zero derivative: the policy's gradient is 0 in both, all of the reference's is lost
    j = fmp.explain(_jax_overflow, F16[0], compare=True, grads=True, loss_scale=1.0)(WO, XO)
    t = fmp.torch.explain_fx(_Overflow(), (torch.from_numpy(XO),), F16[1], compare=True, grads=True)
    (a,), (b,) = j.grad_errors.values(), t.grad_errors.values()
    assert (a.error, a.cosine, a.nonfinite) == (b.error, b.cosine, b.nonfinite) == (1.0, 0.0, False)
    assert a.max_abs_error == pytest.approx(b.max_abs_error, rel=1e-6)
