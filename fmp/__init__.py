"""fmp: functional mixed precision for JAX, with a torch.amp-compatible facade.

``import fmp`` imports JAX only (``fmp.testing`` too); ``fmp.optax`` and ``fmp.torch`` import optax and torch.
"""

from fmp import testing as testing  # noqa: E402, I001 - the check for users' tests (imports JAX only)
from fmp._autocast import autocast as autocast
from fmp._autocast import autocast_jaxpr as autocast_jaxpr
from fmp._autocast import bwd_as_written as bwd_as_written
from fmp._autocast import explain as explain
from fmp._autocast import float8_state as float8_state
from fmp._autocast import plan as plan
from fmp._core._rules import DEFAULT_RULES as DEFAULT_RULES
from fmp._core._rules import Category as Category
from fmp._core._rules import RuleSet as RuleSet
from fmp._core._scaler_rule import ScaleHealthWarning as ScaleHealthWarning
from fmp._float8 import Float8Recipe as Float8Recipe
from fmp._float8 import Float8State as Float8State
from fmp._float8._quantize import Quantized as Quantized
from fmp._float8._quantize import quantize as quantize
from fmp._plan._plan import Plan as Plan
from fmp._policy import Policy as Policy
from fmp._policy import cast_tree as cast_tree
from fmp._policy import get_policy as get_policy
from fmp._scaling._finite import all_finite as all_finite
from fmp._scaling._finite import nonfinite_leaves as nonfinite_leaves
from fmp._scaling._finite import select_tree as select_tree
from fmp._scaling._grad import grad as grad
from fmp._scaling._grad import value_and_grad as value_and_grad
from fmp._scaling._health import check_scaler_health as check_scaler_health
from fmp._scaling._scaler import GradScaler as GradScaler

__version__ = "0.1.0.dev0"

__all__ = [
    "Category",
    "DEFAULT_RULES",
    "Float8Recipe",
    "Float8State",
    "GradScaler",
    "Plan",
    "Policy",
    "Quantized",
    "RuleSet",
    "ScaleHealthWarning",
    "all_finite",
    "autocast",
    "autocast_jaxpr",
    "bwd_as_written",
    "cast_tree",
    "check_scaler_health",
    "explain",
    "float8_state",
    "get_policy",
    "grad",
    "nonfinite_leaves",
    "plan",
    "quantize",
    "select_tree",
    "value_and_grad",
]
