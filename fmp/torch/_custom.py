"""``custom_fwd`` / ``custom_bwd``: autocast-aware custom autograd functions (torch.amp semantics).

``custom_fwd`` records the autocast state forward ran under on ``ctx``;
``custom_bwd`` re-enters the same state for backward. With ``cast_inputs``,
forward runs with autocast off on inputs cast to that dtype (floating tensors
on the device, not float64, through tuples, lists and dicts). Both also know
fmp's custom-rule regions: a forward under ``fmp.torch.autocast(rules=...)``
counts as autocast-enabled, and backward re-enters those rules.
"""

from __future__ import annotations

import collections.abc
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fmp.torch._autocast import autocast, current_rule_mode

__all__ = ["custom_bwd", "custom_fwd"]

_MSG_DEVICE_TYPE = "Expected `device_type` of type `str`, got: `{}`"


def _cast(value: Any, device_type: str, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        eligible = value.is_floating_point() and value.device.type == device_type and value.dtype is not torch.float64
        return value.to(dtype) if eligible else value
    if isinstance(value, str | bytes | np.ndarray):
        return value
    if isinstance(value, collections.abc.Mapping):
        return {_cast(k, device_type, dtype): _cast(v, device_type, dtype) for k, v in value.items()}
    if isinstance(value, collections.abc.Iterable):
        items = (_cast(v, device_type, dtype) for v in value)
        return type(value)(items) if isinstance(value, list | tuple) else items
    return value


def _state(device_type: str) -> tuple[bool, torch.dtype, Any]:
    """(enabled, dtype, custom rules or None) of the current region on ``device_type``."""
    mode = current_rule_mode(device_type)
    if mode is not None:
        return True, mode.dtype, mode.rules
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type), None


def custom_fwd(
    fwd: Callable[..., Any] | None = None, *, device_type: str, cast_inputs: torch.dtype | None = None
) -> Any:
    """Decorates a custom ``autograd.Function.forward`` so it cooperates with autocast.

    Args:
      fwd: The forward staticmethod (omit to get a decorator).
      device_type: Device type of the autocast region (``"cpu"``, ``"cuda"``); keyword only.
      cast_inputs: If set and forward runs in an autocast region, floating inputs
        are cast to it and forward runs with autocast off. Outside autocast, a no-op.

    Raises:
      ValueError: ``device_type`` is not a str (torch's message).
      TypeError: ``device_type`` is missing.

    Examples:
      >>> import torch, fmp.torch
      >>> class Square(torch.autograd.Function):
      ...     @staticmethod
      ...     @fmp.torch.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
      ...     def forward(ctx, x):
      ...         return x * x
      ...     @staticmethod
      ...     @fmp.torch.custom_bwd(device_type="cpu")
      ...     def backward(ctx, g):
      ...         return g
      >>> with fmp.torch.autocast("cpu"):
      ...     Square.apply(torch.ones(2, dtype=torch.bfloat16)).dtype
      torch.float32
    """
    if not isinstance(device_type, str):
        raise ValueError(_MSG_DEVICE_TYPE.format(type(device_type)))
    if fwd is None:
        return functools.partial(custom_fwd, device_type=device_type, cast_inputs=cast_inputs)

    @functools.wraps(fwd)
    def decorate_fwd(*args: Any, **kwargs: Any) -> Any:
        ctx = args[0]
        enabled, dtype, rules = _state(device_type)
        ctx._dtype = dtype
        ctx._fmp_rules = rules
        if cast_inputs is None:
            ctx._fwd_used_autocast = enabled
            return fwd(*args, **kwargs)
        ctx._fwd_used_autocast = False
        if not enabled:
            return fwd(*args, **kwargs)
        with autocast(device_type, enabled=False):
            return fwd(*_cast(args, device_type, cast_inputs), **_cast(kwargs, device_type, cast_inputs))

    return decorate_fwd


def custom_bwd(bwd: Callable[..., Any] | None = None, *, device_type: str) -> Any:
    """Decorates a custom ``autograd.Function.backward`` to run in forward's autocast state.

    Args:
      bwd: The backward staticmethod (omit to get a decorator).
      device_type: Device type of the autocast region; keyword only.

    Raises:
      ValueError: ``device_type`` is not a str (torch's message).

    Examples:
      >>> import torch, fmp.torch
      >>> deco = fmp.torch.custom_bwd(device_type="cpu")
      >>> callable(deco)
      True
    """
    if not isinstance(device_type, str):
        raise ValueError(_MSG_DEVICE_TYPE.format(type(device_type)))
    if bwd is None:
        return functools.partial(custom_bwd, device_type=device_type)

    @functools.wraps(bwd)
    def decorate_bwd(*args: Any, **kwargs: Any) -> Any:
        ctx = args[0]
        rules = getattr(ctx, "_fmp_rules", None)
        with autocast(device_type, enabled=ctx._fwd_used_autocast, dtype=ctx._dtype, rules=rules):
            return bwd(*args, **kwargs)

    return decorate_bwd
