"""optax glue for fmp: loss scaling and non-finite step skipping as optax transformations.

Importing this module imports optax.
"""

import optax as _optax  # noqa: F401  (fail early with a clear ImportError if optax is missing)

__all__: list[str] = []
