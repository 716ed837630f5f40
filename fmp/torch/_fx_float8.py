"""Float8 matmuls in FX graphs: ``linear``/``mm``/``addmm``/``matmul`` against a parameter, emulated.

The pass runs on the traced graph before the cast pass: each matmul whose weight operand is a module
``Parameter`` (a ``get_attr`` node) becomes one call of ``float8_linear``, an autograd function that
quantises both operands to ``float8_e4m3fn`` with current scaling (one scale per tensor, or per row of
the input and per output row of the weight), multiplies the dequantised values in float32, and in the
backward quantises the output gradient to the recipe's ``grad_dtype`` the same way. This is the arithmetic of
torchao's ``Float8Linear`` in ``emulate=True`` mode (scale from the amax in float64, saturating cast,
dequantisation by division), with fmp's scale rules from the same recipe as the JAX side: a zero amax
gives scale 1, scales are clamped to normal float32 numbers, an inf or NaN makes its scaling group NaN.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fmp._fp8._quant import _SCALE_MAX, _SCALE_MIN, E4M3, E5M2
from fmp._fp8._recipe import Float8Recipe
from fmp.torch._fx_common import Event, _float_names, ambient_autocast

SUPPORTED = ("tensorwise", "rowwise")
# the recipe fields the pass reads (block_size, history_len and margin only matter to other scalings)
_READ = {"scaling", "pow2_scales", "grad_dtype", "output", "block_size", "history_len", "margin"}
FLOAT8 = "fmp_float8"  # meta key of a float8 matmul node: its recipe and the op it replaced
_aten = torch.ops.aten
_MATMULS = (_aten.linear.default, _aten.mm.default, _aten.addmm.default, _aten.matmul.default)
_FWD = getattr(torch, E4M3.name)
_E4M3_NAME = E4M3.name

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


def _scale(amax: torch.Tensor, dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    """``fp8_max / amax`` (float64 division, float32 result), 1 at zero, clamped, NaN at inf/NaN amax."""
    ok = (amax > 0) & torch.isfinite(amax)
    top = torch.finfo(dtype).max
    scale = torch.where(ok, top / torch.where(ok, amax, 1).to(torch.float64), 1.0).to(torch.float32)
    scale = scale.clamp(_SCALE_MIN, _SCALE_MAX)
    if pow2:  # 2**floor(log2(scale)) exactly: clear the mantissa bits of a normal float32
        scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)
    return torch.where(torch.isfinite(amax), scale, torch.nan)


def qdq(x: torch.Tensor, dtype: torch.dtype, dim: int | None, pow2: bool) -> torch.Tensor:
    """Quantise-dequantise ``x`` (float32 result): one scale per tensor (``dim=None``) or per slice along
    ``dim`` (the amax runs over ``dim``)."""
    x = x.to(torch.float32)
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    scale = _scale(amax, dtype, pow2)
    top = torch.finfo(dtype).max
    return (x * scale).clamp(-top, top).to(dtype).to(torch.float32) / scale


class _Float8MM(torch.autograd.Function):
    """``x[m, k] @ w_t[k, n]`` with float8-quantised operands, accumulated in float32 and returned in ``out``;
    the gradient products come out in the output gradient's dtype, as a scaled mm's ``out_dtype``."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, w_t: torch.Tensor, rowwise: bool, pow2: bool, grad: torch.dtype, out: torch.dtype
    ) -> torch.Tensor:
        ctx.save_for_backward(x, w_t)
        ctx.rowwise, ctx.pow2, ctx.grad_dtype = rowwise, pow2, grad
        with torch.autocast(x.device.type, enabled=False):  # float32 products under any ambient autocast
            y = torch.mm(qdq(x, _FWD, -1 if rowwise else None, pow2), qdq(w_t, _FWD, 0 if rowwise else None, pow2))
        return y.to(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, w_t = ctx.saved_tensors
        rowwise, pow2 = ctx.rowwise, ctx.pow2
        with torch.autocast(grad.device.type, enabled=False):
            g_dx = qdq(grad, ctx.grad_dtype, -1 if rowwise else None, pow2)
            dx = torch.mm(g_dx, qdq(w_t, _FWD, -1 if rowwise else None, pow2).t())
            g_dw = qdq(grad, ctx.grad_dtype, 0 if rowwise else None, pow2)
            dw_t = torch.mm(g_dw.t(), qdq(x, _FWD, 0 if rowwise else None, pow2)).t()
        # each gradient product comes out in the output gradient's dtype (a scaled mm's out_dtype), as torchao's
        return dx.to(grad.dtype).to(x.dtype), dw_t.to(grad.dtype).to(w_t.dtype), None, None, None, None


def float8_linear(
    x: torch.Tensor,
    w_t: torch.Tensor,
    bias: torch.Tensor | None,
    scaling: str,
    pow2: bool,
    out: torch.dtype | None,
    grad: str = E5M2.name,
) -> torch.Tensor:
    """``x @ w_t (+ bias)`` as a float8 matmul; ``w_t[k, n]`` is the weight, ``out`` the result dtype
    (None: float32), ``bias`` added in that dtype, ``grad`` the output gradient's float8 format."""
    shape = x.shape
    out = torch.float32 if out is None else out
    y = _Float8MM.apply(x.reshape(-1, shape[-1]), w_t, scaling == "rowwise", pow2, getattr(torch, grad), out)
    y = y.reshape(*shape[:-1], y.shape[-1])
    return y if bias is None else y + bias.to(y.dtype)


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


def rewrite_float8(
    gm: torch.fx.GraphModule, recipe: Float8Recipe, compute: torch.dtype, opt_out: Sequence[str] = ()
) -> tuple[int, set[str]]:
    """Replaces, in place, each matmul against a parameter in ``gm`` by ``float8_linear``, except where the
    parameter's module path (``lm_head`` for ``lm_head.weight``) contains a key of ``opt_out``.

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
        keys = {k for k in opt_out if k in weight.target.rpartition(".")[0]}
        used |= keys
        ops = None if keys else _operands(node, gm.graph, attrs)
        if ops is None:
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(float8_linear, (*ops, recipe.scaling, recipe.pow2_scales, out, recipe.grad_dtype))
        new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        new.meta[FLOAT8] = f"{recipe.scaling} ({node.target.name().split('.')[0]})"
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        count += 1
    gm.graph.lint()
    gm.recompile()
    return count, used


_MSG_UNUSED = (
    "autocast_fx(overrides=...): key {key!r} matches no module path of a float8 matmul's weight, so it changes "
    "nothing; keys are substrings of parameter owner paths such as 'lm_head' or 'layers.0.mlp'."
)


def apply_float8(
    gm: torch.fx.GraphModule,
    recipe: Float8Recipe,
    opt_out: Sequence[str],
    device_type: str,
    dtype: torch.dtype,
    mode: Any,
) -> None:
    """``rewrite_float8``, then every node's ``meta["val"]`` recomputed on fake tensors under autocast as the
    trace ran (a float8 result may be float32 where the trace saw the compute dtype), so that the cast pass
    sees the real dtypes; warns for each ``opt_out`` key that matched no matmul."""
    count, used = rewrite_float8(gm, recipe, dtype, opt_out)
    if count:
        args = [mode.from_tensor(n.meta["val"]) for n in gm.graph.nodes if n.op == "placeholder"]
        with ambient_autocast({device_type: (True, dtype)}), mode:
            FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*args)
    for key in sorted(set(opt_out) - used):
        warnings.warn(_MSG_UNUSED.format(key=key), UserWarning, stacklevel=3)


def float8_events(graph: torch.fx.Graph, events: list[Event]) -> list[Event]:
    """``events`` with a ``float8`` row for each float8 matmul of ``graph``, in graph order."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    rows = [
        Event("fmp::float8_linear", "float8", n, n, _ins(n), (_E4M3_NAME, _E4M3_NAME), (), n.meta[FLOAT8])
        for n in graph.nodes
        if FLOAT8 in n.meta
    ]
    if not rows:
        return events
    return sorted([*events, *rows], key=lambda ev: order.get(ev.node, -1))


def _ins(node: torch.fx.Node) -> tuple[str, ...]:
    return _float_names([a.meta.get("val") for a in node.args[:2] if isinstance(a, torch.fx.Node)])


def _get(obj: Any, target: str) -> Any:
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
