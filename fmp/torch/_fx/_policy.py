"""The policy spellings ``autocast_fx``, ``autocast_graph`` and ``explain_fx`` accept, normalized."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fmp._core import _dtypes
from fmp._core._rules import DEFAULT_RULES, TORCH_DEVICES, RuleSet
from fmp._float8._recipe import Float8Recipe
from fmp._policy import Policy, get_policy
from fmp.torch._fx._float8 import check_recipe

_LOW = {"bfloat16": torch.bfloat16, "float16": torch.float16}
_DEFAULT_DTYPE = {"cpu": torch.bfloat16, "cuda": torch.float16}

_MSG_POLICY = (
    "policy must be a (device_type, dtype) pair such as ('cpu', torch.bfloat16), a torch device type "
    "('cpu' or 'cuda'), an fmp Policy or policy spec string ('mixed_bfloat16'), or None with "
    "device_type=/dtype= keywords; got {got!r}"
)


_MSG_FLOAT8 = (
    "policy {got!r} asks for float8 matmuls (fp8={fp8}), which {where} does not run: it would quietly "
    "compute in {compute} instead. Use fmp.torch.autocast_fx(model, inputs, {got!r}) (tensorwise and rowwise "
    "recipes), a policy without fp8 here (e.g. 'mixed_bfloat16'), or float8 on the JAX side "
    "(fmp.autocast(fn, 'mixed_float8'))."
)


def torch_policy(policy: Policy | str, where: str = "fmp.torch.autocast (eager)", float8: bool = False) -> Policy:
    """``get_policy(policy)``; a float8 policy only with ``float8`` (and a recipe the FX pass runs).

    Raises:
      NotImplementedError: the policy carries an fp8 recipe and ``where`` runs none, or a recipe
        the FX float8 pass does not run (blockwise, delayed, mx).
    """
    pol = get_policy(policy)
    if pol.fp8 is not None:
        if not float8:
            raise NotImplementedError(
                _MSG_FLOAT8.format(got=str(policy), fp8=pol.fp8, compute=pol.compute_dtype.name, where=where)
            )
        check_recipe(pol.fp8)
    return pol


def float8_recipe(policy: Any) -> Float8Recipe | None:
    """The float8 recipe of an fmp ``Policy`` or spec (checked runnable by the FX pass), or None."""
    if isinstance(policy, Policy | str) and not (isinstance(policy, str) and policy in TORCH_DEVICES):
        return torch_policy(policy, float8=True).fp8
    return None


def resolve_policy(
    policy: Any = None,
    device_type: str | None = None,
    dtype: Any = None,
    rules: RuleSet | None = None,
    float8: bool = False,
) -> tuple[str, torch.dtype, RuleSet]:
    """Normalizes the accepted policy spellings to ``(device_type, low-precision dtype, rules)``."""
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
            pol = torch_policy(policy, "autocast_graph or explain_fx", float8)
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
    return device_type, _LOW[name], rules


_MSG_OVERRIDES = (
    "autocast_fx(overrides=...) takes {{module_path_key: policy}}: 'float32' runs the module's ops as "
    "written, in float32 (e.g. {{'attn': 'float32'}}); under a float8 policy, a policy without fp8 and the same "
    "compute dtype opts modules out of float8 (e.g. {{'lm_head': 'mixed_bfloat16'}}); got {key!r}: "
    "{value!r} under {policy!r}. {why}"
)


def check_overrides(
    overrides: Any, policy: Any, recipe: Float8Recipe | None, compute: torch.dtype
) -> tuple[tuple[str, ...], tuple[str, ...]]:
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
        if pol.fp8 is None and pol.compute_dtype.name == "float32":
            written.append(key)
            continue
        why = ""
        if recipe is None:
            why = "The policy runs no float8 matmul, so there is nothing to opt out of."
        elif pol.fp8 is not None:
            why = "A different float8 recipe per module is not supported on the torch side."
        elif pol.compute_dtype.name != str(compute).removeprefix("torch."):
            why = "Per-module compute dtypes other than float32 are not supported on the torch side."
        if why:
            raise NotImplementedError(_MSG_OVERRIDES.format(key=key, value=str(value), policy=str(policy), why=why))
        opt_out.append(key)
    return tuple(opt_out), tuple(written)


def policy_output(policy: Any) -> torch.dtype | None:
    """The output dtype of an fmp ``Policy`` or spec (``"mixed_bfloat16"``: float32); None for the torch
    spellings (``("cpu", torch.bfloat16)``, ``"cpu"``), which leave outputs as torch's autocast does."""
    if isinstance(policy, Policy | str) and not (isinstance(policy, str) and policy in TORCH_DEVICES):
        return getattr(torch, get_policy(policy).output_dtype.name)
    return None


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
