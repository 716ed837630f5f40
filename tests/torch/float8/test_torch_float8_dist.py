"""Float8 under DDP and FSDP2 on 2 CPU ranks (gloo): the ``autocast_fx`` float8 model trains bit for bit like
torchao's ``Float8Linear`` model under the same wrapper, with per-rank scales (each rank scales its own
activations and output gradients; the weight scale comes from the full weight, the same on every rank)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchao")

pytestmark = [
    pytest.mark.gallery,  # CI runs the gallery as its second step
    pytest.mark.xdist_group("processes"),  # see tests/conftest.py
]

CASES = [f"{w}-{s}" for w in ("ddp", "fsdp2", "fsdp2_per_layer") for s in ("tensorwise", "rowwise")]


@pytest.fixture(scope="module")
def ranks():
    from tests.torch.dist_launch import launch

    return launch("tests.torch.dist_float8_worker", timeout=480)


@pytest.mark.parametrize("case", CASES)
def test_float8_model_trains_like_torchao_under_the_same_wrapper(ranks, case):
    for rank in ranks:
        got = rank[case]
        assert got["equal"], f"{case}: parameters differ from torchao's"
        assert got["fmp"] == got["torchao"]
    assert ranks[0][case]["digest"] == ranks[1][case]["digest"]  # the replicas agree
    assert ranks[0][case]["fmp"] != ranks[1][case]["fmp"]  # each rank trained on its own batches


def test_scales_are_per_rank():
    """Why the choice matters: a rank's activation scale comes from its own batch, so two ranks' rows are not
    computed as one global batch would compute them. Per-rank scales are torchao's default (it all-reduces
    amaxes only for FSDP's float8 all-gather of weights), which the runs above equal bit for bit."""
    import torch

    import fmp
    import fmp.torch

    lin = torch.nn.Linear(32, 16, bias=False)
    x = torch.randn(8, 32)
    recipe = fmp.Float8Recipe.from_peer("torchao_tensorwise", emulate=True)  # exact scales: the amax moves every value
    policy = fmp.Policy("float32", "bfloat16", "float32", float8=recipe)
    gm = fmp.torch.autocast_fx(lin, (x,), policy)
    halves = torch.cat([gm(x[:4]), gm(x[4:] * 3)])  # two "ranks", each scaling its own rows
    whole = gm(torch.cat([x[:4], x[4:] * 3]))  # one global amax
    assert not torch.equal(halves, whole)
