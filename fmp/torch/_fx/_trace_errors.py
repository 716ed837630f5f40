"""What the FX transform tells the user when a program does not trace as it runs.

The checks and messages of ``autocast_fx`` / ``autocast_graph`` about the program
rather than the policy: outputs torch's pytree cannot flatten, data-dependent
Python control flow, graphs without the node metadata the rewrite reads, and
device moves that a trace without autocast recorded as casts.
"""

from __future__ import annotations

import os
import re
import sysconfig
import traceback
import warnings
from typing import Any, NoReturn

import torch
import torch.fx
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils import _pytree as pytree

import fmp

_MSG_OUTPUT = (
    "autocast_fx traces programs whose outputs are tensors and plain values in pytree containers (tuples, lists, "
    "dicts, dataclasses torch's pytree knows, Hugging Face ModelOutput); output {path} is a {kind}, which torch's "
    "pytree cannot flatten, so neither autocast_fx nor torch.export can trace it.{hint}"
)
_HINT_CACHE = (
    " It is a Hugging Face KV cache: call the model with use_cache=False (for training and single forward "
    "passes the cache is unused), e.g. functools.partial(model, use_cache=False) or model.config.use_cache = False."
)
_MSG_DATA_DEPENDENT = (
    "autocast_fx cannot trace this program: it reads a tensor's value to choose what to run, at {where}. A trace "
    "records one path without the values, so Python control flow on tensor values (`if x.max() > 0:`, `.item()`, "
    "`.tolist()`, a size from `nonzero()`) stops it. Call the program without the argument that takes this path (a "
    "Hugging Face model called with `labels` checks them against the vocabulary: trace it without labels and compute "
    "the loss from the traced logits), choose a model option that traces (Hugging Face mixture-of-experts models: "
    "experts_implementation='batched_mm' instead of 'eager'), or run it eagerly under fmp.torch.autocast(...), which "
    "casts as the program runs."
)
_NOTE_REAL_TRACE = (
    "autocast_fx traced with fake tensors first and failed as above; its retry with real tensors stopped at "
    "data-dependent control flow at {where}."
)
_MSG_NO_META = (
    "autocast_graph reads node.meta['val'], the fake tensor (dtype, shape, device) that make_fx and torch.export "
    "record for every value; node {node!r} ({op}) has none. A torch.fx.symbolic_trace graph records no values and "
    "calls modules and torch functions rather than ATen ops: trace with make_fx(fn, pre_dispatch=True)(*inputs) or "
    "torch.export.export(module, inputs).module(), or call fmp.torch.autocast_fx(module, inputs), which traces one."
)
_MSG_TRACED_MOVE = (
    "autocast_graph: aten.to.dtype_layout {nodes} cast to dtype={traced}, the dtype the input had while the graph "
    "was traced; under this policy the input is {now}, so the graph casts it to {traced}. torch records a device move "
    "(`x.to(device)`, `x.to('cpu')`, `x.cpu()`) this way, and eager autocast keeps {now} there. If these are device "
    "moves, trace under autocast: fmp.torch.autocast_fx(...), or torch.export.export / make_fx inside "
    "`with torch.autocast(device_type, dtype=...)` with this policy's dtype, so that the graph records autocast's "
    "dtypes."
)

_PLAIN_OUTPUTS = (torch.Tensor, int, float, bool, complex, str, type(None), torch.dtype, torch.device)
_DATA_DEPENDENT = (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException)
_REAL_TRACE_READ = "trying to get value out of a tracing tensor"  # make_fx's error for a value read in a real trace
_TO_DTYPE_LAYOUT = torch.ops.aten.to.dtype_layout
_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, fmp))
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_SITE = tuple(sysconfig.get_paths()[k] + os.sep for k in ("purelib", "platlib"))
_STACK_FILE = re.compile(r'File "([^"]+)", line (\d+)')


def check_outputs(out: Any) -> None:
    """Raises a TypeError naming the first output leaf torch's pytree cannot flatten (a KV cache object)."""
    for path, leaf in pytree.tree_flatten_with_path(out)[0]:
        if not isinstance(leaf, _PLAIN_OUTPUTS):
            kind = type(leaf).__name__
            hint = _HINT_CACHE if "Cache" in kind or "past_key_values" in pytree.keystr(path) else ""
            raise TypeError(_MSG_OUTPUT.format(path=f"output{pytree.keystr(path)}", kind=kind, hint=hint))


def _is_data_dependent(err: BaseException) -> bool:
    return isinstance(err, _DATA_DEPENDENT) or _REAL_TRACE_READ in str(err)


def _is_program_file(filename: str) -> bool:
    """Whether a traceback frame is the user's or a model library's code (not torch, fmp or the stdlib)."""
    if filename.startswith("<") or filename.startswith(_LIBRARY_DIRS):
        return False
    return not filename.startswith(_STDLIB) or filename.startswith(_SITE)


def _where(err: BaseException) -> str:
    """``file:line (code)`` of the innermost frame of the program (not torch, not fmp) in ``err``'s traceback."""
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        if _is_program_file(frame.filename):
            code = f" ({frame.line.strip()})" if frame.line else ""
            return f"{frame.filename}:{frame.lineno}{code}"
    return "a line of the program (see the traceback above)"


def raise_trace_failure(fake_err: BaseException, real_err: BaseException) -> NoReturn:
    """Raises the error that explains why neither the fake nor the real trace worked."""
    if _is_data_dependent(fake_err):
        raise RuntimeError(_MSG_DATA_DEPENDENT.format(where=_where(fake_err))) from fake_err
    if _is_data_dependent(real_err):  # the real trace read a value that the fake one never asked for
        fake_err.add_note(_NOTE_REAL_TRACE.format(where=_where(real_err)))
        raise fake_err
    raise real_err


def check_meta(graph: torch.fx.Graph) -> None:
    """Raises a ValueError unless the graph carries the ``meta['val']`` of make_fx / torch.export."""
    nodes = list(graph.nodes)
    if not any("val" in n.meta for n in nodes) and nodes:  # symbolic_trace: no values at all
        raise ValueError(_MSG_NO_META.format(node=nodes[0].name, op=nodes[0].op))
    for node in nodes:
        if isinstance(node.target, torch._ops.OpOverload) and "val" not in node.meta:
            raise ValueError(_MSG_NO_META.format(node=node.name, op=node.op))


def is_traced_move(node: torch.fx.Node, args: tuple, vals: dict[torch.fx.Node, Any]) -> bool:
    """Whether ``node`` is a ``to.dtype_layout`` that was a no-op cast when traced and casts after the rewrite.

    torch records ``x.to(device)`` as ``to.dtype_layout`` with the dtype the
    tracer saw, so a graph traced without autocast turns a device move into a
    cast to float32 once autocast lowers its input. A cast the program wrote
    (``.float()``, ``.to(dtype)``, ``.to(device, dtype)``, ``.to(other)``) is
    recorded as another overload and is never reported. ``args`` are the node's
    arguments in the new graph, ``vals`` the new graph's values.
    """
    if node.target is not _TO_DTYPE_LAYOUT or not isinstance(node.args[0], torch.fx.Node):
        return False
    dtype, old, new_input = node.kwargs.get("dtype"), node.args[0].meta.get("val"), vals.get(args[0])
    if dtype is None or not isinstance(old, torch.Tensor) or not isinstance(new_input, torch.Tensor):
        return False
    return old.dtype == dtype and new_input.dtype != dtype


def warn_traced_moves(moves: list[tuple[torch.fx.Node, torch.dtype]]) -> None:
    """One warning naming the ``to.dtype_layout`` nodes ``is_traced_move`` found, and where they come from."""
    if not moves:
        return
    named = []
    for node, _ in moves:
        found = _STACK_FILE.findall(node.meta.get("stack_trace") or "")
        named.append(f"{node.name!r} ({found[-1][0]}:{found[-1][1]})" if found else repr(node.name))
    node, now = moves[0]
    traced = str(node.kwargs["dtype"]).removeprefix("torch.")
    nodes = ("node " if len(named) == 1 else "nodes ") + ", ".join(named)
    message = _MSG_TRACED_MOVE.format(nodes=nodes, traced=traced, now=str(now).removeprefix("torch."))
    warnings.warn(message, UserWarning, stacklevel=4)
