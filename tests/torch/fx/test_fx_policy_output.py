"""An fmp policy on the torch FX side: its output dtype applies, as on the JAX side and in the eager facade."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

import fmp  # noqa: E402
import fmp.torch  # noqa: E402


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)), torch.randn(5, 8)


@pytest.mark.parametrize(
    ("policy", "dtype"),
    [
        ("mixed_bfloat16", torch.float32),
        ("params=float32,compute=bfloat16,output=bfloat16", torch.bfloat16),
        ("params=float32,compute=bfloat16,output=float16", torch.float16),
        (("cpu", torch.bfloat16), torch.bfloat16),  # torch's spelling: outputs as torch's autocast leaves them
        ("cpu", torch.bfloat16),
    ],
)
def test_outputs_take_the_policys_output_dtype_with_eager_autocasts_values(policy, dtype):
    model, x = _model()
    with torch.autocast("cpu", torch.bfloat16):
        want = model(x)
    want.float().sum().backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    gm = fmp.torch.autocast_fx(model, (x,), policy)
    got = gm(x)
    assert got.dtype == dtype and torch.equal(got.float(), want.float().to(dtype).float())
    got.float().sum().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), want_grads, strict=True))


def test_only_floating_outputs_but_float64_are_cast():
    f = lambda a: (a @ a.T, a.sum(), a.int(), a.double(), a > 0)  # noqa: E731
    got = fmp.torch.autocast_fx(f, (torch.ones(3, 4),), "mixed_bfloat16")(torch.ones(3, 4))
    assert [t.dtype for t in got] == [torch.float32, torch.float32, torch.int32, torch.float64, torch.bool]
    eager = fmp.torch.autocast("cpu", policy="mixed_bfloat16")(f)(torch.ones(3, 4))
    assert [t.dtype for t in got] == [t.dtype for t in eager]  # the eager facade's decorator, the same rule


def test_autocast_graph_applies_the_output_dtype_too():
    gm = make_fx(lambda a, b: torch.mm(a, b), pre_dispatch=True)(torch.ones(2, 2), torch.ones(2, 2))
    assert fmp.torch.autocast_graph(gm, "mixed_bfloat16")(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.float32
    assert fmp.torch.autocast_graph(gm, ("cpu", torch.bfloat16))(torch.ones(2, 2), torch.ones(2, 2)).dtype == (
        torch.bfloat16
    )
