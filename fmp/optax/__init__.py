# ruff: noqa: E402  (the dependency check runs before the imports that need it)
"""optax glue for fmp: loss scaling, non-finite step skipping, accumulation and low-precision params/states.

Importing this module imports optax.
"""

from fmp._core._optional import require

require("optax", "fmp.optax")  # a missing optax raises an error that says how to install it

from fmp.optax._accumulate import AccumulateState as AccumulateState
from fmp.optax._accumulate import accumulate as accumulate
from fmp.optax._float8 import float8_step as float8_step
from fmp.optax._loss_scaled import LossScaledState as LossScaledState
from fmp.optax._loss_scaled import SkipNonfiniteState as SkipNonfiniteState
from fmp.optax._loss_scaled import current_scaler as current_scaler
from fmp.optax._loss_scaled import loss_scaled as loss_scaled
from fmp.optax._loss_scaled import skip_nonfinite as skip_nonfinite
from fmp.optax._low_precision import KahanState as KahanState
from fmp.optax._low_precision import StochasticRoundState as StochasticRoundState
from fmp.optax._low_precision import kahan as kahan
from fmp.optax._low_precision import stochastic_round as stochastic_round
from fmp.optax._master_weights import MasterWeightsState as MasterWeightsState
from fmp.optax._master_weights import master_params as master_params
from fmp.optax._master_weights import master_weights as master_weights
from fmp.optax._state_dtypes import StateDtypesState as StateDtypesState
from fmp.optax._state_dtypes import state_dtypes as state_dtypes
from fmp.optax._stats import scaler_stats as scaler_stats

__all__ = [
    "AccumulateState",
    "KahanState",
    "LossScaledState",
    "MasterWeightsState",
    "SkipNonfiniteState",
    "StateDtypesState",
    "StochasticRoundState",
    "accumulate",
    "current_scaler",
    "float8_step",
    "kahan",
    "loss_scaled",
    "master_params",
    "master_weights",
    "scaler_stats",
    "skip_nonfinite",
    "state_dtypes",
    "stochastic_round",
]
