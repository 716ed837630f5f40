"""The torch facade: ``import fmp.torch as amp`` in place of ``torch.amp`` / ``torch.cuda.amp``.

Importing this module imports torch; ``import fmp`` never does.
"""

import torch as _torch  # noqa: F401  (fail early with a clear ImportError if torch is missing)

from fmp.torch._fx import autocast_fx as autocast_fx
from fmp.torch._fx import autocast_graph as autocast_graph
from fmp.torch._fx_explain import explain_fx as explain_fx
from fmp.torch._fx_explain import explain_graph as explain_graph

__all__: list[str] = [
    "autocast_fx",
    "autocast_graph",
    "explain_fx",
    "explain_graph",
]
