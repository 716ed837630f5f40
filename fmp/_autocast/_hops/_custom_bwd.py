"""A custom_vjp's backward rule, run under the policy of its forward call (like ``torch.amp.custom_bwd``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from fmp._autocast._engine import _jax_internals
from fmp._autocast._engine._cast import cast
from fmp._autocast._engine._context import Context, NoKey, aval_of
from fmp._autocast._engine._interp import eval_jaxpr
from fmp._autocast._engine._weights import top_weights

# The attribute fmp.bwd_as_written sets on a custom_vjp bwd rule.
BWD_AS_WRITTEN = "__fmp_bwd_as_written__"


def run_bwd(call: Any, args: Any, ctx: Context, scope: str) -> list[Any]:
    """Runs a custom_vjp bwd rule under ``ctx``'s policy; its outputs keep the dtypes the rule gives them."""
    if not all(isinstance(a, jax.Array) for a in args):  # symbolic zeros: run it as written
        return list(call(*args))
    slots: list[Any] = []  # the bwd's outputs that are not arrays (symbolic zeros), by position

    def flat(*xs: Any) -> list[Any]:
        outs = list(call(*xs))
        slots[:] = [None if isinstance(o, jax.Array) else o for o in outs]
        return [o for o in outs if isinstance(o, jax.Array)]

    closed = _jax_internals.trace_to_closed_jaxpr(flat, [aval_of(a) for a in args], "fmp.autocast bwd")
    # every input of the rule (residuals, cotangents) counts as a weight for the float8 scope rule, as before
    sub = dataclasses.replace(
        ctx, records=None, memos=[], frames=[], tracebacks=[], weights_in=top_weights(closed.jaxpr)
    )
    if ctx.key is not None:  # traced apart, with no input for a key
        sub = dataclasses.replace(sub, key=NoKey())
    vals = eval_jaxpr(closed.jaxpr, closed.consts, list(args), sub, scope)
    vals = [cast(v, a.dtype, sub) for v, a in zip(vals, closed.out_avals, strict=True)]
    it = iter(vals)
    return [next(it) if s is None else s for s in slots]
