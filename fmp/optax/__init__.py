"""optax glue for fmp: loss scaling and non-finite step skipping as optax transformations.

Importing this module imports optax.
"""

from fmp.optax._loss_scaled import LossScaledState as LossScaledState
from fmp.optax._loss_scaled import SkipNonfiniteState as SkipNonfiniteState
from fmp.optax._loss_scaled import current_scaler as current_scaler
from fmp.optax._loss_scaled import loss_scaled as loss_scaled
from fmp.optax._loss_scaled import skip_nonfinite as skip_nonfinite

__all__ = [
    "LossScaledState",
    "SkipNonfiniteState",
    "current_scaler",
    "loss_scaled",
    "skip_nonfinite",
]
