"""The scaler's arithmetic on JAX arrays: scalar products rounded through float64 as torch rounds them, and
the multiplication of one leaf by the scale or by its reciprocal."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from fmp._arrays import check_leaf


def _f64(fn):
    """Runs ``fn`` with float64 enabled, so scalar products round like torch's ``double`` kernels.

    torch computes ``float32(float64(scale) * factor)`` and ``float32(1 / float64(scale))``; a float32
    product of a non-power-of-two factor (1.1, 0.3) gives different bits. The float64 work is on scalars only.
    """

    @functools.wraps(fn)
    def wrapper(*args):
        with jax.enable_x64(True):
            return fn(*args)

    return wrapper


@_f64
def _mul_f64(scale: jax.Array, factor: float) -> jax.Array:
    return (jnp.asarray(scale).astype(jnp.float64) * factor).astype(jnp.float32)


@_f64
def reciprocal_f64(scale: jax.Array) -> jax.Array:
    """``float32(1 / float64(scale))``, torch's reciprocal of the scale."""
    return (1.0 / jnp.asarray(scale).astype(jnp.float64)).astype(jnp.float32)


class JaxOps:
    """The array namespace ``fmp._core._scaler_rule.update_scale`` runs on."""

    where = staticmethod(jnp.where)
    isfinite = staticmethod(jnp.isfinite)
    minimum = staticmethod(jnp.minimum)
    maximum = staticmethod(jnp.maximum)
    mul_f64 = staticmethod(_mul_f64)


def scale_leaf(path: Any, x: Any, s: jax.Array) -> Any:
    """Multiplies a float or integer leaf by the scale ``s`` in float32 (float64 leaves in float64)."""
    check_leaf(x, "GradScaler.scale", path)
    if not (hasattr(x, "dtype") or isinstance(x, int | float)):
        raise TypeError(f"GradScaler.scale: tree leaves must be float or integer arrays, got {type(x).__name__}")
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.floating):
        if x.dtype == jnp.float64:
            return x * s.astype(jnp.float64)
        return x.astype(jnp.float32) * s
    if jnp.issubdtype(x.dtype, jnp.integer):
        return x.astype(jnp.float32) * s
    raise TypeError(f"GradScaler.scale: tree leaves must be float or integer arrays, got {x.dtype}")


def unscale_leaf(path: Any, g: Any, inv: jax.Array) -> Any:
    """Multiplies a float leaf by the float32 reciprocal ``inv``, in torch's opmath; other leaves pass."""
    check_leaf(g, "GradScaler.unscale", path)
    if isinstance(g, float | complex):
        g = jnp.asarray(g)  # a Python float is a gradient too; canonical dtype (float32 without x64)
    if not hasattr(g, "dtype") or not jnp.issubdtype(g.dtype, jnp.inexact):
        return g
    g = jnp.asarray(g)  # numpy float64 becomes float32 without x64, as everywhere in JAX
    if jnp.issubdtype(g.dtype, jnp.complexfloating):
        # part by part: a complex product would turn inf * (0.25 + 0j) into inf + NaN j
        part = inv.astype(g.real.dtype)
        return jax.lax.complex(g.real * part, g.imag * part)
    if g.dtype == jnp.float64:
        return g * inv.astype(g.dtype)
    return (g.astype(jnp.float32) * inv).astype(g.dtype)
