"""What ``autocast_fx`` and ``explain_fx`` share before they differ: the policy spellings normalized, the
overrides and float8 kernel checked, the program traced with its state bound and its float8 matmuls in place
(`prepare`), and the autocast rewrite of such a graph (`rewrite`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from fmp._core import _dtypes
from fmp._core._rules import DEFAULT_RULES, TORCH_DEVICES, RuleSet
from fmp._float8._recipe import Float8Recipe
from fmp._policy import Policy, get_policy
from fmp._resolved import ResolvedPolicy
from fmp.torch._fx._common import Event
from fmp.torch._fx._float8 import apply_float8, check_kernel, check_recipe
from fmp.torch._fx._rewrite import Rewriter
from fmp.torch._fx._trace import bind_state, check_meta, trace, warn_traced_moves
from fmp.torch._policy import torch_policy

_LOW = {"bfloat16": torch.bfloat16, "float16": torch.float16}
_DEFAULT_DTYPE = {"cpu": torch.bfloat16, "cuda": torch.float16}

_MSG_POLICY = (
    "policy must be a (device_type, dtype) pair such as ('cpu', torch.bfloat16), a torch device type "
    "('cpu' or 'cuda'), an fmp Policy or policy spec string ('mixed_bfloat16'), or None with "
    "device_type=/dtype= keywords; got {got!r}"
)


def fx_policy(policy: Policy | str, where: str, float8: bool) -> Policy:
    """`torch_policy` with the float8 recipe, if any, checked runnable by the FX float8 pass.

    Raises:
      NotImplementedError: a recipe the FX float8 pass does not run (blockwise, delayed, mx).
    """
    pol = torch_policy(policy, where, float8)
    if pol.float8 is not None:
        check_recipe(pol.float8)
    return pol


def resolve_policy(
    policy: Any = None,
    device_type: str | None = None,
    dtype: Any = None,
    rules: RuleSet | None = None,
    float8: bool = False,
) -> ResolvedPolicy:
    """The accepted policy spellings, worked out once: the device type, the low-precision dtype, the rules,
    and for an fmp ``Policy`` or spec its float8 recipe (checked runnable by the FX pass) and output dtype.
    ``float8``: the caller runs float8 matmuls (else a policy with a recipe is refused)."""
    pol = None
    if rules is None:
        rules = DEFAULT_RULES
    elif not isinstance(rules, RuleSet):
        raise TypeError(
            f"rules must be an fmp.RuleSet (e.g. fmp.DEFAULT_RULES.derive(...)), got {type(rules).__name__}"
        )
    if isinstance(policy, tuple) and len(policy) == 2:
        if device_type is not None or dtype is not None:
            raise ValueError("policy=(device_type, dtype) and the device_type=/dtype= keywords are exclusive")
        device_type, dtype = policy
    elif isinstance(policy, str) and policy in TORCH_DEVICES:
        if device_type is not None:
            raise ValueError(f"policy={policy!r} names the device already; drop device_type={device_type!r}")
        device_type = policy
    elif isinstance(policy, Policy | str):
        try:
            pol = fx_policy(policy, "autocast_graph or explain_fx", float8)
        except ValueError as err:
            raise ValueError(f"{_MSG_POLICY.format(got=policy)}. {err}") from None
        if dtype is not None:
            raise ValueError("an fmp Policy fixes the compute dtype; drop the dtype= keyword")
        dtype = pol.compute_dtype.name
    elif policy is not None:
        raise TypeError(_MSG_POLICY.format(got=policy))
    device_type = "cpu" if device_type is None else device_type
    if not isinstance(device_type, str) or device_type not in TORCH_DEVICES:
        raise ValueError(f"device_type must be one of {TORCH_DEVICES}, got {device_type!r}")
    if dtype is None:
        dtype = _DEFAULT_DTYPE[device_type]
    name = _dtypes.canonical_name(dtype) if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in _LOW:
        raise ValueError(
            f"the autocast dtype must be torch.bfloat16 or torch.float16 (torch autocast supports no other), "
            f"got {dtype!r}"
        )
    if pol is None:
        return ResolvedPolicy(name, None, rules, device_type=device_type, label=str(policy))
    return ResolvedPolicy.of(pol, rules, device_type=device_type, label=str(policy))


def low_dtype(policy: ResolvedPolicy) -> torch.dtype:
    """The torch dtype autocast lowers to under ``policy``."""
    return _LOW[policy.compute]


def output_dtype(policy: ResolvedPolicy) -> torch.dtype | None:
    """The torch dtype floating outputs come back in (an fmp policy's: ``"mixed_bfloat16"``, float32), or
    None for torch's own spellings (``("cpu", torch.bfloat16)``, ``"cpu"``), which leave outputs as torch's
    autocast does."""
    return None if policy.output is None else getattr(torch, policy.output)


_MSG_OVERRIDES = (
    "autocast_fx(overrides=...) takes {{module_path_key: policy}}: 'float32' runs the module's ops as "
    "written, in float32 (e.g. {{'attn': 'float32'}}); under a float8 policy, a policy without float8 and the same "
    "compute dtype opts modules out of float8 (e.g. {{'lm_head': 'mixed_bfloat16'}}); got {key!r}: "
    "{value!r} under {policy!r}. {why}"
)


def check_overrides(overrides: Any, policy: ResolvedPolicy) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The module-path keys of ``overrides``: those opting modules out of float8 matmuls, those running
    modules as written in float32 (checked; a float32 module runs no float8 matmul either)."""
    if overrides is None:
        return (), ()
    if not isinstance(overrides, Mapping):
        raise TypeError(f"overrides must be a dict {{module_path_key: policy}}, got {type(overrides).__name__}")
    opt_out, written = [], []
    for key, value in overrides.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"overrides keys must be non-empty module path strings ('lm_head'), got {key!r}")
        pol = get_policy(value)
        if pol.float8 is None and pol.compute_dtype.name == "float32":
            written.append(key)
            continue
        why = ""
        if policy.recipe is None:
            why = "The policy runs no float8 matmul, so there is nothing to opt out of."
        elif pol.float8 is not None:
            why = "A different float8 recipe per module is not supported on the torch side."
        elif pol.compute_dtype.name != policy.compute:
            why = "Per-module compute dtypes other than float32 are not supported on the torch side."
        if why:
            raise NotImplementedError(_MSG_OVERRIDES.format(key=key, value=str(value), policy=policy.label, why=why))
        opt_out.append(key)
    return tuple(opt_out), tuple(written)


def cast_outputs(gm: torch.fx.GraphModule, to: torch.dtype) -> None:
    """Casts each floating output of ``gm`` other than float64 to ``to``, as ``fmp.torch.autocast(policy=...)``
    does to a decorated function's outputs."""
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    single = not isinstance(out.args[0], list | tuple)
    flat = [out.args[0]] if single else list(out.args[0])
    for i, node in enumerate(flat):
        now = getattr(node.meta.get("val"), "dtype", None) if isinstance(node, torch.fx.Node) else None
        if now is None or not now.is_floating_point or now in (torch.float64, to):
            continue
        with gm.graph.inserting_before(out):
            cast = gm.graph.call_function(torch.ops.aten._to_copy.default, (node,), {"dtype": to})
        cast.meta["val"] = node.meta["val"].to(to)
        flat[i] = cast
    out.args = (flat[0] if single else type(out.args[0])(flat), *out.args[1:])
    gm.recompile()


def _attrs(gm: torch.nn.Module) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "call_module"):
            obj: Any = gm
            for part in node.target.split("."):
                obj = getattr(obj, part)
            out[node.target] = obj
    return out


def fake_mode_of(graph: torch.fx.Graph) -> FakeTensorMode:
    vals = [n.meta["val"] for n in graph.nodes if "val" in n.meta]
    try:
        mode = detect_fake_mode(pytree.tree_leaves(vals))
    except AssertionError:  # values from several modes (a real-mode trace): use a fresh one
        mode = None
    return mode if mode is not None else FakeTensorMode(allow_non_fake_inputs=True)


def rewrite(
    graph_module: torch.fx.GraphModule,
    policy: ResolvedPolicy,
    events: list[Event] | None = None,
    written: tuple[str, ...] = (),
    env: dict[torch.fx.Node, Any] | None = None,
) -> torch.fx.GraphModule:
    """The transform behind `autocast_graph` (policy already resolved; the outputs as computed: the caller
    casts them, `cast_outputs`, where the policy has an output dtype).

    ``written``: module path keys whose ops run as written (float32 overrides); ``env``, when
    given, receives each node of ``graph_module`` mapped to what stands for its value in the new graph.
    """
    check_meta(graph_module.graph)
    attrs = _attrs(graph_module)
    state = {policy.device_type: (True, low_dtype(policy))}
    rw = Rewriter(policy.rules, state, fake_mode_of(graph_module.graph), attrs, events, written)
    out = rw.run(graph_module.graph, {} if env is None else env)
    rw.graph.output(out)
    rw.graph._codegen = graph_module.graph._codegen
    for node in list(rw.graph.nodes):  # submodules of inlined wrap_with_autocast regions
        if node.op == "get_attr" and not node.users and isinstance(rw.attrs.get(node.target), torch.nn.Module):
            rw.graph.erase_node(node)
    rw.graph.lint()
    used = {n.target for n in rw.graph.nodes if n.op in ("get_attr", "call_module")}
    new = torch.fx.GraphModule({k: v for k, v in rw.attrs.items() if k in used}, rw.graph)
    new.meta.update(getattr(graph_module, "meta", {}))
    warn_traced_moves(rw.traced_moves)
    return new


@dataclass(frozen=True)
class Prepared:
    """A program traced for the FX passes, before the autocast rewrite.

    ``graph``: the traced graph over the module's own state, float8 matmuls in place under a float8
    policy; ``module``: the traced module (None for a function); ``policy``: the call's policy, resolved;
    ``written``: module path keys run as written.
    """

    graph: torch.fx.GraphModule
    module: torch.nn.Module | None
    policy: ResolvedPolicy
    written: tuple[str, ...]


def prepare(
    fn_or_module: Callable | torch.nn.Module,
    example_inputs: Sequence[Any],
    policy: Any,
    device_type: str | None,
    dtype: Any,
    rules: RuleSet | None,
    overrides: Mapping[str, Any] | None,
    float8_matmul: str,
    check: Callable[[Float8Recipe | None], None] | None = None,
) -> Prepared:
    """The set-up both ``autocast_fx`` and ``explain_fx`` run: policy, float8 recipe, overrides, kernel,
    trace, state, float8 matmuls. ``check(recipe)`` runs the caller's own argument checks once the recipe
    is known, before anything is traced."""
    resolved = resolve_policy(policy, device_type, dtype, rules, float8=True)
    recipe, device, low = resolved.recipe, str(resolved.device_type), low_dtype(resolved)
    opt_out, written = check_overrides(overrides, resolved)
    if check is not None:
        check(recipe)
    kernel = check_kernel(float8_matmul, recipe, resolved.label)
    gm, names, codegen = trace(fn_or_module, example_inputs, device, low)
    module = fn_or_module if isinstance(fn_or_module, torch.nn.Module) else None
    bound = bind_state(gm, module, names, codegen)
    if recipe is not None:
        mode = fake_mode_of(bound.graph)
        apply_float8(bound, recipe, (*opt_out, *written), device, low, mode, written, kernel)
    return Prepared(bound, module, resolved, written)
