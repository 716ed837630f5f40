"""``autocast``: torch's native autocast for the default rules, a torch-function mode for custom ones.

Design
------
* **Default rules** (no ``rules=``, or ``rules=fmp.DEFAULT_RULES``): the region is
  a ``torch.amp.autocast`` underneath. Results, the cast cache, thread-locality,
  nesting, export capture and every warning are torch's own, so outputs are
  bit-identical to ``torch.autocast`` by construction.
* **Custom rules** (``rules=`` another `fmp.RuleSet`): torch's autocast is
  switched off for the region and a ``TorchFunctionMode`` casts the floating
  arguments of each torch call per ``rules.category("aten::<name>", "torch",
  device)`` and ``fmp._core._rules.decide``, with torch's eligibility rule
  (floating, not float64, on the region's device type). The casts happen above
  autograd, so backward runs in the dtypes forward chose (as with torch).

Why a torch-function mode and not a dispatch mode: a ``TorchDispatchMode`` sits
below autograd, so a cast made there is invisible to autograd and backward mixes
dtypes; it also sees CompositeImplicitAutograd ops (``linear``,
``cross_entropy_loss``) already decomposed into ``t``/``addmm``/``_log_softmax``,
which are not the names torch's (and fmp's) rule table uses. A torch-function
mode sees the calls the user made (``F.linear``, ``torch.mm``,
``Tensor.__matmul__``, ``F.cross_entropy``), which map to the table's names.

Limits of the custom-rule path (documented, tested where testable):
* Names are matched on the function's base name (``aten::pow`` matches the
  table's ``aten::pow.Tensor_Scalar``; ``__matmul__`` -> ``aten::matmul``,
  ``cross_entropy`` -> ``aten::cross_entropy_loss``); overloads are not told
  apart, in-place and ``out=`` calls are never cast (as in torch).
* The mode sees one level of torch calls: a Python-level function that calls
  other torch functions (``F.multi_head_attention_forward``) is one unit, its
  inner calls are not cast. torch's autocast, at the dispatcher, sees them.
* No cast cache: a weight used three times is cast three times (same values).
* ``torch.is_autocast_enabled()`` reports False inside a custom-rule region,
  so third-party ``torch.amp.custom_fwd`` code sees autocast off
  (``fmp.torch.custom_fwd`` knows about custom regions).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from fmp._core import _rules
from fmp._policy import Policy
from fmp.torch._policy import torch_policy

__all__ = ["autocast", "is_autocast_available"]

_NAME_ALIASES = {
    "__matmul__": "matmul",
    "__rmatmul__": "matmul",
    "__pow__": "pow",
    "__rpow__": "pow",
    "cross_entropy": "cross_entropy_loss",
}


def _name(dtype: torch.dtype) -> str:
    """Canonical dtype name (``torch.bfloat16`` -> ``"bfloat16"``); float8 types keep their own name."""
    return str(dtype).removeprefix("torch.")


_MSG_RULES_TYPE = "autocast(rules=...) expects an fmp.RuleSet, got {!r} of type {}"
_MSG_POLICY_DTYPE = "autocast: dtype={} disagrees with the policy's compute dtype {}; give one of them"

_local = threading.local()


def _region_stack() -> list[tuple[str, Any]]:
    """This thread's open fmp regions: ``(device_type, _RuleMode or None)``, innermost last."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def current_rule_mode(device_type: str) -> _RuleMode | None:
    """The custom-rule mode of the innermost fmp region on ``device_type``, or None."""
    for device, mode in reversed(_region_stack()):
        if device == device_type:
            return mode
    return None


@functools.lru_cache(maxsize=8)
def _base_index(rules: Any, device: str) -> dict[str, _rules.Category]:
    """``base op name -> category`` for the torch table of ``device`` (first overload wins)."""
    index: dict[str, _rules.Category] = {}
    for name, cat in rules.table("torch", device).items():
        base = name.removeprefix("aten::").split(".")[0]
        index.setdefault(base, cat)
    return index


def _eligible(x: Any, device_type: str) -> bool:
    return (
        isinstance(x, torch.Tensor)
        and x.is_floating_point()
        and x.dtype is not torch.float64
        and (x.device.type == device_type)
    )


def _map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, list | tuple):
        return type(value)(_map_tensors(fn, v) for v in value)
    return value


class _RuleMode(TorchFunctionMode):
    """Casts the floating arguments of torch calls per an fmp rule table."""

    def __init__(self, rules: Any, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.rules = rules
        self.device_type = device_type
        self.dtype = dtype
        self.dtype_name = _name(dtype)
        self.index = _base_index(rules, "cuda" if device_type == "cuda" else "cpu")

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inplace = name.endswith("_") and not name.startswith("__")
        if current_rule_mode(self.device_type) is not self or inplace or "out" in kwargs:
            return func(*args, **kwargs)
        name = _NAME_ALIASES.get(name, name)
        category = self.index.get(name)
        if category is None or category is _rules.Category.UNLISTED:
            return func(*args, **kwargs)
        if category is _rules.Category.BANNED:
            raise RuntimeError(self.rules.banned_message("aten::" + name))
        found: list[str] = []
        _map_tensors(lambda t: found.append(_name(t.dtype)) if _eligible(t, self.device_type) else None, args)
        _map_tensors(
            lambda t: found.append(_name(t.dtype)) if _eligible(t, self.device_type) else None,
            list(kwargs.values()),
        )
        target = _rules.decide(category, self.dtype_name, found)
        if target is None:
            return func(*args, **kwargs)
        to = getattr(torch, target)

        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(to) if _eligible(t, self.device_type) and t.dtype is not to else t

        args = _map_tensors(cast, args)
        kwargs = {k: _map_tensors(cast, v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def is_autocast_available(device_type: str) -> bool:
    """Whether `fmp.torch.autocast` can run on ``device_type`` (``torch.amp.is_autocast_available``).

    With the default rules an `fmp.torch.autocast` region is torch's own autocast, so the answer is
    torch's, with torch's errors. `fmp.torch.autocast_fx` has rule tables for ``"cpu"`` and ``"cuda"``.

    Args:
      device_type: A device type, as ``torch.device(...).type`` names it (``"cpu"``, ``"cuda"``, ...).

    Returns:
      True if torch has autocast for ``device_type``.

    Raises:
      TypeError: ``device_type`` is not a str (torch's message).
      RuntimeError: ``device_type`` is not a device type torch knows (torch's message).

    Examples:
      >>> import fmp.torch
      >>> fmp.torch.is_autocast_available("cpu"), fmp.torch.is_autocast_available("meta")
      (True, False)
    """
    return torch.amp.is_autocast_available(device_type)


class autocast:  # noqa: N801 (torch's name)
    """A region (context manager or decorator) where ops run in mixed precision.

    With the default rules this is ``torch.autocast`` (same arguments, same
    results, bit for bit). ``policy=`` and ``rules=`` are fmp's additions.

    Args:
      device_type: ``"cpu"``, ``"cuda"``, ... (as ``torch.autocast``).
      dtype: Low-precision dtype; ``None`` takes torch's current default for the
        device (CPU bfloat16, CUDA float16) or the policy's compute dtype.
      enabled: False makes an autocast-free region (nestable).
      cache_enabled: torch's weight-cast cache (``None``: torch's current setting).
      policy: An `fmp.Policy` or spec (``"mixed_bfloat16"``); its compute
        dtype is the region's dtype (a float32 compute dtype disables the region).
        As a decorator, floating tensor outputs are cast to its output dtype.
      rules: A custom `fmp.RuleSet`; ops are cast per its torch table by a
        torch-function mode (see the module docs for the limits).

    Raises:
      ValueError: ``device_type`` is not a str (torch's message), or ``dtype``
        disagrees with ``policy``.
      TypeError: ``rules`` is not a RuleSet.
      NotImplementedError: ``policy`` is a float8 policy (``"mixed_float8"``): eager autocast has no
        float8 (``autocast_fx`` has).

    Examples:
      >>> import torch, fmp.torch
      >>> a = torch.ones(2, 2)
      >>> with fmp.torch.autocast("cpu"):
      ...     (a @ a).dtype
      torch.bfloat16
      >>> rules = fmp.DEFAULT_RULES.derive(framework="torch", unlisted=["aten::matmul"])
      >>> with fmp.torch.autocast("cpu", rules=rules):
      ...     (a @ a).dtype
      torch.float32
    """

    def __init__(
        self,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
        *,
        policy: Policy | str | None = None,
        rules: Any = None,
    ) -> None:
        self._policy = None if policy is None else torch_policy(policy)
        if self._policy is not None:
            compute = getattr(torch, self._policy.compute_dtype.name)
            if dtype is not None and dtype != compute:
                raise ValueError(_MSG_POLICY_DTYPE.format(dtype, compute))
            if compute is torch.float32 or compute is torch.float64:
                enabled = False
            else:
                dtype = compute
        if rules is not None and not isinstance(rules, _rules.RuleSet):
            raise TypeError(_MSG_RULES_TYPE.format(rules, type(rules).__name__))
        self._rules = None if rules is None or rules == _rules.DEFAULT_RULES else rules
        # torch validates device_type and dtype, warns and disables exactly as torch.autocast does
        self._native = torch.amp.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
        self.device = self._native.device
        self.fast_dtype = self._native.fast_dtype
        self._enabled = self._native._enabled
        self._cache_enabled = self._native._cache_enabled

    def __enter__(self) -> autocast:
        custom = self._rules is not None and self._enabled
        if custom:
            # torch's autocast off underneath; the mode does the casting
            self._native._enabled = False
        self._native.__enter__()
        self._native._enabled = self._enabled
        mode = _RuleMode(self._rules, self.device, self.fast_dtype) if custom else None
        if mode is not None:
            mode.__enter__()
        # per thread, so one instance may decorate a function that runs in several threads
        _region_stack().append((self.device, mode))
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> bool:
        _, mode = _region_stack().pop()
        try:
            if mode is not None:
                mode.__exit__(exc_type, exc_val, exc_tb)
        finally:
            self._native.__exit__(exc_type, exc_val, exc_tb)
        return False

    def __call__(self, func: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(func):
            # torch's message and type
            return self._native(func)
        output = self._policy.output_dtype.name if self._policy is not None else None

        @functools.wraps(func)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with self:
                out = func(*args, **kwargs)
            if output is None:
                return out
            to = getattr(torch, output)
            return _map_tensors(
                lambda t: t.to(to) if t.is_floating_point() and t.dtype is not torch.float64 else t, out
            )

        return wrapped
