"""A float8 policy on a torch entry without a float8 rewrite (everything but ``autocast_fx``) is refused with
a clear error, never quietly run in bfloat16."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

import fmp  # noqa: E402
import fmp.torch  # noqa: E402

FLOAT8 = ["mixed_float8", "p=f32,c=bf16,o=f32,float8=rowwise", fmp.get_policy("p=f32,c=f16,o=f32,float8=delayed")]


@pytest.mark.parametrize("policy", FLOAT8, ids=str)
def test_float8_policy_is_refused_by_every_torch_entry_but_the_fx_ones(policy):
    gm = make_fx(lambda a, b: torch.mm(a, b), pre_dispatch=True)(torch.ones(2, 2), torch.ones(2, 2))
    calls = {
        "autocast_graph": lambda: fmp.torch.autocast_graph(gm, policy),
        "explain_graph": lambda: fmp.torch.explain_graph(gm, policy),
        "autocast": lambda: fmp.torch.autocast("cpu", policy=policy),
    }
    for name, call in calls.items():
        with pytest.raises(NotImplementedError, match=r"float8.*mixed_bfloat16.*fmp\.autocast") as info:
            call()
        assert str(fmp.get_policy(policy).float8) in str(info.value), name
        assert "autocast_fx" in str(info.value), name


def test_the_same_policy_without_float8_still_runs():
    lin = torch.nn.Linear(4, 3)
    gm = fmp.torch.autocast_fx(lin, (torch.ones(2, 4),), "mixed_bfloat16")
    assert gm(torch.ones(2, 4)).dtype == torch.float32  # the policy's output dtype
    with fmp.torch.autocast("cpu", policy="mixed_bfloat16"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
