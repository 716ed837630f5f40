"""``fmp.torch.cuda.amp``: the deprecated ``torch.cuda.amp`` names, with torch's FutureWarnings.

Each name warns exactly as ``torch.cuda.amp`` 2.13 does and then behaves like
its ``fmp.torch`` counterpart with ``device_type="cuda"`` (so, on a machine
without CUDA, it also warns and disables itself like torch's).

Examples:
  >>> import warnings, fmp.torch.cuda.amp
  >>> with warnings.catch_warnings(record=True) as w:
  ...     warnings.simplefilter("always")
  ...     scaler = fmp.torch.cuda.amp.GradScaler(enabled=False)
  >>> str(w[0].message).startswith("`torch.cuda.amp.GradScaler(args...)` is deprecated")
  True
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from fmp.torch import _autocast, _custom
from fmp.torch._scaler import _grad_scaler

__all__ = ["GradScaler", "autocast", "custom_bwd", "custom_fwd"]

_MSG_SCALER = (
    "`torch.cuda.amp.GradScaler(args...)` is deprecated. Please use `torch.amp.GradScaler('cuda', args...)` instead."
)
_MSG_AUTOCAST = (
    "`torch.cuda.amp.autocast(args...)` is deprecated. Please use `torch.amp.autocast('cuda', args...)` instead."
)
_MSG_FWD = (
    "`torch.cuda.amp.custom_fwd(args...)` is deprecated. "
    "Please use `torch.amp.custom_fwd(args..., device_type='cuda')` instead."
)
_MSG_BWD = (
    "`torch.cuda.amp.custom_bwd(args...)` is deprecated. "
    "Please use `torch.amp.custom_bwd(args..., device_type='cuda')` instead."
)


class GradScaler(_grad_scaler.GradScaler):
    """Deprecated ``torch.cuda.amp.GradScaler``: warns, then ``fmp.torch.GradScaler("cuda", ...)``.

    Examples:
      >>> import warnings, fmp.torch.cuda.amp
      >>> with warnings.catch_warnings(record=True) as w:
      ...     warnings.simplefilter("always")
      ...     s = fmp.torch.cuda.amp.GradScaler(enabled=False)
      >>> w[0].category.__name__, s.is_enabled()
      ('FutureWarning', False)
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        warnings.warn(_MSG_SCALER, FutureWarning, stacklevel=2)
        super().__init__(
            "cuda",
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )


class autocast(_autocast.autocast):  # noqa: N801 (torch's name)
    """Deprecated ``torch.cuda.amp.autocast``: warns, then ``fmp.torch.autocast("cuda", ...)``.

    Examples:
      >>> import warnings, fmp.torch.cuda.amp
      >>> with warnings.catch_warnings(record=True) as w:
      ...     warnings.simplefilter("always")
      ...     ctx = fmp.torch.cuda.amp.autocast(enabled=False)
      >>> w[0].category.__name__, ctx.device
      ('FutureWarning', 'cuda')
    """

    def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True) -> None:
        warnings.warn(_MSG_AUTOCAST, FutureWarning, stacklevel=2)
        super().__init__("cuda", enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)


def custom_fwd(fwd: Callable[..., Any] | None = None, *, cast_inputs: torch.dtype | None = None) -> Any:
    """Deprecated ``torch.cuda.amp.custom_fwd``: warns, then ``fmp.torch.custom_fwd(device_type="cuda")``.

    Examples:
      >>> import warnings, torch, fmp.torch.cuda.amp
      >>> with warnings.catch_warnings(record=True) as w:
      ...     warnings.simplefilter("always")
      ...     class Double(torch.autograd.Function):
      ...         @staticmethod
      ...         @fmp.torch.cuda.amp.custom_fwd
      ...         def forward(ctx, x):
      ...             return 2 * x
      ...         @staticmethod
      ...         def backward(ctx, g):
      ...             return 2 * g
      >>> w[0].category.__name__, Double.apply(torch.ones(2))
      ('FutureWarning', tensor([2., 2.]))
    """
    warnings.warn(_MSG_FWD, FutureWarning, stacklevel=2)
    return functools.partial(_custom.custom_fwd, device_type="cuda")(fwd=fwd, cast_inputs=cast_inputs)


def custom_bwd(bwd: Callable[..., Any]) -> Any:
    """Deprecated ``torch.cuda.amp.custom_bwd``: warns, then ``fmp.torch.custom_bwd(device_type="cuda")``.

    Examples:
      >>> import warnings, torch, fmp.torch.cuda.amp
      >>> with warnings.catch_warnings(record=True) as w:
      ...     warnings.simplefilter("always")
      ...     class Double(torch.autograd.Function):
      ...         @staticmethod
      ...         @fmp.torch.cuda.amp.custom_fwd  # custom_bwd needs it on forward, as in torch
      ...         def forward(ctx, x):
      ...             return 2 * x
      ...         @staticmethod
      ...         @fmp.torch.cuda.amp.custom_bwd
      ...         def backward(ctx, g):
      ...             return 2 * g
      >>> x = torch.ones(2, requires_grad=True)
      >>> Double.apply(x).sum().backward()
      >>> [m.category.__name__ for m in w], x.grad
      (['FutureWarning', 'FutureWarning'], tensor([2., 2.]))
    """
    warnings.warn(_MSG_BWD, FutureWarning, stacklevel=2)
    return _custom.custom_bwd(bwd, device_type="cuda")
