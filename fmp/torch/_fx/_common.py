"""What torch's autocast kernels do, as plain functions the FX rewrite and its report share."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from fmp._core._frames import user_frame

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def node_source(node: torch.fx.Node | None) -> str:
    """``/path/to/file.py:12 (fn)`` of the innermost user frame of a node's stack trace (``fmp._core._frames``),
    or ``""`` when no frame is the user's."""
    trace = node.meta.get("stack_trace", "") if node is not None else ""
    found = user_frame(reversed(_FRAME.findall(trace or "")), lambda frame: frame[0])
    return f"{found[0]}:{found[1]} ({found[2]})" if found else ""


CIA = torch._C.DispatchKey.CompositeImplicitAutograd
TO_COPY = torch.ops.aten._to_copy.default
ASSERT_META = torch.ops.aten._assert_tensor_metadata.default
MAX_DEPTH = 8
RUN = object()  # _emit: compute the node's value with fake tensors

_MSG_PRIORITIZE = (
    "Unexpected floating ScalarType in at::autocast::prioritize: {op} gets {dtypes} (in argument order) "
    "under a {compute} policy; torch raises the same error when another low-precision dtype comes before "
    "any float32 argument. Cast the inputs to one low-precision dtype or to float32 first."
)
MSG_HOP = (
    "autocast_graph cannot rewrite inside the higher-order op {op!r} (node {node!r}); only "
    "wrap_with_autocast and wrap_with_set_grad_enabled are supported. Trace the model without it, or "
    "apply the policy inside its branches yourself."
)
MSG_OPAQUE = (
    "autocast_graph cannot look inside {op} node {node!r}, and the policy changed the dtype of its inputs. "
    "Trace the module to ATen ops with make_fx(..., pre_dispatch=True) or torch.export first."
)
# AutocastCUDA's fp32_append_dtype ops call their dtype overload instead of casting.
_APPEND_DTYPE_OVERLOAD = {"Scalar": "ScalarOpt_dtype", "ScalarOpt_dim": "ScalarOpt_dim_dtype"}


@contextlib.contextmanager
def ambient_autocast(state: dict[str, tuple[bool, torch.dtype]]) -> Iterator[None]:
    """Turns torch's own autocast state on while tracing, so traced values carry autocast's dtypes.

    Uses the low-level setters because ``torch.autocast("cuda")`` refuses to start
    on a CPU-only build, while fake CUDA tensors dispatch to the AutocastCUDA
    kernels there just fine. The cast cache stays off (it keys on tensor addresses).
    """
    saved = {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in state}
    cache = torch.is_autocast_cache_enabled()
    try:
        torch.set_autocast_cache_enabled(False)
        for device, (enabled, dtype) in state.items():
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        yield
    finally:
        for device, (enabled, dtype) in saved.items():
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        torch.set_autocast_cache_enabled(cache)


def op_key(op: torch._ops.OpOverload) -> str:
    """The dispatcher name autocast is registered on: ``aten::linear``, ``aten::pow.Tensor_Scalar``."""
    name = op._schema.name
    return name if op._overloadname == "default" else f"{name}.{op._overloadname}"


@dataclasses.dataclass
class Event:
    """One rewritten node, for the explain report (filled only when a report is requested)."""

    op: str
    category: str
    node: torch.fx.Node  # the node in the new graph
    origin: torch.fx.Node | None  # the node of the user's graph it came from
    in_before: tuple[str, ...]
    in_after: tuple[str, ...]
    out_before: tuple[str, ...]
    detail: str = ""  # a float8 row: its recipe and the op it replaced


def module_path(node: torch.fx.Node | None) -> str:
    """The path of the innermost module a node ran in (``"layers.0.attn"``), from ``nn_module_stack``; ``""``."""
    stack = node.meta.get("nn_module_stack") if node is not None else None
    if not stack:
        return ""
    path, _cls = list(stack.values())[-1]
    return str(path)


def float_names(vals: Any) -> tuple[str, ...]:
    leaves = pytree.tree_leaves(vals)
    return tuple(str(v.dtype).removeprefix("torch.") for v in leaves if is_tensor(v) and v.dtype.is_floating_point)


def is_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def device_of(vals: list[Any]) -> str | None:
    """The device type whose autocast key the op dispatches to (a non-CPU device wins, as in torch)."""
    devices = [v.device.type for v in vals if is_tensor(v)]
    for d in devices:
        if d != "cpu":
            return d
    return devices[0] if devices else None


def prioritize(key: str, compute: torch.dtype, eligible: list[torch.dtype]) -> None:
    """Raises where torch's ``at::autocast::prioritize`` does: it walks the args in order from the
    autocast dtype, and a second low-precision dtype met before any float32 is an error."""
    current = compute
    for dtype in eligible:
        if current == torch.float32 or dtype == torch.float32:
            current = torch.float32
        elif dtype != compute:
            names = [dtype_name(d) for d in eligible]
            raise RuntimeError(_MSG_PRIORITIZE.format(op=key, dtypes=names, compute=dtype_name(compute)))


def _dtype_overload(op: torch._ops.OpOverload, args: tuple) -> tuple[torch._ops.OpOverload, tuple]:
    """The ``dtype`` overload AutocastCUDA's fp32_append_dtype calls, with defaulted args spelled out."""
    target = getattr(op.overloadpacket, _APPEND_DTYPE_OVERLOAD[op._overloadname])
    positional = [a for a in op._schema.arguments if not a.kwarg_only]
    full = list(args) + [a.default_value for a in positional[len(args) :]]
    return target, tuple(full)


def is_eligible(v: Any, device: str) -> bool:
    """Whether autocast on ``device`` casts ``v``: a floating tensor on that device, not float64."""
    return is_tensor(v) and v.dtype.is_floating_point and v.dtype != torch.float64 and v.device.type == device


def cuda_variant_call(
    variant: str, op: torch._ops.OpOverload, args: tuple, kwargs: dict, first: Any, device: str
) -> tuple[torch._ops.OpOverload, tuple, dict, bool]:
    """The call AutocastCUDA makes for a float32 op that takes a dtype instead of casting its inputs.

    torch passes ``dtype=float32`` (``set_opt_dtype``) or calls the dtype overload
    (``append_dtype``) only when the first argument is eligible; ``append_dtype``
    passes the first argument's own dtype otherwise. Returns the op, args and kwargs
    to emit, and whether they differ from the call as written.
    """
    if is_eligible(first, device):
        if variant == "set_opt_dtype":
            if kwargs.get("dtype") is None:
                return op, args, {**kwargs, "dtype": torch.float32}, True
            return op, args, kwargs, False
        target, args = _dtype_overload(op, args)
        return target, args, {**kwargs, "dtype": torch.float32}, True
    if variant == "append_dtype" and is_tensor(first):
        target, args = _dtype_overload(op, args)
        return target, args, {**kwargs, "dtype": first.dtype}, True
    return op, args, kwargs, False


def same_meta(old: Any, new: Any) -> bool:
    if old is new:
        return True
    if is_tensor(old) and is_tensor(new):
        return old.dtype == new.dtype and old.device == new.device and old.shape == new.shape
    if isinstance(old, list | tuple) and isinstance(new, list | tuple) and len(old) == len(new):
        return all(same_meta(a, b) for a, b in zip(old, new, strict=True))
    return old is None and new is None
