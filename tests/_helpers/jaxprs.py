"""Helpers for the autocast tests: walk rewritten jaxprs."""

from __future__ import annotations

import jax
import numpy as np
from jax.extend.core import jaxprs_in_params


def all_eqns(closed):
    """Every equation of a (closed) jaxpr, nested bodies included, in order."""
    out = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            out.append(eqn)
            for sub in jaxprs_in_params(eqn.params):
                walk(sub)

    walk(closed.jaxpr if hasattr(closed, "jaxpr") else closed)
    return out


def in_dtypes(closed, prim: str):
    """Input dtype names of every ``prim`` equation (floating inputs only)."""
    rows = []
    for eqn in all_eqns(closed):
        if eqn.primitive.name == prim:
            rows.append(tuple(np.dtype(v.aval.dtype).name for v in eqn.invars))
    return rows


def count(closed, prim: str) -> int:
    return sum(1 for e in all_eqns(closed) if e.primitive.name == prim)


def rewritten(fn, *args, **kw):
    """The jaxpr ``fmp.autocast(fn, **kw)`` evaluates, as seen by an outer trace."""
    import fmp

    return jax.make_jaxpr(fmp.autocast(fn, **kw))(*args)
