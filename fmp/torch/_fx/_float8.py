"""Float8 matmuls in FX graphs: ``linear``/``mm``/``addmm``/``matmul`` against a parameter.

The pass runs on the traced graph before the cast pass: each matmul whose weight operand is a module
``Parameter`` (a ``get_attr`` node) becomes one call of ``float8_linear`` (``_scaled_mm``), with the
recipe's scaling, scale rounding, gradient format and output dtype, and the kernel chosen per matmul:
``torch._scaled_mm`` where it runs on the device (torchao's ``emulate=False``), the quantise-dequantise
emulation elsewhere (torchao's ``emulate=True``), or the one the caller names.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fmp._core import _scopes
from fmp._core._dtypes import BLOCK_FORMATS, E4M3
from fmp._float8._recipe import BLOCK_SCALINGS, Float8Recipe
from fmp.torch._fx._common import Event, ambient_autocast, float_names
from fmp.torch._fx._scaled_mm import KERNELS, block_linear, float8_linear, scaled_mm_error

SUPPORTED = ("tensorwise", "rowwise", *BLOCK_SCALINGS)
# the recipe fields the pass reads (block_size, history_len and margin only matter to other scalings)
_READ = {"scaling", "pow2_scales", "grad_dtype", "output", "block_size", "history_len", "margin", "emulate"}
_READ |= {"scale_rounding"}
FLOAT8 = "fmp_float8"  # meta key of a float8 matmul node: its recipe and the op it replaced
_aten = torch.ops.aten
_MATMULS = (_aten.linear.default, _aten.mm.default, _aten.addmm.default, _aten.matmul.default)

_MSG_SCALING = (
    "fmp.torch.autocast_fx runs float8 recipes with scaling {supported}; got Float8Recipe(scaling={got!r}). "
    "Use one of those, or run {got!r} on the JAX side (fmp.autocast(fn, policy))."
)


def check_recipe(recipe: Float8Recipe) -> Float8Recipe:
    """``recipe`` if the torch pass runs it; NotImplementedError naming the supported scalings otherwise."""
    if recipe.scaling not in SUPPORTED:
        raise NotImplementedError(_MSG_SCALING.format(supported=" or ".join(map(repr, SUPPORTED)), got=recipe.scaling))
    for field in dataclasses.fields(recipe):  # a recipe field this pass does not read must keep its default
        if field.name not in _READ and getattr(recipe, field.name) != field.default:
            raise NotImplementedError(
                f"fmp.torch.autocast_fx does not run Float8Recipe({field.name}="
                f"{getattr(recipe, field.name)!r}) yet; leave it at its default {field.default!r} on the torch side."
            )
    return recipe


def _param(node: Any, attrs: dict[str, Any]) -> bool:
    return (
        isinstance(node, torch.fx.Node)
        and node.op == "get_attr"
        and isinstance(attrs.get(node.target), torch.nn.Parameter)
    )


def _operands(node: torch.fx.Node, graph: torch.fx.Graph, attrs: dict[str, Any]) -> tuple | None:
    """``(x, w_t, bias)`` of a matmul against a 2-D parameter (the weight is its second operand), else None."""
    target, args = node.target, node.args
    if target is _aten.linear.default:
        x, w, bias = args[0], args[1], args[2] if len(args) > 2 else node.kwargs.get("bias")
        if not _param(w, attrs) or attrs[w.target].ndim != 2:
            return None
        with graph.inserting_before(node):
            w_t = graph.call_function(_aten.t.default, (w,))
        return x, w_t, bias
    x, w, bias = (args[1], args[2], args[0]) if target is _aten.addmm.default else (args[0], args[1], None)
    if node.kwargs or not _param(w, attrs) or attrs[w.target].ndim != 2:
        return None
    if target is _aten.addmm.default and attrs.get(getattr(bias, "target", None)) is None:
        return None  # an addmm whose added term is no parameter: not a biased linear layer
    return x, w, bias


_MSG_KERNEL = (
    "float8_matmul must be 'auto' (torch._scaled_mm where it runs, the emulation elsewhere), 'scaled_mm' "
    "(torchao's emulate=False) or 'emulated' (torchao's emulate=True); got {got!r}"
)
_MSG_NO_FLOAT8 = "float8_matmul={got!r} chooses the kernel of float8 matmuls, but policy {policy!r} runs none"
_MSG_NO_SCALED_MM = (
    "float8_matmul='scaled_mm': torch._scaled_mm does not run the {scaling} product {shape} on {device!r} "
    "here ({why}). Use float8_matmul='auto' (it falls back to the emulation, same scales and formats) or "
    "'emulated'."
)


def check_kernel(kernel: Any, recipe: Float8Recipe | None, policy: Any) -> str:
    """``kernel`` if it is a valid ``float8_matmul`` for ``policy``; ValueError naming the choices otherwise."""
    if kernel != "auto" and kernel not in KERNELS:
        raise ValueError(_MSG_KERNEL.format(got=kernel))
    if kernel != "auto" and recipe is None:
        raise ValueError(_MSG_NO_FLOAT8.format(got=kernel, policy=str(policy)))
    if recipe is None or recipe.emulate is None:
        return kernel
    chosen = "emulated" if recipe.emulate else "scaled_mm"  # the recipe's emulate, as on the JAX side
    if kernel not in ("auto", chosen):
        raise ValueError(
            f"autocast_fx(float8_matmul={kernel!r}) contradicts the policy's Float8Recipe(emulate={recipe.emulate}); "
            "set one of them (emulate=None leaves the choice to float8_matmul)"
        )
    return chosen


def _kernel(asked: str, device: str, scaling: str, mkn: tuple[int, int, int]) -> str:
    """The kernel of one float8 matmul ``[m, k] @ [k, n]``: `_MSG_KERNEL` says how ``asked`` chooses."""
    if asked == "emulated":
        return asked
    why = scaled_mm_error(device, scaling == "rowwise")
    if why is None and device == "cuda" and any(d % 16 for d in mkn):  # the CUDA kernels' alignment
        why = "CUDA needs m, k and n to be multiples of 16"
    if why is None or asked == "auto":
        return "emulated" if why else "scaled_mm"
    shape = f"[{mkn[0]}, {mkn[1]}] @ [{mkn[1]}, {mkn[2]}]"
    raise RuntimeError(_MSG_NO_SCALED_MM.format(scaling=scaling, shape=shape, device=device, why=why))


def rewrite_float8(
    gm: torch.fx.GraphModule,
    recipe: Float8Recipe,
    compute: torch.dtype,
    opt_out: Sequence[str] = (),
    kernel: str = "auto",
    device: str = "cpu",
) -> tuple[int, set[str]]:
    """Replaces, in place, each matmul against a parameter in ``gm`` by ``float8_linear``, except where the
    parameter's module path (``lm_head`` for ``lm_head.weight``) contains a key of ``opt_out``; ``kernel``
    is the ``float8_matmul`` choice, ``device`` the device type the matmuls run on.

    Returns how many it replaced and the ``opt_out`` keys that matched a matmul.
    """
    attrs = {n.target: _get(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    out = compute if recipe.output == "compute" else None
    count, used = 0, set()
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _MATMULS:
            continue
        x = node.args[1] if node.target is _aten.addmm.default else node.args[0]
        weight = node.args[2] if node.target is _aten.addmm.default else node.args[1]
        if not _param(weight, attrs) or getattr(getattr(x, "meta", {}).get("val"), "ndim", 0) < 1:
            continue
        keys = {k for k in opt_out if _scopes.matches(weight.target.rpartition(".")[0], k)}
        used |= keys
        ops = None if keys else _operands(node, gm.graph, attrs)
        if ops is None:
            continue
        xv, wv = ops[0].meta["val"], attrs[weight.target]
        n = wv.shape[0] if node.target is _aten.linear.default else wv.shape[1]
        if recipe.scaling in BLOCK_SCALINGS:  # emulated, through the JAX side's arithmetic
            chosen, fn = "emulated", block_linear
            args = (*ops, recipe.scaling, out, recipe.grad_dtype, recipe.scale_rounding)
        else:
            mkn = (xv.numel() // max(xv.shape[-1], 1), xv.shape[-1], n)
            chosen, fn = _kernel(kernel, device, recipe.scaling, mkn), float8_linear
            args = (*ops, recipe.scaling, recipe.pow2_scales, out, recipe.grad_dtype, chosen)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(fn, args)
        new.meta.update(node.meta)  # its val keeps the shape the next matmul reads; apply_float8 redoes dtypes
        new.meta[FLOAT8] = f"{recipe.scaling}, {chosen} ({node.target.name().split('.')[0]})"
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        count += 1
    gm.graph.lint()
    gm.recompile()
    return count, used


_MSG_UNUSED = (
    "autocast_fx(overrides=...): key {key!r} matches no module path of a float8 matmul's weight, so it changes "
    "nothing; keys are parts of parameter owner paths, never cut inside a number, such as 'lm_head' or 'layers.0.mlp'."
)


def apply_float8(
    gm: torch.fx.GraphModule,
    recipe: Float8Recipe,
    opt_out: Sequence[str],
    device_type: str,
    dtype: torch.dtype,
    mode: Any,
    quiet: Sequence[str] = (),
    kernel: str = "auto",
) -> None:
    """``rewrite_float8``, then every node's ``meta["val"]`` recomputed on fake tensors under autocast as the
    trace ran (a float8 result may be float32 where the trace saw the compute dtype), so that the cast pass
    sees the real dtypes; warns for each ``opt_out`` key that matched no matmul (``quiet`` ones aside: float32
    overrides, which run every op of their modules as written)."""
    count, used = rewrite_float8(gm, recipe, dtype, opt_out, kernel, device_type)
    if count:
        args = [mode.from_tensor(n.meta["val"]) for n in gm.graph.nodes if n.op == "placeholder"]
        with ambient_autocast({device_type: (True, dtype)}), mode:
            FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*args)
    for key in sorted(set(opt_out) - used - set(quiet)):
        warnings.warn(_MSG_UNUSED.format(key=key), UserWarning, stacklevel=3)


def float8_events(graph: torch.fx.Graph, events: list[Event]) -> list[Event]:
    """``events`` with a ``float8`` row for each float8 matmul of ``graph``, in graph order."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    rows = [
        Event("fmp::float8_linear", "float8", n, n, _ins(n), (_element(n),) * 2, (), n.meta[FLOAT8])
        for n in graph.nodes
        if FLOAT8 in n.meta
    ]
    if not rows:
        return events
    return sorted([*events, *rows], key=lambda ev: order.get(ev.node, -1))


def _element(node: torch.fx.Node) -> str:
    """The element dtype a float8 node quantises to (its scaling is the first word of its meta)."""
    scaling = node.meta[FLOAT8].split(",")[0]
    return BLOCK_FORMATS[scaling].element if scaling in BLOCK_FORMATS else E4M3


def _ins(node: torch.fx.Node) -> tuple[str, ...]:
    return float_names([a.meta.get("val") for a in node.args[:2] if isinstance(a, torch.fx.Node)])


def _get(obj: Any, target: str) -> Any:
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
