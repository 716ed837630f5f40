"""The autocast rewrite of a pre-dispatch ATen FX graph: explicit casts in place of autocast state.

Each ``call_function`` node whose target is an ATen ``OpOverload`` is keyed the way
torch's autocast dispatch keys are (``aten::<name>[.<overload>]``) and looked up in
a `RuleSet` for the device its tensors live on. Listed ops get
``aten._to_copy.default(x, dtype=...)`` nodes on their eligible inputs (floating,
not float64, on that device), decided by ``fmp._core._rules.decide``.
Unlisted ``CompositeImplicitAutograd`` ops are decomposed one level and rewritten
recursively when their decomposition reaches a listed op, because that is how
eager autocast treats them (``einsum``, ``tensordot`` on CPU). Traced
``_enter_autocast``/``_exit_autocast`` regions and ``wrap_with_autocast``
submodules switch the per-device state for the ops inside them.

Beside this module: ``_values`` builds the new graph and its fake values (and the explain
report's values without autocast), ``_casts`` decides which uses share a cast (torch's cast cache),
and ``_nested`` holds decompositions, higher-order ops and one-op autocast regions.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from fmp._core import _scopes
from fmp._core._rules import OVERRIDE, Category, RuleSet, decide, moved
from fmp.torch._fx._casts import CastCache
from fmp.torch._fx._common import (
    ASSERT_META,
    CIA,
    MAX_DEPTH,
    MSG_OPAQUE,
    RUN,
    TO_COPY,
    Event,
    cuda_variant_call,
    device_of,
    dtype_name,
    float_names,
    is_eligible,
    is_tensor,
    module_path,
    node_source,
    op_key,
    prioritize,
    same_meta,
)
from fmp.torch._fx._nested import ENTER_AUTOCAST, EXIT_AUTOCAST, UNTRACEABLE, decompose, hop, in_region
from fmp.torch._fx._trace import is_traced_move
from fmp.torch._fx._values import GraphBuilder, inputs_before, plain


class Rewriter(GraphBuilder):
    """Rewrites one graph (and the graphs nested in it) into ``self.graph``.

    ``state`` maps a device type to ``(enabled, dtype)``, the autocast state an op
    on that device sees; traced autocast regions change it while they are open.
    """

    def __init__(
        self,
        rules: RuleSet,
        state: dict[str, tuple[bool, torch.dtype]],
        fake_mode: FakeTensorMode,
        attrs: dict[str, Any],
        events: list[Event] | None = None,
        written: tuple[str, ...] = (),
    ) -> None:
        super().__init__(fake_mode, attrs)
        self.rules = rules
        self.written = written  # module path keys whose ops run as written (float32 overrides)
        self.state = dict(state)
        self.events = events
        self._casts = CastCache(attrs)  # shared casts (torch's cast cache)
        self.probe_cache: dict[Any, bool] = {}  # decompositions known to change nothing (see _nested)
        self._region_saved: dict[torch.fx.Node, dict[str, tuple[bool, torch.dtype]]] = {}
        self.before: dict[torch.fx.Node, Any] = {}  # node -> value with autocast off (explain only, _values.plain)
        self.changed = False
        self.traced_moves: list[tuple[torch.fx.Node, torch.dtype]] = []  # device moves recorded as casts

    def _cast(
        self, src: torch.fx.Node, dtype: torch.dtype, like: torch.fx.Node | None, compute: torch.dtype | None
    ) -> torch.fx.Node:
        """A cast of ``src`` to ``dtype`` for one use: shared only where torch's cast cache would share it."""
        key = self._casts.key(src, self.vals.get(src), dtype, compute)
        self.changed = True
        shared = self._casts.get(key, dtype) if key is not None else None
        if shared is not None:
            return shared
        short = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}.get(dtype, "cast")
        node = self.emit(TO_COPY, (src,), {"dtype": dtype}, like, name=f"{src.name}_{short}")
        if key is not None:
            self._casts.put(key, dtype, node)
        if self.events is not None:
            before = float_names(self.vals[src])
            self.events.append(Event("aten::_to_copy", "cast", node, like, before, (dtype_name(dtype),), before))
        return node

    # ---- the graph walk -----------------------------------------------------------------------
    def run(self, graph: torch.fx.Graph, env: dict[torch.fx.Node, Any], depth: int = 0, owner: Any = None) -> Any:
        """Emits ``graph`` into ``self.graph``; placeholders already in ``env`` are inlined.

        ``owner`` is the module whose attributes the graph's get_attr nodes name,
        when the graph is a submodule being inlined. Returns the new-graph value of
        the graph's output.
        """
        for node in graph.nodes:
            if node.op == "placeholder":
                if node not in env:
                    new = self.graph.placeholder(node.target, type_expr=node.type)
                    new.meta.update(node.meta)
                    self._set_val(new, node)
                    env[node] = new
            elif node.op == "get_attr":
                target = node.target
                if owner is not None:  # an inlined submodule's attribute gets a root-level name
                    obj = owner
                    for part in target.split("."):
                        obj = getattr(obj, part)
                    target = self.fresh_attr(target.replace(".", "_"))
                    self.attrs[target] = obj
                new = self.graph.get_attr(target)
                new.meta.update(node.meta)
                obj = self.attrs.get(target)
                if "val" in node.meta:
                    self.vals[new] = self.fake(node.meta["val"])
                elif isinstance(obj, torch.Tensor):
                    self.vals[new] = self.fake(obj)
                env[node] = new
            elif node.op == "output":
                return torch.fx.node.map_arg(node.args[0], lambda n: env[n])
            elif node.op == "call_function":
                env[node] = self._call(node, env, depth)
            else:  # call_module / call_method (export's _guards_fn): kept as opaque calls
                env[node] = self._opaque(node, env)
        return None

    def _opaque(self, node: torch.fx.Node, env: dict) -> torch.fx.Node:
        changed = any(not same_meta(a.meta.get("val"), self.vals.get(env[a])) for a in node.all_input_nodes)
        if changed:
            raise NotImplementedError(MSG_OPAQUE.format(node=node.name, op=node.op))
        new = self.graph.node_copy(node, lambda n: env[n])
        if "val" in node.meta:
            self.vals[new] = self.fake(node.meta["val"])
        return new

    def _set_val(self, new: torch.fx.Node, old: torch.fx.Node) -> None:
        if "val" in old.meta:
            self.vals[new] = self.fake(old.meta["val"])

    def _call(self, node: torch.fx.Node, env: dict, depth: int) -> Any:
        target = node.target
        if target is operator.getitem and isinstance(env[node.args[0]], list | tuple):
            return env[node.args[0]][node.args[1]]  # an inlined multi-output region
        if isinstance(target, torch._ops.OpOverload) and self.as_written(node):
            args = torch.fx.node.map_arg(node.args, lambda n: self._restored(n, env[n], node))
            kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: self._restored(n, env[n], node))
        else:
            args = torch.fx.node.map_arg(node.args, lambda n: env[n])
            kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n])
        if target is ENTER_AUTOCAST:
            device, dtype, enabled = args[0], args[1], args[2]
            self._region_saved[node] = dict(self.state)
            self.state[device] = (bool(enabled), dtype if dtype is not None else torch.get_autocast_dtype(device))
            self.changed = True
            return None  # the region's casts are explicit now
        if target is EXIT_AUTOCAST:
            enter = node.args[0]
            if isinstance(enter, torch.fx.Node) and enter in self._region_saved:
                self.state = self._region_saved.pop(enter)
            return None
        if isinstance(target, torch._ops.HigherOrderOperator):
            return hop(self, node, args, kwargs, depth)
        if target is torch._C._set_grad_enabled:
            self._casts.clear()
        if target is ASSERT_META and "dtype" in kwargs and isinstance(args[0], torch.fx.Node):
            # export's dtype assertions describe the program before the rewrite
            kwargs = {**kwargs, "dtype": self.vals[args[0]].dtype}
            return self.emit(target, args, kwargs, node, val=None)
        if isinstance(target, torch._ops.OpOverload):
            return self._op(node, target, args, kwargs, depth)
        return self._copy(node, args, kwargs)

    def as_written(self, node: torch.fx.Node) -> bool:
        """Whether a float32 override runs ``node`` as written: its module path contains a key, or its source
        line is a source-location key's (``"model.py:12"``)."""
        path = module_path(node)
        for key in self.written:
            if (
                _scopes.matches_location(node_source(node), key)
                if _scopes.is_location(key)
                else _scopes.matches(path, key)
            ):
                return True
        return False

    def _restored(self, old: torch.fx.Node, new: Any, like: torch.fx.Node) -> Any:
        """``new`` cast back to the floating dtype ``old`` has as written, for an op run as written."""
        val, before = self.vals.get(new), plain(self, old)
        if not (isinstance(new, torch.fx.Node) and is_tensor(val) and is_tensor(before)):
            return new
        if val.dtype == before.dtype or not (val.dtype.is_floating_point and before.dtype.is_floating_point):
            return new
        return self._cast(new, before.dtype, like, None)

    def _copy(self, node: torch.fx.Node, args: tuple, kwargs: dict, recorded_ok: bool = True) -> torch.fx.Node:
        """Re-emits a node unchanged; its value is recomputed if an input's dtype changed or ``recorded_ok``
        is False.

        The trace ran under autocast, so a recorded value is the one autocast gave the op: it is the
        op's value in the new graph only where the op still runs under the traced autocast state. An
        op run as written (a float32 override) yields what its inputs give it with autocast off,
        which the casts of the ops that consume it must see.
        """
        old_vals = [a.meta.get("val") for a in node.all_input_nodes]
        new_inputs = []
        torch.fx.node.map_arg((args, kwargs), lambda n: new_inputs.append(n))
        same = len(old_vals) == len(new_inputs) and all(
            same_meta(o, self.vals.get(n)) for o, n in zip(old_vals, new_inputs, strict=True)
        )
        val = self.fake(node.meta.get("val")) if same and recorded_ok else RUN
        new = self.emit(node.target, args, kwargs, node, val=val)
        new.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")})
        return new

    # ---- ATen ops ------------------------------------------------------------------------------
    def _op(self, node: torch.fx.Node, op: torch._ops.OpOverload, args: tuple, kwargs: dict, depth: int):
        key = op_key(op)
        leaves = [v for v in pytree.tree_leaves(self.value_of((args, kwargs))) if is_tensor(v)]
        device = device_of(leaves)
        enabled, compute = self.state.get(device, (False, None)) if device else (False, None)
        written = bool(self.written) and self.as_written(node)
        enabled = enabled and not written
        category = self.rules.category(key, "torch", device) if enabled and device in ("cpu", "cuda") else None
        if category is Category.BANNED:
            raise RuntimeError(self.rules.banned_message(key))
        if category in (Category.LOWER_PRECISION, Category.FLOAT32, Category.PROMOTE):
            return self._listed(node, op, key, category, device, compute, args, kwargs)
        if is_traced_move(node, args, self.vals):
            self.traced_moves.append((node, self.vals[args[0]].dtype))
        inlined = None
        if enabled and op.has_kernel_for_dispatch_key(CIA) and depth < MAX_DEPTH:
            inlined = decompose(self, node, op, args, kwargs, depth)
            if inlined is not None and inlined is not UNTRACEABLE:
                return inlined
        # autocast reaches inside the op's kernel or its untraceable decomposition: keep it in a region
        inside = enabled and (inlined is UNTRACEABLE or device == "cpu" and key in self.rules.torch_cpu_autocast_inside)
        if inside:
            new = in_region(self, node, op, device, compute, args, kwargs)
        else:
            new = self._copy(node, args, kwargs, recorded_ok=not written)
        self._casts.invalidate(op, args, kwargs)
        if self.events is not None:
            ins = float_names(self.value_of((args, kwargs)))
            cat = "user_cast" if key == "aten::_to_copy" or key.startswith("aten::to.") else Category.UNLISTED.value
            listed = device in ("cpu", "cuda") and cat != "user_cast"  # a rule-table op, not the program's cast
            detail = moved(self.rules, key, "torch", device) if enabled and listed else ""
            if written and cat != "user_cast":
                rule = self.rules.category(key, "torch", device).value if listed else cat
                detail = f"float32 by overrides, rule {rule}"
            cat = f"{cat} (autocast inside)" if inside else OVERRIDE if detail else cat
            before = inputs_before(self, node)
            self.events.append(Event(key, cat, new, node, before, ins, float_names(plain(self, node)), detail))
        return new

    def _listed(self, node, op, key, category, device, compute, args, kwargs):
        vals = self.value_of((args, kwargs))
        eligible = [v.dtype for v in pytree.tree_leaves(vals) if is_eligible(v, device)]
        variant = self.rules.torch_cuda_variants.get(key) if device == "cuda" else None
        target_op = op
        if variant is not None and category is Category.FLOAT32:
            first = vals[0][0] if vals[0] else None
            target_op, args, kwargs, changed = cuda_variant_call(variant, op, args, kwargs, first, device)
            self.changed |= changed
            target = None
        else:
            if category is Category.PROMOTE:
                prioritize(key, compute, eligible)
            name = decide(category, dtype_name(compute), [dtype_name(d) for d in eligible])
            target = getattr(torch, name) if name is not None else None
        if target is not None:

            def cast(n: torch.fx.Node) -> torch.fx.Node:
                v = self.vals.get(n)
                return self._cast(n, target, node, compute) if is_eligible(v, device) and v.dtype != target else n

            args = torch.fx.node.map_arg(args, cast)
            kwargs = torch.fx.node.map_arg(kwargs, cast)
        try:
            new = self.emit(target_op, args, kwargs, node)
        except (RuntimeError, NotImplementedError):
            if target is None:
                raise
            # no fake kernel: the op ran in `target`, so its floating outputs are `target`
            new = self.emit(target_op, args, kwargs, node, val=self.retype(node.meta.get("val"), target))
        new.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")})
        self._casts.invalidate(target_op, args, kwargs)
        if self.events is not None:
            rule = category.value if variant is None else f"{category.value} ({variant})"
            detail = moved(self.rules, key, "torch", device)
            ins = float_names(self.value_of((args, kwargs)))
            self.events.append(
                Event(
                    key,
                    OVERRIDE if detail else rule,
                    new,
                    node,
                    inputs_before(self, node),
                    ins,
                    float_names(plain(self, node)),
                    detail,
                )
            )
        return new
