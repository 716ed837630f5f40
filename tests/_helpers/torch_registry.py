"""torch's autocast registries: the installed torch's (live) and those recorded from each tested release.

The registry is what the dispatcher holds: every op with a kernel for the ``AutocastCPU`` or
``AutocastCUDA`` dispatch key. Those kernels are registered when torch's library loads, with or
without a GPU, so a CUDA build yields its CUDA registry on a CPU-only machine. A CPU build lacks
the ops whose autocast kernels only CUDA builds compile (``aten::_cudnn_rnn``), so the files in
tests/core/autocast_registry are recorded from CUDA builds (the package index's default wheels).

Record the installed torch's registry (``torch-<major>.<minor>.json``), from the repository root:
``python tests/_helpers/torch_registry.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}
RECORDED = Path(__file__).resolve().parents[1] / "core" / "autocast_registry"


def live_registry(device: str) -> list[str]:
    """The sorted op names (``"aten::mm"``, ``"aten::pow.Scalar"``) the installed torch autocasts on ``device``."""
    import torch

    key = KEYS[device]
    return sorted(
        name
        for name in torch._C._dispatch_get_all_op_names()
        if torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
    )


def recorded_releases() -> list[tuple[int, int]]:
    """``(major, minor)`` of every recorded registry, oldest first."""
    names = (p.stem.removeprefix("torch-").split(".") for p in RECORDED.glob("torch-*.json"))
    return sorted((int(major), int(minor)) for major, minor in names)


def recorded_registry(release: tuple[int, int]) -> dict:
    """The registry recorded from ``release``: ``{"torch": version, "cuda": version, "AutocastCPU": [...], ...}``."""
    return json.loads((RECORDED / f"torch-{release[0]}.{release[1]}.json").read_text())


def main() -> None:
    import torch

    if torch.version.cuda is None:
        raise SystemExit(f"torch {torch.__version__} is a CPU build: record the registry from a CUDA build")
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    record = {"torch": torch.__version__, "cuda": torch.version.cuda}
    record.update({key: live_registry(device) for device, key in KEYS.items()})
    out = RECORDED / f"torch-{major}.{minor}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(out, {key: len(record[key]) for key in KEYS.values()})


if __name__ == "__main__":
    main()
