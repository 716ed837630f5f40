"""Float8 matmuls: quantisation math, scaling recipes and the delayed-scaling state.

Readable alone: imports only JAX, ``fmp._core`` and ``fmp._flax_serialization`` (a hook with no fmp
imports). The autocast interpreter calls ``fmp._float8._bind.bind_float8`` for equations in the rule table's
``float8`` category under a policy with a float8 recipe.
"""

from fmp._float8._recipe import Float8Recipe as Float8Recipe
from fmp._float8._state import Float8State as Float8State

__all__ = ["Float8Recipe", "Float8State"]
