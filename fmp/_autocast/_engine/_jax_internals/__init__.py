"""Every use of unstable JAX internals (``jax._src``) in fmp lives in this folder, one topic per module.

The autocast transform re-traces jaxprs with exact abstract values (shardings, weak types and varying manual
axes included), which no public API offers (``_trace``), re-binds higher-order primitives such as
``shard_map``, whose primitive is not exported by ``jax.extend``, and wraps custom-derivative rules
(``_higher_order``), and keeps jnp's inline helpers as calls while it traces a function, through a staging
rule installed on first use (``_staging``: ``import fmp`` changes no JAX rule). Tested JAX range: 0.10.2
through 0.12.x (``TESTED_JAX``; ``pyproject.toml`` allows ``jax>=0.10.2,<0.13``); importing fmp with another
JAX warns once. When JAX moves one of these names or changes a primitive's params, these are the only files
to change: each function names the JAX versions it covers.
"""

from jax.extend.core.primitives import closed_call_p as closed_call_p
from jax.extend.core.primitives import jit_p as jit_p

from fmp._autocast._engine._jax_internals._higher_order import bind_shard_map as bind_shard_map
from fmp._autocast._engine._jax_internals._higher_order import rewrap_bwd as rewrap_bwd
from fmp._autocast._engine._jax_internals._higher_order import rewrap_rule_thunk as rewrap_rule_thunk
from fmp._autocast._engine._jax_internals._higher_order import scan_counts as scan_counts
from fmp._autocast._engine._jax_internals._higher_order import scan_params_with_xs as scan_params_with_xs
from fmp._autocast._engine._jax_internals._higher_order import shard_map_p as shard_map_p
from fmp._autocast._engine._jax_internals._higher_order import user_function as user_function
from fmp._autocast._engine._jax_internals._staging import keep_inline_calls as keep_inline_calls
from fmp._autocast._engine._jax_internals._staging import restaged_call_params as restaged_call_params
from fmp._autocast._engine._jax_internals._staging import staged_call_params as staged_call_params
from fmp._autocast._engine._jax_internals._trace import INLINE_WHEN_STAGED as INLINE_WHEN_STAGED
from fmp._autocast._engine._jax_internals._trace import as_closed as as_closed
from fmp._autocast._engine._jax_internals._trace import body_param as body_param
from fmp._autocast._engine._jax_internals._trace import inlined_when_staged as inlined_when_staged
from fmp._autocast._engine._jax_internals._trace import is_call_primitive as is_call_primitive
from fmp._autocast._engine._jax_internals._trace import is_staging as is_staging
from fmp._autocast._engine._jax_internals._trace import jit_params_with_input as jit_params_with_input
from fmp._autocast._engine._jax_internals._trace import primitives_by_name as primitives_by_name
from fmp._autocast._engine._jax_internals._trace import trace_to_closed_jaxpr as trace_to_closed_jaxpr

__all__ = [
    "INLINE_WHEN_STAGED",
    "as_closed",
    "bind_shard_map",
    "body_param",
    "closed_call_p",
    "inlined_when_staged",
    "is_call_primitive",
    "is_staging",
    "jit_p",
    "jit_params_with_input",
    "keep_inline_calls",
    "primitives_by_name",
    "restaged_call_params",
    "rewrap_bwd",
    "rewrap_rule_thunk",
    "scan_counts",
    "scan_params_with_xs",
    "shard_map_p",
    "staged_call_params",
    "trace_to_closed_jaxpr",
    "user_function",
]
