"""What one rewrite carries: its ``Context`` (policy, rules, handlers, caches, explain rows) and value helpers.

The bottom of ``fmp._autocast`` with ``_provenance`` and ``_frames``: the interpreter
(``_interp``), the casts (``_cast``) and every handler read the context and
these helpers; this module imports no other part of the rewrite.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import JaxprEqn

from fmp._autocast._engine import _rows
from fmp._autocast._engine._frames import Frame
from fmp._core import _dtypes, _scopes
from fmp._core._rules import OVERRIDE, RuleSet, joined
from fmp._policy import Policy
from fmp._report._records import OpRecord, short_source

# The named scope an autocast region runs under. An outer autocast leaves every
# equation under this scope as the inner region decided it.
REGION_SCOPE = "fmp_autocast"


def like_avals(avals: Sequence[Any], vals: Sequence[Any]) -> list[Any]:
    """``avals`` (a body's own: shape, sharding, ...) with the dtypes and weak types of ``vals``."""
    out = []
    for a, x in zip(avals, vals, strict=True):
        cur = aval_of(x)
        same = not hasattr(a, "dtype") or (a.dtype == cur.dtype and a.weak_type == cur.weak_type)
        out.append(a if same else a.update(dtype=cur.dtype, weak_type=cur.weak_type))
    return out


_NAMES: dict[Any, str] = {}


def dtype_name(dtype: Any) -> str:
    """The name of a dtype; works for extended dtypes (PRNG keys) that NumPy does not know."""
    try:
        return _NAMES[dtype]
    except (KeyError, TypeError):  # TypeError: an unhashable dtype-like
        pass
    name = getattr(dtype, "name", None)
    name = name if isinstance(name, str) else np.dtype(dtype).name
    try:
        if len(_NAMES) < 256:
            _NAMES[dtype] = name
    except TypeError:
        pass
    return name


def is_castable(dtype: Any) -> bool:
    return dtype_name(dtype) in _dtypes.CASTABLE


# the types of a constant (the union built once: ``isinstance(x, int | float)`` builds it at every call)
_CONSTANT_TYPES = (int, float, complex, np.ndarray, np.generic)
_NUMPY_TYPES = (np.ndarray, np.generic)


def is_constant(x: Any) -> bool:
    """A value known while tracing: a literal of the program, or a constant JAX would fold into one."""
    return isinstance(x, _CONSTANT_TYPES) and not isinstance(x, jax.Array)


def is_scalar_constant(x: Any) -> bool:
    """A constant with no dimensions (a Python number or a 0-d NumPy value): a scalar literal of the source."""
    return is_constant(x) and (not isinstance(x, _NUMPY_TYPES) or x.ndim == 0)


def aval_of(x: Any) -> Any:
    """The abstract value of a runtime value (tracer, array or Python scalar)."""
    return jax.typeof(x)


@dataclasses.dataclass
class Context:
    """The static configuration of one rewrite, plus an optional explain recorder."""

    policy: Policy
    rules: RuleSet
    overrides: tuple[tuple[str, Policy], ...] = ()
    records: list[OpRecord] | None = None
    # one cast cache per jaxpr being evaluated (values of one trace): (id(x), dtype) -> (x, cast x)
    memos: list[dict[tuple[int, str], tuple[Any, Any]]] = dataclasses.field(default_factory=list)
    # one frame per jaxpr being evaluated: where its variables come from in the original program (epilogue rule)
    frames: list[Frame] = dataclasses.field(default_factory=list)
    # the traceback of the inline helper call whose body is being rewritten (its equations take it, as JAX's
    # inlining gives them); empty at the top level
    tracebacks: list[Any] = dataclasses.field(default_factory=list)
    # the tracebacks of the (not inlined) jit calls whose bodies are being rewritten, innermost last: a body's
    # equation whose own traceback holds no frame of the user's (it stops at the jit, e.g. inside
    # jax.nn.log_softmax) takes the line of the call
    callers: list[Any] = dataclasses.field(default_factory=list)
    # what to do with an equation: higher-order primitive -> handler; every other equation -> leaf
    handlers: Mapping[Any, Handler] = dataclasses.field(default_factory=dict)
    leaf: Leaf | None = None
    # whether ``leaf`` binds an equation as written when its inputs have their original types
    keeps: Callable[[JaxprEqn, Context, Policy], bool] | None = None
    # delayed float8 scaling: hands out one amax-history row per top-level float8 site (fmp._float8._state)
    fp8_sites: Any = None
    # the caller's jax.random key for stochastic rounding (NVFP4 gradients); each block-scaled site folds in
    # its number in trace order (a list, shared by the copies of the context a body rewrite makes)
    key: Any = None
    key_sites: list[int] = dataclasses.field(default_factory=lambda: [0])
    # explain(compare=True): the reference run beside this one (``_compare.Comparison``); None otherwise
    compare: Any = None
    # why the equations of the body being rewritten run under ``policy`` when an enclosing rule chose it
    # (a float32 custom_linear_solve's bodies): the ``detail`` of their explain rows
    reason: str = ""
    # the float8 scope rule: id(body jaxpr) -> which of its inputs are weights, for the bodies of the
    # higher-order equation being rewritten (``_weights.body_weights``)
    weights_in: Mapping[int, tuple[str | None, ...]] = dataclasses.field(default_factory=dict)

    def site_key(self) -> Any:
        """A key of its own for the next block-scaled site, or for the next body that takes a key as an input
        (its sites fold in their own numbers from it); None without a caller's key."""
        if self.key is None:
            return None
        if isinstance(self.key, NoKey):
            raise ValueError(_MSG_NO_KEY)
        self.key_sites[0] += 1
        return jax.random.fold_in(self.key, self.key_sites[0])

    def resolve(self, scope: str, source: Callable[[], str] | None = None) -> tuple[str, Policy]:
        """``("nested" | "override" | "default", policy)`` for an equation in ``scope``; ``source()`` gives its
        source line, which a source-location key of ``overrides`` selects (before any scope key)."""
        if REGION_SCOPE in scope:
            return "nested", self.policy
        if source is not None and any(_scopes.is_location(k) for k, _ in self.overrides):
            line = source()
            for key, pol in self.overrides:
                if _scopes.is_location(key) and _scopes.matches_location(line, key):
                    return "override", pol
        best, where = None, -1
        for key, pol in self.overrides:
            if _scopes.is_location(key):
                continue
            pos = _scopes.find_key(scope, key)
            if pos > where:
                best, where = pol, pos
        if best is not None:
            return "override", best
        return "default", self.policy

    def record(self, **fields: Any) -> None:
        if self.records is not None:
            if self.reason and not fields.get("detail"):
                fields["detail"] = self.reason
            full = fields.pop("source")
            row = OpRecord(index=len(self.records), source=short_source(full), source_full=full, **fields)
            self.records.append(row)


_MSG_NO_KEY = (
    "fmp.autocast(key=...): a block-scaled (NVFP4) matmul inside a while_loop, custom_jvp/custom_vjp rule, "
    "linear solve, composite or shard_map body cannot take the key for stochastic rounding (such a body has no "
    "input for it). Call fmp.autocast without key= (gradients round to nearest), or write the loop as lax.scan "
    "(or lax.fori_loop with static bounds), or unroll it."
)


@dataclasses.dataclass(frozen=True)
class NoKey:
    """``Context.key`` in a body that cannot take the caller's key as an input: a block-scaled site there
    raises (the body's trace must not close over the caller's key, and a constant key would repeat its bits)."""


def passes_key(ctx: Context) -> bool:
    """Whether a body rewritten under ``ctx`` takes a stochastic-rounding key as its last input."""
    return ctx.key is not None and not isinstance(ctx.key, NoKey)


def _names(avals: Sequence[Any]) -> tuple[str, ...]:
    return tuple(dtype_name(a.dtype) for a in avals if hasattr(a, "dtype"))


def float_names(avals: Sequence[Any]) -> tuple[str, ...]:
    return tuple(n for n in _names(avals) if n.startswith(("float", "bfloat")))


def source_of(eqn: JaxprEqn, ctx: Context) -> str:
    """The user's source line of ``eqn`` (inside an inline helper: of the helper's call; inside a jit body whose
    equations have no line of the user's: of the innermost call that has one)."""
    line = _rows.source(eqn, ctx.tracebacks[-1] if ctx.tracebacks else None)
    for tb in reversed(ctx.callers):
        if line:
            break
        line = _rows.source(eqn, tb)
    return line


@contextlib.contextmanager
def calling(ctx: Context, eqn: JaxprEqn) -> Iterator[None]:
    """Rewrites inside the body of the call ``eqn`` (see ``Context.callers``)."""
    ctx.callers.append(eqn.source_info.traceback)
    try:
        yield
    finally:
        ctx.callers.pop()


def record_eqn(
    eqn: JaxprEqn,
    ctx: Context,
    scope: str,
    category: str,
    invals: Sequence[Any],
    outs: Sequence[Any],
    detail: str = "",
    why: str = "",
):
    """Adds an explain row for ``eqn`` (when recording); ``why``: the float8 scope rule's reason."""
    if ctx.records is None:
        return
    ctx.record(
        op=eqn.primitive.name,
        source=source_of(eqn, ctx),
        scope=scope,
        category=category,
        in_before=float_names([v.aval for v in eqn.invars]),
        in_after=float_names([aval_of(x) for x in invals]),
        out_before=float_names([v.aval for v in eqn.outvars]),
        out_after=float_names([aval_of(x) for x in outs]),
        flops=_rows.flops(eqn),
        detail=detail,
        why=why,
    )


# the rules whose rows an override relabels: what the rule table decided (casts and user casts stay theirs)
_DECIDED = frozenset({"lower_precision", "float32", "promote", "unlisted", "epilogue", OVERRIDE})


def overridden(ctx: Context, mark: int, policy: Policy) -> None:
    """The rows from ``mark`` on, which the rule table decided under an ``overrides`` entry's ``policy``, read
    ``override``; their detail keeps the rule and names the policy's compute dtype."""
    if ctx.records is None:
        return
    for i in range(mark, len(ctx.records)):
        r = ctx.records[i]
        if r.category in _DECIDED:
            why = f"{policy.compute_dtype.name} by overrides" + (
                "" if r.category == OVERRIDE else f", rule {r.category}"
            )
            ctx.records[i] = dataclasses.replace(r, category=OVERRIDE, detail=joined(why, r.detail))


Handler = Callable[[JaxprEqn, list[Any], Context, str], list[Any]]
Leaf = Callable[[JaxprEqn, list[Any], Context, str, Policy], list[Any]]
