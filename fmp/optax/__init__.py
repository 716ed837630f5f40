"""optax glue for fmp: loss scaling and non-finite step skipping as optax transformations.

Importing this module imports optax.
"""

import optax as _optax  # noqa: F401  (fail early with a clear ImportError if optax is missing)

from fmp.optax._master_weights import MasterWeightsState as MasterWeightsState
from fmp.optax._master_weights import master_params as master_params
from fmp.optax._master_weights import master_weights as master_weights

__all__: list[str] = [
    "MasterWeightsState",
    "master_params",
    "master_weights",
]
