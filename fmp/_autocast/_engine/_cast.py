"""Casts inside the rewrite: one rounding per low-precision value, one cast per value and dtype.

``cast`` converts a value for the rewritten program, reusing the cast made
for an earlier use of the same value in the same trace (the interpreter keeps
one cache per jaxpr, ``Context.memos``) and recording it for explain;
``restore`` gives an equation back the dtypes the original program had.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import JaxprEqn
from jax.extend.core.primitives import jit_p

from fmp._autocast._engine import _jax_internals
from fmp._autocast._engine._context import Context, aval_of, dtype_name, is_castable, source_of
from fmp._autocast._engine._lru import LRU
from fmp._core import _dtypes

_MISSING = object()


def round_once(up: Any, src: Any) -> Any:
    """``up`` (a value cast up from ``src``) with ``src``'s rounding made explicit.

    One rounding for every consumer: inside a fusion XLA may drop a convert pair
    float32 -> bfloat16 -> float32 (excess precision), so a consumer reading the
    value through a cast up would see the producer's unrounded float32 result
    while another consumer of the same bfloat16 value sees it rounded (a
    cross-entropy then goes negative under ``jit``). ``reduce_precision`` is never
    dropped and rounds as the convert does, so ``jit`` equals eager; where XLA
    keeps the pair it changes nothing.
    """
    src, dst = dtype_name(src), dtype_name(aval_of(up).dtype)
    if src not in _dtypes.LOW_PRECISION or dst not in _dtypes.CASTABLE or _dtypes.widest([src, dst]) != dst:
        return up
    exponent, mantissa = _dtypes.FORMAT_BITS[src]
    if exponent < 8:  # float16: reduce_precision would flush its subnormals (below 2**-14) to zero
        return _rounder(exponent, mantissa)(up)
    return jax.lax.reduce_precision(up, exponent_bits=exponent, mantissa_bits=mantissa)


def is_rounding(eqn: Any) -> bool:
    """Whether ``eqn`` is the float16 rounding mark of ``round_once`` (a ``custom_jvp_call`` of
    ``_rounder``'s function): like ``reduce_precision``, the identity for a run widened past float16."""
    if eqn.primitive.name != "custom_jvp_call":
        return False
    info = getattr(getattr(eqn.params.get("call_jaxpr"), "jaxpr", None), "debug_info", None)
    return getattr(info, "func_name", None) == "fmp_round_subnormals"


@functools.cache
def _rounder(exponent: int, mantissa: int) -> Callable[[Any], Any]:
    """Rounding to a format with a narrower exponent than float32's, subnormals kept (as its convert does).

    ``reduce_precision`` rounds the normal range and overflows as the convert does, but flushes the
    format's subnormals to zero; below the smallest normal the value is rounded to the subnormal step
    instead (a multiplication by a power of two, exact, and a round half to even). Derivatives pass
    through unchanged: the cast's own transpose (a convert back down) rounds a cotangent as torch's
    does, subnormals kept, where ``reduce_precision``'s transpose would flush them.
    """
    tiny = 2.0 ** (2 - 2 ** (exponent - 1))  # smallest normal: 2**-14 for float16
    step = tiny * 2.0**-mantissa  # subnormal spacing: 2**-24

    @jax.custom_jvp
    def fmp_round_subnormals(x: Any) -> Any:
        normal = jax.lax.reduce_precision(x, exponent_bits=exponent, mantissa_bits=mantissa)
        k = jax.lax.round(x * np.asarray(1 / step, x.dtype), jax.lax.RoundingMethod.TO_NEAREST_EVEN)
        return jax.lax.select(jax.lax.abs(x) < np.asarray(tiny, x.dtype), k * np.asarray(step, x.dtype), normal)

    @fmp_round_subnormals.defjvp
    def _jvp(primals: tuple, tangents: tuple) -> tuple:
        return fmp_round_subnormals(primals[0]), tangents[0]

    return fmp_round_subnormals


@functools.cache
def _convert_fn(src: Any, dst: Any) -> Callable[[Any], Any]:
    """``x -> round_once(convert(x, dst), src)``."""

    def convert(x: Any) -> Any:
        return round_once(jax.lax.convert_element_type(x, dst), src)

    return convert


@functools.cache
def _cast_fn(src: Any, dst: Any) -> Callable[[Any], Any]:
    """``_convert_fn(src, dst)`` as a jitted helper (inlined when staged, like jnp's): JAX caches its
    differentiation per input type instead of linearizing the cast at every use."""
    return jax.jit(_convert_fn(src, dst), inline=_jax_internals.INLINE_WHEN_STAGED)


_CAST_CALLS = LRU(1024)  # (input aval, dtype, mesh) -> the jit equation's params (None: bind by calling)
_CAST_TEMPLATES = LRU(256)  # (input dtype, dtype, mesh) -> the params staged for one shape (None: bind by calling)


def _cast_call(x: Any, aval: Any, dtype: Any) -> Any:
    """``_cast_fn(...)(x)``, bound as the ``jit`` equation that call would stage, reused per input type
    (a call of a jitted function re-derives that equation every time). The equation is staged by calling
    once per pair of dtypes; for another shape only its body is traced."""
    mesh = jax.sharding.get_abstract_mesh()
    key = (aval, dtype.name, mesh)
    params = _CAST_CALLS.get(key, _MISSING)
    if params is _MISSING:
        pair = (dtype_name(aval.dtype), dtype.name, mesh)
        template = _CAST_TEMPLATES.get(pair, _MISSING)
        if template is _MISSING:
            params = _CAST_TEMPLATES.put(pair, _jax_internals.staged_call_params(_cast_fn(aval.dtype, dtype), aval))
        elif template is not None:
            params = _jax_internals.restaged_call_params(template, _convert_fn(aval.dtype, dtype), aval)
        else:
            params = None
        _CAST_CALLS.put(key, params)
    if params is None:
        return _cast_fn(aval.dtype, dtype)(x)
    return jit_p.bind(x, **params)[0]


def cast(x: Any, dtype: Any, ctx: Context, eqn: JaxprEqn | None = None, scope: str = "") -> Any:
    """Casts ``x`` to ``dtype`` when it differs, recording the cast (for ``eqn``) for explain."""
    aval = aval_of(x)
    if aval.dtype == dtype or not is_castable(aval.dtype):
        return x
    dtype = np.dtype(dtype)
    if isinstance(x, int | float | np.ndarray | np.generic) and not isinstance(x, jax.Array):
        return np.asarray(x, dtype=dtype)
    memo = ctx.memos[-1] if ctx.memos else None
    if memo is not None:
        hit = memo.get((id(x), dtype.name))
        if hit is not None and hit[0] is x:
            return hit[1]
    if ctx.records is not None:
        _record_cast(ctx, eqn, scope, aval.dtype, dtype)
    # a staging trace inlines the jitted cast (like jnp's helpers): bind its equations directly
    out = _convert_fn(aval.dtype, dtype)(x) if _jax_internals.is_staging(x) else _cast_call(x, aval, dtype)
    if memo is not None:
        memo[(id(x), dtype.name)] = (x, out)  # keeps x alive, so its id is not reused
    return out


def _record_cast(ctx: Context, eqn: JaxprEqn | None, scope: str, src: Any, dtype: Any) -> None:
    ctx.record(
        op="convert_element_type",
        source=source_of(eqn, ctx) if eqn is not None else "",
        scope=scope,
        category="cast",
        in_before=(),
        in_after=(dtype_name(src),),
        out_before=(),
        out_after=(dtype.name,),
    )


def restore(eqn: JaxprEqn, invals: Sequence[Any], ctx: Context, scope: str = "") -> list[Any]:
    """Casts every castable float input back to the dtype the original program gave it."""
    out = []
    for v, x in zip(eqn.invars, invals, strict=True):
        want = v.aval.dtype if hasattr(v.aval, "dtype") else None
        out.append(cast(x, want, ctx, eqn, scope) if want is not None and is_castable(want) else x)
    return out
