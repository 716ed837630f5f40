"""Which ops each tested torch release autocasts, by fmp's rule table (no torch import).

fmp's torch tables are the union of the autocast registries of the releases in
``_rules_data.TORCH_RELEASES``; this module narrows them to one release, the
registry that release's dispatcher holds.
"""

from __future__ import annotations

from fmp._core import _rules_data as data
from fmp._core._rules import DEFAULT_RULES, TORCH_DEVICES


def release_of(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string.

    Examples:
      >>> from fmp._core._torch_releases import release_of
      >>> release_of("2.15.0+cu132"), release_of("2.14.0a0+git1234")
      ((2, 15), (2, 14))
    """
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise ValueError(f"version must look like '2.15.0', got {version!r}") from None


def in_release(op: str, release: tuple[int, int]) -> bool:
    """Whether torch ``release`` registers ``op`` (ops of ``TORCH_OP_RELEASES`` only for their releases)."""
    first, last = data.TORCH_OP_RELEASES.get(op, (None, None))
    return (first is None or release >= first) and (last is None or release <= last)


def torch_registry(release: tuple[int, int], device: str, *, cuda_build: bool = True) -> frozenset[str]:
    """The ops torch ``release`` autocasts on ``device``, as fmp's default table has them.

    Args:
      release: ``(major, minor)``, e.g. ``(2, 15)``.
      device: ``"cpu"`` or ``"cuda"``.
      cuda_build: False for a CPU build of torch, whose ``AutocastCUDA`` registry lacks the kernels only
        CUDA builds compile (``TORCH_CUDA_BUILD_ONLY``).

    Examples:
      >>> from fmp._core._torch_releases import torch_registry
      >>> "aten::qr" in torch_registry((2, 13), "cpu"), "aten::qr" in torch_registry((2, 15), "cpu")
      (True, False)
    """
    if device not in TORCH_DEVICES:
        raise ValueError(f"device must be one of {TORCH_DEVICES}, got {device!r}")
    ops = {op for op in DEFAULT_RULES.table("torch", device) if in_release(op, release)}
    if device == "cuda" and not cuda_build:
        ops -= set(data.TORCH_CUDA_BUILD_ONLY)
    return frozenset(ops)
