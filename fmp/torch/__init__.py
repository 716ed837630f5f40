# ruff: noqa: E402  (the dependency check runs before the imports that need it)
"""The torch facade: ``import fmp.torch as amp`` in place of ``torch.amp`` / ``torch.cuda.amp``.

Importing this module imports torch; ``import fmp`` never does.
"""

from fmp._core._optional import require

require("torch", "fmp.torch")  # a missing torch raises an error that says how to install it

from fmp.torch import autocast_mode as autocast_mode
from fmp.torch import cuda as cuda
from fmp.torch import grad_scaler as grad_scaler
from fmp.torch._autocast import autocast as autocast
from fmp.torch._autocast import is_autocast_available as is_autocast_available
from fmp.torch._custom import custom_bwd as custom_bwd
from fmp.torch._custom import custom_fwd as custom_fwd
from fmp.torch._fx._api import autocast_fx as autocast_fx
from fmp.torch._fx._api import autocast_graph as autocast_graph
from fmp.torch._fx._explain._api import explain_fx as explain_fx
from fmp.torch._fx._explain._api import explain_graph as explain_graph
from fmp.torch._plan import plan_fx as plan_fx
from fmp.torch._scaler._grad_scaler import GradScaler as GradScaler
from fmp.torch._scaler._sharded import ShardedGradScaler as ShardedGradScaler

__all__ = [
    "GradScaler",
    "ShardedGradScaler",
    "autocast",
    "autocast_fx",
    "autocast_graph",
    "autocast_mode",
    "cuda",
    "custom_bwd",
    "custom_fwd",
    "explain_fx",
    "explain_graph",
    "grad_scaler",
    "is_autocast_available",
    "plan_fx",
]
