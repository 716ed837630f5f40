"""GradScaler(process_group=...) on torch.distributed gloo, 2 processes on localhost.

The ranks run once per session (the ``dist_results`` fixture, tests/torch/dist_worker.py); these tests read
their results.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.xdist_group("processes")  # see tests/conftest.py


def test_found_inf_is_reduced_over_the_group(dist_results):
    r0, r1 = (r["group"] for r in dist_results)
    # a rank without gradients still takes part in the all-reduce (no deadlock) and backs off too
    assert r0["no_grads_on_rank1"] == r1["no_grads_on_rank1"] == 32.0
    # with the process group every rank skips step 1 and backs off together
    assert r0["synced"]["skipped"] == r1["synced"]["skipped"] == [False, True, False]
    assert r0["synced"]["scales"] == r1["synced"]["scales"] == [64.0, 32.0, 32.0]
    assert r0["synced"]["w"] == r1["synced"]["w"]
    # without it, the rank that saw the inf diverges (the check can fail)
    assert r0["unsynced"]["scales"] != r1["unsynced"]["scales"]
    assert r0["unsynced"]["w"] != r1["unsynced"]["w"]
    # a plain DDP loop works unchanged: the inf reaches every rank through DDP's gradient all-reduce
    assert r0["plain_ddp"]["skipped"] == r1["plain_ddp"]["skipped"] == [False, True, False]
    assert r0["plain_ddp"]["w"] == r1["plain_ddp"]["w"]
    # without DDP (independent params), the group still makes both ranks skip step 1
    assert r0["no_ddp_synced"]["skipped"] == r1["no_ddp_synced"]["skipped"] == [False, True, False]


def test_found_inf_is_a_flag_for_every_optimizer_path(dist_results):
    """found_inf stays 0/1 after the cross-rank reduction, wherever the inf came from.

    A SUM gave 2.0 when more than one rank saw the inf; torch's fused Adam/SGD skip only on 1.0 and subtract
    the flag from their step counts, so they stepped on inf gradients (NaN parameters, Adam's step 1 -> -1).
    """
    r0s, r1s = (r["found_inf"] for r in dist_results)
    assert r0s.keys() == r1s.keys()
    # (one rank, every rank, DDP, FSDP2) x 7 optimizer paths; torch has no fused SGD for FSDP2's DTensors
    assert len(r0s) == 4 * 7 - 1
    for name, r0 in r0s.items():
        r1 = r1s[name]
        for r in (r0, r1):
            assert r["skipped"] == [False, True, False], name
            assert r["scales"] == [64.0, 32.0, 32.0], name
            assert r["finite"], name
            # Adam and its fused kernel count only the steps they took
            assert r["steps"] in ([], [2.0] * len(r["steps"])), name
            if "equal_to_torch" in r:
                assert r["ref_scales"] == r["scales"], name
                assert r["equal_to_torch"], name
        # a reference exists for every case except the fused ones with the inf on one rank
        assert ("equal_to_torch" in r0) == (not (name.startswith("one/") and "fused" in name)), name
