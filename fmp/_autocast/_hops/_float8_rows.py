"""Delayed float8 scaling in bodies: the amax-history rows a ``scan``/``cond``/``jit``/``checkpoint`` body reads.

A body's float8 sites are found by rewriting it once with a counting feeder
(``labels``); the parent feeder then hands out one block of rows for them
(``body_rows``), which enters the body as one more input, so that each row's
cotangent (the site's next history) flows back through the body's own
differentiation rule. A scan body gets a block with a leading axis of the scan
length, scanned over like the other ``xs``: one history per iteration (per
layer of a layer-scanned model), numbered as the unrolled program would number
them. Bodies that cannot carry rows (a ``while_loop`` of unknown trip count, a
custom derivative rule) run their float8 sites with current scaling, and say so
with a warning (``stateless``).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from fmp._autocast._engine._context import Context
from fmp._autocast._engine._interp import Rows
from fmp._float8._state import SiteFeeder

_MSG_STATELESS = (
    "fmp.autocast: {n} delayed-scaling float8 matmul(s) inside a {what} body ({first}, ...) run with current "
    "(tensorwise) scaling: {why}. Use lax.scan (or lax.fori_loop with static bounds) for a loop, or "
    "Float8Recipe('tensorwise') to make current scaling explicit."
)


def labels(ctx: Context, rewrite: Callable[[Context], Any]) -> list[str]:
    """The float8 site labels of a body (``rewrite`` run once with a counting feeder, recording nothing)."""
    if ctx.fp8_sites is None:
        return []
    counter = SiteFeeder(None)
    rewrite(dataclasses.replace(ctx, fp8_sites=counter, records=None, key=None))
    return counter.labels


def body_rows(
    ctx: Context,
    rewrite: Callable[[Context], Any],
    position: int,
    length: int | None = None,
    tag: str = "",
) -> tuple[Context, Rows | None, jax.Array | None]:
    """``(ctx, rows, block)`` for a body: the context to rewrite it in, its rows input and the value to pass.

    ``rewrite(ctx)`` rewrites the body without rows (to count its sites).
    ``position``: where the rows input goes among the body's inputs.
    ``length``: a scan's length (the block gets a leading axis of it). ``rows``
    and ``block`` are None where the body has no site or there is no state
    (then ``ctx`` hands the body no rows either).
    """
    names = labels(ctx, rewrite)
    if not names:
        return ctx, None, None
    named = [f"{n}{tag}" for n in names]
    if length is not None:
        named = [f"{n}[{i}]" for i in range(length) for n in named]
    block = ctx.fp8_sites.take_block(named)
    if block is None:
        return dataclasses.replace(ctx, fp8_sites=None), None, None
    if length is not None:
        block = block.reshape(length, len(names), *block.shape[1:])
    parent = ctx.fp8_sites
    aval = jax.core.ShapedArray((len(names), *block.shape[-2:]), jnp.dtype(jnp.float32))
    return ctx, Rows(position, aval, lambda r: parent.child(r, names)), block


def cond_rows(
    ctx: Context, rewrites: list[Callable[[Context], Any]], position: int
) -> tuple[Context, list[Rows | None], jax.Array | None]:
    """Rows for ``cond`` branches: every branch's sites have rows, each branch reads its own.

    One block holds the rows of all branches and enters every branch; only the
    branch taken returns a (non-zero) cotangent for its rows, so only its sites'
    histories advance (``Float8State.update`` keeps rows whose gradient is zero).
    """
    names = [labels(ctx, r) for r in rewrites]
    if not any(names):
        return ctx, [None] * len(rewrites), None
    block = ctx.fp8_sites.take_block([f"{n}[branch {b}]" for b, ns in enumerate(names) for n in ns])
    if block is None:
        return dataclasses.replace(ctx, fp8_sites=None), [None] * len(rewrites), None
    parent, aval = ctx.fp8_sites, jax.core.ShapedArray(block.shape, jnp.dtype(jnp.float32))
    out, start = [], 0
    for ns in names:
        out.append(Rows(position, aval, _slice_feeder(parent, start, ns)))
        start += len(ns)
    return ctx, out, block


def _slice_feeder(parent: SiteFeeder, start: int, names: list[str]) -> Callable[[Any], SiteFeeder]:
    return lambda r: parent.child(r[start : start + len(names)], names)


def stateless(ctx: Context, rewrite: Callable[[Context], Any], what: str, why: str) -> Context:
    """The context for a body whose float8 sites cannot have rows: warns if there are any, hands out none."""
    names = labels(ctx, rewrite)
    if names and ctx.fp8_sites is not None and ctx.fp8_sites.rows is not None:
        warnings.warn(_MSG_STATELESS.format(n=len(names), what=what, first=names[0], why=why), stacklevel=2)
    return ctx if ctx.fp8_sites is None else dataclasses.replace(ctx, fp8_sites=None)
