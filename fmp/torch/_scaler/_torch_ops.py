"""The array adapter that runs fmp's shared loss-scale rule on torch tensors."""

from __future__ import annotations

import math
from typing import Any

import torch


class TorchOps:
    """The array adapter ``update_scale`` needs, for torch tensors."""

    @staticmethod
    def where(cond: Any, a: Any, b: Any) -> torch.Tensor:
        return torch.where(cond, a, b)

    @staticmethod
    def isfinite(x: torch.Tensor) -> torch.Tensor:
        # |x| < inf is False for inf and NaN: torch.isfinite's answer in two ops instead of four
        return torch.abs(x) < math.inf

    @staticmethod
    def minimum(x: torch.Tensor, y: Any) -> torch.Tensor:
        return torch.clamp(x, max=y) if not isinstance(y, torch.Tensor) else torch.minimum(x, y)

    @staticmethod
    def maximum(x: torch.Tensor, y: Any) -> torch.Tensor:
        return torch.clamp(x, min=y) if not isinstance(y, torch.Tensor) else torch.maximum(x, y)

    @staticmethod
    def mul_f64(scale: torch.Tensor, factor: float) -> torch.Tensor:
        return (scale.double() * factor).float()


TORCH_OPS = TorchOps()
