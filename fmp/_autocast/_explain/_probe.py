"""One compiled program per compared equation: everything ``Comparison.step`` computes beside the policy run.

For an equation the policy ran as one operation, the comparison computes the op as written on the reference
inputs (the reference output), the op under the policy on the reference inputs rounded as they arrived
(``alone``), the op as written on those rounded inputs (the baseline), and the error statistics of both
pairs. Dispatched op by op that is some ten small programs, each reading its inputs from memory again; here
it is one, which reads them once and runs the op's rule exactly as the policy run did (the same
``rewrite_eqn``, traced). It is compiled with XLA's ``xla_allow_excess_precision`` off, so every rounding the
op-by-op run makes (a value rounded to bfloat16 and read back as float32) is made here too: the values are
those of the op-by-op run.

A program is kept per ``key``: the equation's primitive, parameters, literal inputs and input types, its
row's decision (category, dtypes, rule, scope, source) and the explain's configuration, so two layers that
run the same ops share their programs. Equations whose key cannot be built (unhashable parameters) or whose
rule reads more than the key holds (float8 recipes: which operand is a weight) are compared op by op.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import JaxprEqn, Literal

from fmp._autocast._engine._context import Context, is_constant, is_scalar_constant
from fmp._autocast._engine._interp import bind, rewrite_eqn
from fmp._autocast._engine._lru import LRU
from fmp._autocast._explain._cache import type_key
from fmp._autocast._explain._stats import JAX_OPS, device_sums
from fmp._report._compare import as_arrived

# XLA may otherwise keep a value in float32 where the program rounds it to bfloat16 and reads it back
OPTIONS = {"xla_allow_excess_precision": False}

_PROGRAMS = LRU(1024)


def key(
    eqn: JaxprEqn,
    invals: Sequence[Any],
    outs: Sequence[Any],
    ref_in: Sequence[Any],
    row: Any,
    ctx: Context,
    scope: str,
    exact: bool,
) -> Hashable | None:
    """What decides the probe's program for ``eqn`` (``None``: no sound key; compare it op by op)."""
    if ctx.policy.fp8 is not None or any(pol.fp8 is not None for _, pol in ctx.overrides):
        return None
    try:
        params = tuple(sorted(eqn.params.items()))
        lits = tuple(
            (i, np.asarray(v.val).dtype.name, np.asarray(v.val).tobytes())
            for i, v in enumerate(eqn.invars)
            if isinstance(v, Literal)
        )
        k = (
            eqn.primitive,
            params,
            lits,
            tuple(_aval(x) for x in invals),
            tuple(_aval(x) for x in outs),
            tuple(_aval(x) for x in ref_in),
            (row.category, row.in_after, row.out_after, row.detail, row.why, row.scope, row.source_full),
            scope,
            exact,
            ctx.policy,
            ctx.rules,
            ctx.overrides,
        )
        hash(k)
    except TypeError:
        return None
    return k


def _aval(x: Any) -> Hashable:
    if is_constant(x):  # a value known while tracing (the rule treats a scalar one as a literal): it decides
        return (type(x), np.asarray(x).dtype.name, np.shape(x), np.asarray(x).tobytes())
    return type_key(x)


def run(
    k: Hashable,
    eqn: JaxprEqn,
    invals: Sequence[Any],
    outs: Sequence[Any],
    ref_in: Sequence[Any],
    ctx: Context,
    scope: str,
    exact: bool,
    traced: bool = False,
) -> tuple[list[Any], list[Any], list[Any] | None, list[Any] | None, list[Any]]:
    """``(reference outputs, sums of outs against them, alone, baseline, sums of alone against baseline)``;
    ``alone`` and ``baseline`` are ``None`` for an ``exact`` op (it adds nothing by itself)."""
    program = _PROGRAMS.get(k)
    if program is None:
        program = _PROGRAMS.put(k, _build(eqn, invals, scope, exact))
    lit = [isinstance(v, Literal) for v in eqn.invars]
    dyn_ref = [x for x, is_lit in zip(ref_in, lit, strict=True) if not is_lit]
    make, jitted = program
    if traced:  # inside a program being traced (``_compiled``): part of it, traced with this run's context
        return make(ctx)(list(outs), dyn_ref)
    if not jitted:  # jit traces on the first call, this one: with this run's context (its frames)
        jitted.append(jax.jit(make(ctx), compiler_options=OPTIONS))
    return jitted[0](list(outs), dyn_ref)


def constants_kept(arrived: Sequence[Any], invals: Sequence[Any]) -> list[Any]:
    """``arrived`` with each scalar constant the policy run saw in its place: the rule treats such a value as a
    literal of the source (it follows the other inputs' dtype), so the op run alone must see it as one too."""
    return [x if is_scalar_constant(x) else a for a, x in zip(arrived, invals, strict=True)]


def _build(eqn: JaxprEqn, invals: Sequence[Any], scope: str, exact: bool) -> Any:
    likes = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) if hasattr(x, "dtype") else x for x in invals]
    kept = [x if is_scalar_constant(x) else None for x in invals]  # not the policy run's arrays: not kept alive
    lits = {i: v.val for i, v in enumerate(eqn.invars) if isinstance(v, Literal)}
    params = eqn.params

    def make(ctx: Context) -> Any:
        # the rule as the policy run applies it (its frames: where each input comes from), without rows, cast
        # memo or comparison (nor the arrays they hold)
        ctx = dataclasses.replace(ctx, records=None, memos=[], compare=None)
        return functools.partial(_probe, eqn, params, lits, likes, kept, ctx, scope, exact)

    # compiled once, when first called op by op (the key holds every type jit would retrace for)
    return make, []


def _probe(
    eqn: JaxprEqn,
    params: Any,
    lits: dict[int, Any],
    likes: list[Any],
    kept: list[Any],
    ctx: Context,
    scope: str,
    exact: bool,
    outs: list[Any],
    dyn_ref: list[Any],
) -> Any:
    it = iter(dyn_ref)
    ref_in = [lits[i] if i in lits else next(it) for i in range(len(eqn.invars))]
    ref_out = bind(eqn, ref_in, params)
    out_sums = device_sums(outs, ref_out)
    if exact:
        return ref_out, out_sums, None, None, []
    arrived, back = as_arrived(JAX_OPS, ref_in, likes)
    alone = rewrite_eqn(eqn, constants_kept(arrived, kept), ctx, scope)
    baseline = ref_out if back is None else bind(eqn, back, params)
    return ref_out, out_sums, alone, None if back is None else baseline, device_sums(alone, baseline, True)
