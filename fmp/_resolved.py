"""``ResolvedPolicy``: a call's policy arguments, worked out once at its public entry."""

from __future__ import annotations

import dataclasses
from typing import Any

from fmp._core._rules import RuleSet
from fmp._float8._recipe import Float8Recipe
from fmp._policy import Policy


@dataclasses.dataclass(frozen=True)
class ResolvedPolicy:
    """A call's policy arguments, worked out once at the public entry (``fmp.autocast``, ``fmp.explain``,
    ``fmp.torch.autocast_fx``, ...); everything below reads it and never parses a policy again.

    ``policy``: the fmp ``Policy`` the user named, ``None`` for torch's own spellings (``("cpu",
    torch.bfloat16)``, ``"cpu"``); ``compute``: the compute dtype's name; ``output``: the dtype floating
    outputs come back in, ``None`` where they stay as computed (torch's spellings); ``recipe``: the float8
    recipe, if any; ``overrides``: the JAX side's ``(scope key, Policy)`` pairs; ``device_type``: torch's
    autocast device (``None`` on the JAX side); ``label``: the policy as the user spelled it, for messages.
    """

    compute: str
    output: str | None
    rules: RuleSet
    policy: Policy | None = None
    recipe: Float8Recipe | None = None
    overrides: tuple[tuple[str, Policy], ...] = ()
    device_type: str | None = None
    label: str = ""

    @classmethod
    def of(
        cls, policy: Policy, rules: RuleSet, overrides: tuple[tuple[str, Policy], ...] = (), **more: Any
    ) -> ResolvedPolicy:
        """The resolved form of an fmp ``Policy`` (already built from the user's spec)."""
        output = policy.output_dtype.name
        return cls(policy.compute_dtype.name, output, rules, policy, policy.float8, overrides, **more)
