"""Every op of torch 2.13's CPU autocast registry: ``autocast_fx`` vs eager ``torch.autocast``, bitwise."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import fmp  # noqa: E402
import fmp.torch  # noqa: E402
from fmp.torch._fx_rewrite import op_key  # noqa: E402
from tests.torch.fx_op_samples import SAMPLES  # noqa: E402

CPU_OPS = sorted(fmp.DEFAULT_RULES.table("torch", "cpu"))
LOW = [torch.bfloat16, torch.float16]

# Every registry op has a sample in fx_op_samples.py. When eager autocast raises for
# an input, the transformed module must raise the same exception type (checked in
# _run); at least one input variant must run, except for these ops, where eager
# torch.autocast raises for every input on this machine:
EAGER_FAILS = {
    "aten::mkldnn_rnn_layer": "oneDNN builds no bf16/f16 LSTM primitive on CPUs without native bf16/f16 "
    "support ('could not create a primitive descriptor'); the transform raises the same RuntimeError",
}

# Ops eager torch.autocast itself does not reproduce bit for bit: compared to 1e-5.
NOT_REPRODUCIBLE = {
    "aten::linalg_lstsq": "MKL's gelsy result depends on buffer alignment: two eager calls on copies of the same "
    "inputs differ in the last bits about half the time",
}


def _resolve(key: str):
    base, _, overload = key.removeprefix("aten::").partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _convert(tree, dtype):
    def leaf(x):
        if isinstance(x, torch.Tensor) and x.dtype.is_floating_point:
            return x.to(dtype)
        return x

    return torch.utils._pytree.tree_map(leaf, tree)


def _assert_bitwise(got, expected, exact=True):
    got_leaves = torch.utils._pytree.tree_leaves(got)
    exp_leaves = torch.utils._pytree.tree_leaves(expected)
    assert len(got_leaves) == len(exp_leaves)
    for g, e in zip(got_leaves, exp_leaves, strict=True):
        if not isinstance(e, torch.Tensor):
            assert g == e
            continue
        assert g.dtype == e.dtype
        assert g.shape == e.shape
        if e.is_complex():
            g, e = torch.view_as_real(g.resolve_conj()), torch.view_as_real(e.resolve_conj())
        assert torch.equal(g.isnan(), e.isnan())
        if exact:
            assert torch.equal(g.nan_to_num(), e.nan_to_num()), "values differ"
        else:
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def _run(op, key, args, kwargs, dtype):
    def one_op(a, k):
        return op(*a, **k)

    try:
        with torch.autocast("cpu", dtype=dtype):
            expected = one_op(args, kwargs)
    except (RuntimeError, NotImplementedError) as err:
        expected = err
    gm = fmp.torch.autocast_fx(one_op, (args, kwargs), ("cpu", dtype))
    keys = [op_key(n.target) for n in gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload)]
    assert key in keys, f"the traced graph does not contain {key}: {keys}"
    if isinstance(expected, Exception):
        with pytest.raises(type(expected)):
            gm(args, kwargs)
        return False
    _assert_bitwise(gm(args, kwargs), expected, exact=key not in NOT_REPRODUCIBLE)
    return True


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "f16"])
@pytest.mark.parametrize("key", CPU_OPS)
def test_registry_op_matches_eager_autocast(key, dtype):
    op = _resolve(key)
    torch.manual_seed(0)
    args, kwargs = SAMPLES[key]()
    ran = [_run(op, key, args, kwargs, dtype)]
    ran.append(_run(op, key, *_convert((args, kwargs), dtype), dtype))
    if key not in EAGER_FAILS:
        assert any(ran), f"{key}: eager autocast raised for float32 and for {dtype} inputs"
