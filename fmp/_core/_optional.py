"""Optional dependencies: a clear ImportError that says how to install the missing one."""

from __future__ import annotations

import importlib
from types import ModuleType

# name -> how to get it. torch is installed on its own first: an unpinned torch requirement resolved by
# pip on Linux downloads the CUDA wheels, which most users of the CPU facade do not want.
_HOW = {
    "torch": (
        "install torch first with its own command (CPU build: "
        "pip install torch --index-url https://download.pytorch.org/whl/cpu ; for a CUDA build see "
        "https://pytorch.org/get-started/locally/), then pip install 'jax-fmp[torch]'"
    ),
    "optax": "pip install 'jax-fmp[optax]' (or pip install optax)",
    "matplotlib": "pip install 'jax-fmp[plot]' (or pip install matplotlib)",
}

_MSG_MISSING = "{module} needs {dep}, which is not installed: {how}."


def require(dep: str, module: str) -> ModuleType:
    """Imports ``dep``; if it is missing, raises ModuleNotFoundError saying that ``module`` needs it and how
    to install it (the original error is chained)."""
    try:
        return importlib.import_module(dep)
    except ModuleNotFoundError as e:
        if e.name != dep:  # dep is there but one of its own imports failed: that error is the useful one
            raise
        raise ModuleNotFoundError(_MSG_MISSING.format(module=module, dep=dep, how=_HOW[dep]), name=dep) from e
