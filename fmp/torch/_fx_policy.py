"""The policy spellings ``autocast_fx``, ``autocast_graph`` and ``explain_fx`` accept, normalized."""

from __future__ import annotations

from typing import Any

import torch

from fmp._core import _dtypes
from fmp._core._rules import DEFAULT_RULES, TORCH_DEVICES, RuleSet
from fmp._policy import Policy, get_policy

_LOW = {"bfloat16": torch.bfloat16, "float16": torch.float16}
_DEFAULT_DTYPE = {"cpu": torch.bfloat16, "cuda": torch.float16}

_MSG_POLICY = (
    "policy must be a (device_type, dtype) pair such as ('cpu', torch.bfloat16), a torch device type "
    "('cpu' or 'cuda'), an fmp Policy or policy spec string ('mixed_bfloat16'), or None with "
    "device_type=/dtype= keywords; got {got!r}"
)


_MSG_FLOAT8 = (
    "policy {got!r} asks for float8 matmuls (fp8={fp8}), which fmp.torch does not run yet: it would quietly "
    "compute in {compute} instead. Use a policy without fp8 here (e.g. 'mixed_bfloat16'), or run float8 on the "
    "JAX side (fmp.autocast(fn, 'mixed_float8'))."
)


def torch_policy(policy: Policy | str) -> Policy:
    """``get_policy(policy)``, refusing a float8 policy (the torch side has no float8 rewrite).

    Raises:
      NotImplementedError: the policy carries an fp8 recipe.
    """
    pol = get_policy(policy)
    if pol.fp8 is not None:
        raise NotImplementedError(_MSG_FLOAT8.format(got=str(policy), fp8=pol.fp8, compute=pol.compute_dtype.name))
    return pol


def resolve_policy(
    policy: Any = None,
    device_type: str | None = None,
    dtype: Any = None,
    rules: RuleSet | None = None,
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
            pol = torch_policy(policy)
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
