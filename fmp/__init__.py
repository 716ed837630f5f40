"""fmp: functional mixed precision for JAX, with a torch.amp-compatible facade.

``import fmp`` imports JAX only; ``fmp.optax`` and ``fmp.torch`` import optax and torch.
"""

from fmp._autocast import autocast as autocast
from fmp._autocast import autocast_jaxpr as autocast_jaxpr
from fmp._autocast import explain as explain
from fmp._core._rules import DEFAULT_RULES as DEFAULT_RULES
from fmp._core._rules import Category as Category
from fmp._core._rules import RuleSet as RuleSet
from fmp._policy import Policy as Policy
from fmp._policy import cast_tree as cast_tree
from fmp._policy import get_policy as get_policy

__version__ = "0.1.0.dev0"

__all__ = [
    "Category",
    "DEFAULT_RULES",
    "Policy",
    "RuleSet",
    "autocast",
    "autocast_jaxpr",
    "cast_tree",
    "explain",
    "get_policy",
]
