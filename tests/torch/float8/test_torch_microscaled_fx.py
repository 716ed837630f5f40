"""Block-scaled policies over FX (``fmp.torch.autocast_fx(module, x, "mixed_mxfp8")``): the same arithmetic as
the JAX side, bit for bit (outputs and gradients), and torchao's ``to_mx`` for the operands."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fmp  # noqa: E402
import fmp.torch  # noqa: E402


def _np(t):
    return t.detach().float().numpy()


@pytest.mark.parametrize("policy", ["mixed_mxfp8", "mixed_mxfp4", "mixed_nvfp4"])
def test_a_linear_layer_equals_the_jax_side_bit_for_bit(policy):
    torch.manual_seed(0)
    lin = torch.nn.Linear(80, 48)
    x = torch.randn(24, 80) * torch.exp2(torch.randint(-4, 4, (24, 1)).float())
    gm = fmp.torch.autocast_fx(lin, (x,), policy)
    y = gm(x)
    y.float().square().sum().backward()

    def f(x, w, b):
        return x @ w.T + b

    args = [jnp.asarray(_np(v)) for v in (x, lin.weight, lin.bias)]
    yj, vjp = jax.vjp(fmp.autocast(f, policy), *args)
    _, dw, db = vjp((2 * yj).astype(yj.dtype))
    np.testing.assert_array_equal(_np(y), np.asarray(yj, np.float32))
    np.testing.assert_array_equal(_np(lin.weight.grad), np.asarray(dw))
    # the bias gradient is a bfloat16 sum over the rows, which torch and XLA add in their own orders
    np.testing.assert_allclose(_np(lin.bias.grad), np.asarray(db, np.float32), rtol=2**-5, atol=0.2)
    rows = [r for r in fmp.torch.explain_fx(lin, (x,), policy).records if r.category == "float8"]
    elem = "float8_e4m3fn" if policy == "mixed_mxfp8" else "float4_e2m1fn"
    assert len(rows) == 1 and rows[0].in_after == (elem, elem)


def test_the_operands_are_torchaos_to_mx():
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    config = pytest.importorskip("torchao.prototype.mx_formats.config")
    torch.manual_seed(1)
    x = torch.randn(16, 64) * torch.exp2(torch.randint(-6, 6, (16, 64)).float())
    lin = torch.nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(64))  # every output is one input: y is the dequantised x itself
    policy = fmp.Policy("f32", "bf16", "f32", float8=fmp.Float8Recipe("mxfp8", output="float32"))
    y = fmp.torch.autocast_fx(lin, (x,), policy)(x)
    scale, data = mx.to_mx(x, torch.float8_e4m3fn, 32, config.ScaleCalculationMode.RCEIL)
    deq = data.float().reshape(16, 2, 32) * scale.float().reshape(16, 2, 1)
    np.testing.assert_array_equal(_np(y), _np(deq.reshape(16, 64)))
