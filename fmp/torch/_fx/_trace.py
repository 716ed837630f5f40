"""Tracing a module or function to a pre-dispatch ATen graph over the module's own state.

``trace`` records the graph under the autocast mode the rewrite will emulate, with the module's parameters
and buffers as its first placeholders; ``bind_state`` turns those placeholders back into the module's own
tensors, so the rewritten graph trains the same parameters.

When a program does not trace as it runs, the user is told here too: outputs torch's pytree cannot
flatten, data-dependent Python control flow, graphs without the node metadata the rewrite reads, and
device moves that a trace without autocast recorded as casts.
"""

from __future__ import annotations

import inspect
import re
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
import torch.fx
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils import _pytree as pytree

from fmp._core import _frames
from fmp.torch._fx._casts import GRAD_LEAF, is_grad_leaf
from fmp.torch._fx._common import ambient_autocast

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


def _line(frame: traceback.FrameSummary) -> str:
    code = f" ({frame.line.strip()})" if frame.line else ""
    return f"{frame.filename}:{frame.lineno}{code}"


def _where(err: BaseException) -> str:
    """``file:line (code)`` of the innermost user frame in ``err``'s traceback (``fmp._core._frames``); when
    the innermost frame that is neither torch, fmp nor the standard library is an installed package's (a
    Hugging Face model), that frame, marked as such, and the user's line that reached it."""
    rule = _frames.rule()
    program = [f for f in reversed(traceback.extract_tb(err.__traceback__)) if rule.kind(f.filename) != "framework"]
    user = next((f for f in program if rule.kind(f.filename) == "user"), None)
    if program and program[0] is not user:
        reached = f", reached from {_line(user)}" if user is not None else ""
        return f"{_line(program[0])} (an installed package's code{reached})"
    return _line(user) if user is not None else "a line of the program (see the traceback above)"


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


def trace(
    fn_or_module: Callable | torch.nn.Module, example_inputs: Any, device_type: str, dtype: torch.dtype
) -> tuple[torch.fx.GraphModule, list[str], Any]:
    """Traces a pre-dispatch ATen graph whose first placeholders are a module's params and buffers.

    Returns the graph module (calling convention: flat ``*state, *input_leaves``),
    the qualified names of the state placeholders, and the codegen that gives the
    caller's calling convention once the state placeholders are gone.
    """
    if isinstance(example_inputs, torch.Tensor) or not isinstance(example_inputs, Sequence):
        raise TypeError(
            f"example_inputs must be a tuple of positional arguments, e.g. (x,), got {type(example_inputs).__name__}"
        )
    if isinstance(fn_or_module, torch.nn.Module):
        module = fn_or_module
        state = dict(module.named_parameters())
        state.update(module.named_buffers())
    elif callable(fn_or_module):
        module, state = None, {}
    else:
        raise TypeError(f"fn_or_module must be a callable or a torch.nn.Module, got {type(fn_or_module).__name__}")
    names = list(state)
    in_leaves, in_spec = pytree.tree_flatten(list(example_inputs))
    out_spec: list[pytree.TreeSpec] = []

    def flat(*leaves: Any) -> list[Any]:
        args = pytree.tree_unflatten(list(leaves[len(names) :]), in_spec)
        if module is not None:
            out = torch.func.functional_call(module, dict(zip(names, leaves[: len(names)], strict=True)), tuple(args))
        else:
            out = fn_or_module(*args)
        check_outputs(out)
        out_leaves, spec = pytree.tree_flatten(out)
        out_spec.append(spec)
        return out_leaves

    if module is not None:  # make_fx records each node's module path (nn_module_stack) from this root
        flat._orig_mod = module  # type: ignore[attr-defined]

    # Traced with torch's autocast state on, as the eager program runs: Python code that asks
    # torch.is_autocast_enabled() (MultiheadAttention's fast path, user branches) takes the same path,
    # and ops that only run once autocast cast their inputs (linalg on bfloat16) trace. The nodes are
    # still the raw pre-dispatch ops (pre-dispatch tracing sits above the Autocast key); only their
    # recorded values show autocast's dtypes. Fake tensors first (no compute); ops without a fake
    # kernel need a real trace. Tensors a function closes over become constants of the graph.
    errors: list[BaseException] = []
    for mode in ("fake", "real"):
        out_spec.clear()
        ctx = ambient_autocast({device_type: (True, dtype)})
        leaves = [*state.values(), *in_leaves]
        if mode == "real":  # a real trace runs the program: keep BatchNorm stats etc. of the caller intact
            leaves = [_copy_leaf(x) for x in leaves]
        try:
            with ctx:
                gm = make_fx(
                    flat,
                    pre_dispatch=True,
                    tracing_mode=mode,
                    _allow_non_fake_inputs=True,
                    record_stack_traces=True,
                    record_module_stack=True,
                )(*leaves)
            break
        except (RuntimeError, NotImplementedError, Warning) as err:  # Warning: when warnings are errors
            errors.append(err)
    else:
        raise_trace_failure(*errors)
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"][len(names) :]
    for node, leaf in zip(inputs, in_leaves, strict=True):  # torch's cast cache keeps casts of these
        node.meta[GRAD_LEAF] = is_grad_leaf(leaf)
    target = fn_or_module.forward if module is not None else fn_or_module
    codegen = torch.fx.graph._PyTreeCodeGen(
        torch.fx.graph._PyTreeInfo(_arg_names(target, len(example_inputs)), in_spec, out_spec[0])
    )
    return gm, names, codegen


def _copy_leaf(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    return x.detach().clone().requires_grad_(x.requires_grad)


def _arg_names(fn: Callable, n: int) -> list[str]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    plain = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return plain[:n] if len(plain) >= n else [f"arg{i}" for i in range(n)]


def _get(obj: Any, target: str) -> Any:
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def bind_state(
    gm: torch.fx.GraphModule, module: torch.nn.Module | None, names: list[str], codegen: Any
) -> torch.fx.GraphModule:
    """Replaces the state placeholders by get_attr nodes of the module's own params and buffers.

    The result is called like the user's function (``codegen``) and holds the very
    ``Parameter`` and buffer objects of ``module``, under their qualified names.
    """
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    root: dict[str, Any] = {}
    state = iter(names)
    for node in gm.graph.nodes:
        name = next(state, None) if node.op == "placeholder" else None
        if name is not None:
            env[node] = graph.get_attr(name)
            env[node].meta.update(node.meta)
            root[name] = _get(module, name)
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
            if node.op == "get_attr":
                root[node.target] = _get(gm, node.target)
    graph._codegen = codegen
    graph.lint()
    name = type(module).__name__ if module is not None else "Function"
    return torch.fx.GraphModule(root, graph, class_name=f"Autocast{name}")
