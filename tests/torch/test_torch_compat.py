"""``fmp.torch`` has every name of the installed torch's ``torch.amp``, its submodule aliases included."""

from __future__ import annotations

import importlib
import re

import pytest

torch = pytest.importorskip("torch")

import fmp.torch  # noqa: E402

# torch.amp.autocast_mode's helper of autocast.__call__; an fmp.torch.autocast instance decorates instead
NOT_MIRRORED = {"autocast_mode": {"autocast_decorator"}}


def test_every_torch_amp_name_is_in_fmp_torch():
    missing = sorted(set(torch.amp.__all__) - set(fmp.torch.__all__))
    assert missing == [], f"torch {torch.__version__}'s torch.amp names that fmp.torch lacks"


@pytest.mark.parametrize("submodule", ["autocast_mode", "grad_scaler"])
def test_submodule_aliases_mirror_torch_amp(submodule):
    theirs = importlib.import_module(f"torch.amp.{submodule}")
    ours = importlib.import_module(f"fmp.torch.{submodule}")
    assert getattr(fmp.torch, submodule) is ours
    missing = sorted(set(theirs.__all__) - set(ours.__all__) - NOT_MIRRORED.get(submodule, set()))
    assert missing == [], f"torch.amp.{submodule} names that fmp.torch.{submodule} lacks"
    for name in ours.__all__:  # the same objects as the top-level names (or torch's own, OptState)
        assert getattr(ours, name) is getattr(fmp.torch, name, getattr(theirs, name)), name


@pytest.mark.parametrize("device_type", ["cpu", "cuda", "meta", "mps", "xpu"])
def test_is_autocast_available_is_torchs(device_type):
    assert fmp.torch.is_autocast_available(device_type) is torch.amp.is_autocast_available(device_type)


@pytest.mark.parametrize("device_type", [3, "no_such_device"])
def test_is_autocast_available_errors_are_torchs(device_type):
    with pytest.raises((TypeError, RuntimeError)) as theirs:
        torch.amp.is_autocast_available(device_type)
    with pytest.raises(theirs.type, match=re.escape(str(theirs.value))):
        fmp.torch.is_autocast_available(device_type)


def test_autocast_mode_names_run_like_torch_amp():
    from fmp.torch.autocast_mode import autocast

    a = torch.ones(2, 2)
    with autocast("cpu"):
        ours = a @ a
    with torch.amp.autocast_mode.autocast("cpu"):
        theirs = a @ a
    assert ours.dtype == theirs.dtype == torch.bfloat16 and torch.equal(ours, theirs)
