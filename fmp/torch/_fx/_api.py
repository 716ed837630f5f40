"""Autocast as a pure transform over torch FX graphs: ``autocast_fx`` and ``autocast_graph``.

The graph level is the pre-dispatch ATen graph (``make_fx(..., pre_dispatch=True)``
or ``torch.export``): its nodes carry exactly the op names torch's autocast is
registered on (``aten.linear``, ``aten.cross_entropy_loss``), which a
post-dispatch graph has already decomposed away.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx

from fmp._core._rules import RuleSet
from fmp.torch._fx._prepare import cast_outputs, output_dtype, prepare, resolve_policy, rewrite


def autocast_graph(
    graph_module: torch.fx.GraphModule,
    policy: Any = None,
    rules: RuleSet | None = None,
    *,
    device_type: str | None = None,
    dtype: Any = None,
) -> torch.fx.GraphModule:
    """Rewrites a pre-dispatch ATen graph so every autocast cast is an explicit node.

    The pure transform for users who already hold a graph from
    ``make_fx(f, pre_dispatch=True)`` or ``torch.export.export(...).module()``.
    Each op listed for the tensors' device gets ``aten._to_copy`` casts on its
    eligible inputs (floating, not float64, same device), exactly as
    ``torch.autocast`` would cast them; traced autocast regions inside keep their
    own settings. The input graph is not modified. Trace the graph under
    ``torch.autocast`` with the same dtype (as ``autocast_fx`` does): a graph
    traced in float32 records conversions that were no-ops then (``x.to(device)``,
    ``.float()`` of a float32 value) in ways eager autocast does not run them.

    Args:
      graph_module: A ``torch.fx.GraphModule`` whose nodes have ``meta["val"]``.
      policy: ``(device_type, dtype)``, a device type (``"cpu"``: bfloat16,
        ``"cuda"``: float16), an fmp ``Policy`` or spec, or ``None`` with the keywords. A
        ``Policy``'s compute dtype is the autocast dtype and its output dtype that of every floating
        output but float64 (``"mixed_bfloat16"``: float32), as ``fmp.torch.autocast(policy=...)``
        gives a decorated function's; its param dtype is where you keep parameters (nothing is cast
        to it, as on the JAX side). The torch spellings leave outputs as torch's autocast does.
      rules: The rule table; ``fmp.DEFAULT_RULES`` (torch's registries, 2.13 to 2.15) if None.
      device_type: ``"cpu"`` or ``"cuda"`` when ``policy`` gives none.
      dtype: ``torch.bfloat16`` or ``torch.float16`` when ``policy`` gives none.

    Returns:
      A new ``GraphModule`` with the same calling convention and no autocast state.

    Raises:
      ValueError, TypeError: a malformed policy or rule set; a graph without
        ``meta["val"]`` (``torch.fx.symbolic_trace``: the message names the
        node and the tracers that record it).
      NotImplementedError: a float8 policy (``"mixed_float8"``): use ``autocast_fx``.
      RuntimeError: a banned op (CUDA ``binary_cross_entropy``) under autocast.

    Warns:
      UserWarning: the graph was traced without autocast and records a device
        move (``x.to(device)``) as a cast to the dtype seen while tracing, which
        now casts an autocast-lowered value back to float32 (eager autocast keeps
        it); trace under autocast instead.

    Examples:
      >>> import torch
      >>> from torch.fx.experimental.proxy_tensor import make_fx
      >>> gm = make_fx(lambda a, b: torch.mm(a, b).exp(), pre_dispatch=True)(torch.ones(2, 2), torch.ones(2, 2))
      >>> out = fmp.torch.autocast_graph(gm, ("cpu", torch.bfloat16))
      >>> [str(n.meta["val"].dtype) for n in out.graph.nodes if n.op == "call_function"]
      ['torch.bfloat16', 'torch.bfloat16', 'torch.bfloat16', 'torch.bfloat16']
    """
    if not isinstance(graph_module, torch.fx.GraphModule):
        raise TypeError(f"graph_module must be a torch.fx.GraphModule, got {type(graph_module).__name__}")
    resolved = resolve_policy(policy, device_type, dtype, rules)
    new = rewrite(graph_module, resolved)
    if (output := output_dtype(resolved)) is not None:
        cast_outputs(new, output)
    return new


def autocast_fx(
    fn_or_module: Callable | torch.nn.Module,
    example_inputs: Sequence[Any],
    policy: Any = None,
    *,
    device_type: str | None = None,
    dtype: Any = None,
    rules: RuleSet | None = None,
    overrides: Mapping[str, Any] | None = None,
    float8_matmul: str = "auto",
) -> torch.fx.GraphModule:
    """Traces ``fn_or_module`` and returns its graph with autocast's casts made explicit.

    The result needs no autocast context: it can be inspected, saved, compiled
    with ``torch.compile`` and exported with ``torch.export``. It is called like
    the input (``gm(*example_inputs)`` returns the same structure). For a module,
    the graph reads the module's own ``Parameter`` and buffer objects (shared, not
    copied), so optimizer steps, ``load_state_dict`` and BatchNorm running-stat
    updates are seen by both. Tracing runs with torch's autocast state on, so Python
    code that checks ``torch.is_autocast_enabled()`` takes the path it takes under
    eager autocast; like any trace, it fixes the train/eval mode, Python control flow
    and non-tensor arguments to those of the example. Keyword arguments are not
    traced (bind them with ``functools.partial``).

    A float8 policy (``"mixed_float8"``, any ``fmp.Float8Recipe`` with tensorwise or rowwise scaling)
    turns each ``linear``/``mm``/``addmm``/``matmul`` whose second operand is a 2-D parameter into a
    float8 matmul: e4m3 operands, the recipe's gradient format, current scaling, float32 accumulation,
    the result in the compute dtype (``output="float32"``: float32), as torchao's ``Float8Linear``
    computes it; other matmuls follow the compute dtype.

    Args:
      fn_or_module: A ``torch.nn.Module`` or a function of tensors.
      example_inputs: Tuple of positional arguments to trace with (only their
        shapes, dtypes and devices are used: tracing runs on fake tensors).
      policy: ``(device_type, dtype)``, a device type, an fmp ``Policy`` / spec
        string, or ``None`` with ``device_type=``/``dtype=``. Defaults to
        ``("cpu", torch.bfloat16)``. A ``Policy`` also sets the dtype of the floating outputs
        (float64 kept) to its output dtype (``"mixed_bfloat16"``: float32), as on the JAX side;
        its param dtype is where you keep parameters (nothing is cast to it).
      device_type: ``"cpu"`` or ``"cuda"``.
      dtype: ``torch.bfloat16`` or ``torch.float16``.
      rules: A custom ``fmp.RuleSet``; ``fmp.DEFAULT_RULES`` if None.
      overrides: ``{module_path_key: policy}``. ``"float32"`` runs every op whose module path
        (``"layers.0.self_attn"``, the path of ``model.get_submodule``) contains the key (never cut
        inside a number: ``"layers.1"`` is not ``"layers.10"``) as written: no
        autocast casts, its inputs returned to the dtypes they have without autocast (what
        `explain_fx` suggests for an op that loses precision). A ``"float32"`` key that names a source
        location (``"model.py:12"``) runs the ops of that line as written. Under a float8 policy, a policy without
        float8 and with the same compute dtype (``{"lm_head": "mixed_bfloat16"}``) opts modules out of
        float8: a matmul whose weight's module path (``lm_head`` for ``lm_head.weight``) contains a key
        runs in the compute dtype.
      float8_matmul: Under a float8 policy, the kernel of each float8 matmul: ``"auto"`` (the default)
        ``torch._scaled_mm`` where it runs that matmul on the device (CPU; CUDA sm89+), the emulation
        elsewhere; ``"scaled_mm"`` (torchao's ``emulate=False``; an error where it does not run) or
        ``"emulated"`` (torchao's ``emulate=True``). ``explain_fx`` rows show the choice. As in torchao,
        a rowwise ``_scaled_mm`` product passes through bfloat16 even for a float32 result.

    Returns:
      A ``torch.fx.GraphModule``.

    Raises:
      TypeError, ValueError: bad arguments or policy; an output torch's pytree
        cannot flatten, such as a Hugging Face ``DynamicCache`` (call the model
        with ``use_cache=False``, e.g. through ``functools.partial``).
      RuntimeError: the program reads a tensor's value to choose what to run
        (``if x.max() > 0:``); the message names the line and the ways out.
      NotImplementedError: a float8 recipe other than ``"tensorwise"`` or ``"rowwise"``; an
        ``overrides`` value that asks for more than opting a module out of float8.
      RuntimeError: ``float8_matmul="scaled_mm"`` where ``torch._scaled_mm`` does not run a matmul.

    Warns:
      UserWarning: a float8 opt-out key of ``overrides`` matches no float8 matmul's module path.

    Examples:
      >>> import torch
      >>> lin = torch.nn.Linear(4, 3)
      >>> gm = fmp.torch.autocast_fx(lin, (torch.ones(2, 4),), ("cpu", torch.bfloat16))
      >>> gm(torch.ones(2, 4)).dtype
      torch.bfloat16
      >>> gm.weight is lin.weight
      True
      >>> float8_lin = fmp.torch.autocast_fx(lin, (torch.ones(2, 4),), "mixed_float8")
      >>> [n.name for n in float8_lin.graph.nodes if n.op == "call_function" and "float8" in n.name]
      ['float8_linear']
      >>> seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))
      >>> fmp.torch.autocast_fx(seq, (torch.ones(2, 4),), "cpu", overrides={"1": "float32"})(torch.ones(2, 4)).dtype
      torch.float32
    """
    prep = prepare(fn_or_module, example_inputs, policy, device_type, dtype, rules, overrides, float8_matmul)
    new = rewrite(prep.graph, prep.policy, written=prep.written)
    if (output := output_dtype(prep.policy)) is not None:
        cast_outputs(new, output)
    return new
