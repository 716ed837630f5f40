"""A repeated ``fmp.explain(compare=True)`` call as one compiled program.

The comparison (``_forward``) interprets the program op by op: the policy run, the reference run and what
each op adds by itself, streaming. Traced instead of run, the same interpretation gives one program whose
outputs are the statistics of every compared op; its rows (dtypes, sources, scopes) come out of the trace.
A call whose program was seen before by this ``explain`` function (the same jaxpr, argument types and
constants) runs that compiled program and fills the rows from its statistics, which are those of the
op-by-op run: XLA compiles it with ``xla_allow_excess_precision`` off, so every rounding to a low-precision
dtype that the op-by-op run makes is made in it too.

What it does not cover goes op by op, as before: programs with loops or branches (``scan``, ``while``,
``cond``: compared per iteration, on values), float8 recipes, programs closing over more than 16 MiB of
arrays, and a call whose statistics need the arrays themselves (a non-finite value or a sum out of float32's
range: ``_stats.from_fetched`` is ``None``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr

from fmp._autocast._checks import nested_jaxprs
from fmp._autocast._engine._context import Context
from fmp._autocast._engine._lru import LRU
from fmp._autocast._explain import _forward, _outputs
from fmp._autocast._explain._cache import type_key
from fmp._autocast._explain._stats import from_fetched
from fmp._autocast._transform import run_top
from fmp._report._blame import Job, fill_rows
from fmp._report._compare import Stats
from fmp._report._records import OpRecord

# XLA may otherwise keep a value in float32 where the program rounds it to bfloat16 and reads it back
_OPTIONS = {"xla_allow_excess_precision": False}

_PER_VALUE = frozenset({"scan", "while", "cond"})  # compared on values, iteration by iteration

# closed-over arrays are compiled into the program, as constants the rules may read (a mask's magnitude);
# past this many bytes of them (closed-over parameters), the call goes op by op rather than compile them in
_CONST_BYTES = 16 << 20


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled comparison: the program, the rows its trace made, and how its outputs fill them."""

    compiled: Any
    records: tuple[OpRecord, ...]
    # per compared row: its statistics as the index of the program output they come from, or their value
    jobs: tuple[Job[Stats | int], ...]
    wides: tuple[tuple[Any, ...], ...]  # per program output: the dtypes of its plain sums
    makers: dict[int, list[int]]
    outputs: tuple[Any, ...]  # per output, then per output again: its statistics and its baseline's (_outputs)
    keep: tuple[Any, ...]  # the function and constants the key names by identity (kept alive: no id is reused)


# the compiled comparisons of the programs seen last, by every ``explain`` wrapper: a new wrapper of the same
# function, policy, rules and overrides, called on arguments of the same types, reuses its program
PROGRAMS = LRU(8)


def run(closed: ClosedJaxpr, arrays: Sequence[Any], ctx: Context, fn: Any) -> list[Any] | None:
    """Fills ``ctx.records`` from a compiled comparison of ``closed`` (traced from ``fn``) on ``arrays`` and
    returns the statistics of its outputs (``_outputs.started``); ``None`` where the call has to go op by op
    (``ctx`` is then as it came)."""
    if ctx.fp8_sites is not None or ctx.policy.float8 is not None or any(p.float8 is not None for _, p in ctx.overrides):
        return None
    if any(isinstance(x, jax.core.Tracer) for x in arrays) or _per_value(closed.jaxpr):
        return None  # traced arguments: refused op by op, with its message
    k = _key(closed, arrays, ctx, fn)
    if k is None:
        return None
    program = PROGRAMS.get(k)
    if program is None:
        program = PROGRAMS.put(k, _build(closed, arrays, ctx, _owner(fn)[1]))
    fetched = jax.device_get(program.compiled(*arrays))
    values = [from_fetched(w, got) for w, got in zip(program.wides, fetched, strict=True)]
    if any(v is None for v in values):
        return None
    records = list(program.records)
    jobs = [job._replace(out=_value(job.out, values), alone=_value(job.alone, values)) for job in program.jobs]
    fill_rows(records, jobs, ctx.rules, program.makers)
    ctx.records = records
    return [_value(spec, values) for spec in program.outputs]


def _value(spec: Stats | int, values: list[Any]) -> Stats:
    return values[spec] if isinstance(spec, int) else spec


def _per_value(jaxpr: Jaxpr) -> bool:
    """Whether ``jaxpr`` holds an equation compared on values (a loop or a branch), at any depth."""
    return any(eqn.primitive.name in _PER_VALUE for body, _ in nested_jaxprs(jaxpr) for eqn in body.eqns)


def _owner(fn: Any) -> tuple[Hashable, Any]:
    """What names ``fn`` in a key, and the object the key holds alive so no id is reused: a bound method by
    its object and function (``model.apply`` makes a new method object per access), else ``fn`` itself."""
    self, func = getattr(fn, "__self__", None), getattr(fn, "__func__", None)
    if self is not None and func is not None:
        return (id(self), func), self
    return id(fn), fn


def _key(closed: ClosedJaxpr, arrays: Sequence[Any], ctx: Context, fn: Any) -> Hashable | None:
    """The function (its rows' sources and scopes), the policy, rules and overrides, the program's text, the
    arguments' types and its constants (arrays by identity: a JAX array never changes; a NumPy one by its
    bytes too)."""
    if sum(getattr(c, "nbytes", 0) for c in closed.consts) > _CONST_BYTES:
        return None
    consts: list[Any] = []
    for c in closed.consts:
        if isinstance(c, np.ndarray):
            consts.append((id(c), c.dtype.name, c.shape, c.tobytes()))
        elif isinstance(c, jax.Array):
            consts.append(id(c))
        else:
            try:
                hash(c)
            except TypeError:
                return None
            consts.append((type(c), c))
    config = (ctx.policy, ctx.rules, ctx.overrides)
    return _owner(fn)[0], config, str(closed.jaxpr), tuple(type_key(x) for x in arrays), tuple(consts)


def _build(closed: ClosedJaxpr, arrays: Sequence[Any], ctx: Context, owner: Any) -> Program:
    made: dict[str, Any] = {}

    def program(*xs: Any) -> list[Any]:
        c = dataclasses.replace(ctx, records=[], memos=[])
        _forward.start(c, xs, traced=True)
        got = run_top(closed, xs, c)
        cmp = c.compare
        base = _outputs.baseline(closed, xs, ctx.policy.compute_dtype)
        ends = _outputs.started(got, cmp.returned or [], base)
        outs: list[Any] = []
        wides: list[tuple[Any, ...]] = []
        jobs: list[Job[Stats | int]] = []
        index: dict[int, int] = {}  # id of a Deferred -> its position in the outputs (one may serve two rows)

        def spec(d: Any) -> Any:
            if d.value is not None:
                return d.value
            if id(d) not in index:
                index[id(d)] = len(outs)
                outs.append(d.pending())
                wides.append(tuple(d.wides))
            return index[id(d)]

        for job in cmp.jobs:
            jobs.append(job._replace(out=spec(job.out), alone=spec(job.alone)))
        made.update(records=tuple(c.records or ()), jobs=tuple(jobs), makers=dict(cmp.makers))
        made.update(outputs=tuple(spec(d) for d in ends), wides=tuple(wides))
        return outs

    compiled = jax.jit(program, compiler_options=_OPTIONS).lower(*arrays).compile()
    return Program(
        compiled, made["records"], made["jobs"], made["wides"], made["makers"], made["outputs"], (owner, *closed.consts)
    )
