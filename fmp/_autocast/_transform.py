"""The equation loop: rewrite a jaxpr op by op under a policy and the rule table.

The rewrite is an interpreter that re-binds every equation with (possibly
cast) inputs. Run under a fresh trace it yields a new
:class:`~jax.extend.core.ClosedJaxpr` (:func:`autocast_jaxpr`); run in the
caller's trace (``fmp.autocast``) it emits the same equations there, so
``jit``, ``grad`` and ``vmap`` compose. Bodies of higher-order primitives are
rewritten into new jaxprs (``_hops.py``). Decisions read the *current* input
dtypes (those the rewritten program produced so far), so a value that is
already in the compute dtype is not cast again.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, jaxprs_in_params
from jax.extend.core.primitives import convert_element_type_p

from fmp._autocast import _jax_internals
from fmp._core import _dtypes
from fmp._core._report import OpRecord
from fmp._core._rules import DEFAULT_RULES, Category, RuleSet, decide
from fmp._fp8 import _bind as _fp8
from fmp._policy import Policy, get_policy

# The named scope an autocast region runs under. An outer autocast leaves every
# equation under this scope as the inner region decided it.
REGION_SCOPE = "fmp_autocast"

# Primitives whose sub-jaxpr is a scalar combiner typed for the original dtype,
# not user code: they run in the dtypes of the original program, unchanged.
OPAQUE = frozenset(
    {
        "reduce",
        "reduce_window",
        "select_and_scatter",
        "select_and_scatter_add",
        "select_and_gather_add",
        "scatter",
        "scatter-add",
        "scatter-sub",
        "scatter-mul",
        "scatter-min",
        "scatter-max",
    }
)

# Primitives whose meaning depends on the exact input dtype: always given the
# original dtypes back.
EXACT_DTYPE = frozenset({"bitcast_convert_type", "reduce_precision", "pure_callback", "io_callback", "debug_callback"})

_MSG_UNHANDLED = (
    "fmp.autocast: primitive {name!r} carries a sub-jaxpr that fmp does not know how to rewrite. "
    "Move this call outside the autocast function, or wrap it in fmp.autocast(..., enabled=False) "
    "to run it exactly as written."
)


def dtype_name(dtype: Any) -> str:
    """The name of a dtype; works for extended dtypes (PRNG keys) that NumPy does not know."""
    name = getattr(dtype, "name", None)
    return name if isinstance(name, str) else np.dtype(dtype).name


def _is_castable(dtype: Any) -> bool:
    return dtype_name(dtype) in _dtypes.CASTABLE


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
    # one map per jaxpr being evaluated: original variable -> the equation that produced it (epilogue rule)
    producers: list[dict[Any, JaxprEqn]] = dataclasses.field(default_factory=list)
    # delayed float8 scaling: hands out one amax-history row per top-level float8 site (fmp._fp8._state)
    fp8_sites: Any = None

    def resolve(self, scope: str) -> tuple[str, Policy]:
        """``("nested" | "override" | "default", policy)`` for an equation in ``scope``."""
        if REGION_SCOPE in scope:
            return "nested", self.policy
        best, where = None, -1
        for key, pol in self.overrides:
            pos = scope.rfind(key)
            if pos > where:
                best, where = pol, pos
        if best is not None:
            return "override", best
        return "default", self.policy

    def record(self, **fields: Any) -> None:
        if self.records is not None:
            self.records.append(OpRecord(index=len(self.records), **fields))


def check_overrides(overrides: Mapping[str, Any] | None) -> tuple[tuple[str, Policy], ...]:
    """Validates ``overrides`` (scope substring -> policy spec) into a hashable tuple."""
    if overrides is None:
        return ()
    if not isinstance(overrides, Mapping):
        raise TypeError(
            f"overrides must be a mapping from a name-scope substring to a policy (e.g. "
            f"{{'LayerNorm': 'float32'}}), got {type(overrides).__name__}"
        )
    out = []
    for key, spec in overrides.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"overrides keys must be non-empty str name-scope substrings, got {key!r}")
        out.append((key, get_policy(spec)))
    return tuple(out)


def check_rules(rules: RuleSet | None) -> RuleSet:
    if rules is None:
        return DEFAULT_RULES
    if not isinstance(rules, RuleSet):
        raise TypeError(
            f"rules must be an fmp.RuleSet (e.g. fmp.DEFAULT_RULES.derive(...)), got {type(rules).__name__}"
        )
    return rules


def _join(prefix: str, own: str) -> str:
    return f"{prefix}/{own}" if prefix and own else (prefix or own)


def _source(eqn: JaxprEqn) -> str:
    try:
        return source_info_util.summarize(eqn.source_info)
    except Exception:  # noqa: BLE001 - a report line must never break the rewrite
        return ""


def _names(avals: Sequence[Any]) -> tuple[str, ...]:
    return tuple(dtype_name(a.dtype) for a in avals if hasattr(a, "dtype"))


def _float_names(avals: Sequence[Any]) -> tuple[str, ...]:
    return tuple(n for n in _names(avals) if n.startswith(("float", "bfloat")))


def cast(x: Any, dtype: Any, ctx: Context, eqn: JaxprEqn | None = None, scope: str = "") -> Any:
    """Casts ``x`` to ``dtype`` when it differs, recording the cast (for ``eqn``) for explain."""
    aval = aval_of(x)
    if aval.dtype == dtype or not _is_castable(aval.dtype):
        return x
    dtype = np.dtype(dtype)
    if isinstance(x, int | float | np.ndarray | np.generic) and not isinstance(x, jax.Array):
        return np.asarray(x, dtype=dtype)
    memo = ctx.memos[-1] if ctx.memos else None
    if memo is not None:
        hit = memo.get((id(x), dtype.name))
        if hit is not None and hit[0] is x:
            return hit[1]
    ctx.record(
        op="convert_element_type",
        source=_source(eqn) if eqn is not None else "",
        scope=scope,
        category="cast",
        in_before=(),
        in_after=(dtype_name(aval.dtype),),
        out_before=(),
        out_after=(dtype.name,),
    )
    out = jax.lax.convert_element_type(x, dtype)
    if memo is not None:
        memo[(id(x), dtype.name)] = (x, out)  # keeps x alive, so its id is not reused
    return out


def bind(eqn: JaxprEqn, invals: Sequence[Any], params: Mapping[str, Any]) -> list[Any]:
    """Binds ``eqn``'s primitive on ``invals`` with ``params``; always returns a list."""
    prim = eqn.primitive
    out = prim.bind(*invals, **prim.get_bind_params(dict(params)))
    return list(out) if prim.multiple_results else [out]


def eval_jaxpr(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any], ctx: Context, prefix: str) -> list[Any]:
    """Evaluates ``jaxpr`` on ``args``, rewriting each equation; returns the outputs."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    ctx.memos.append({})  # a value cast for two uses is cast once
    ctx.producers.append({v: e for e in jaxpr.eqns for v in e.outvars} if ctx.rules.jax_epilogue else {})
    try:
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            scope = _join(prefix, str(eqn.source_info.name_stack))
            name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
            with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
                outs = rewrite_eqn(eqn, invals, ctx, scope)
            for v, x in zip(eqn.outvars, outs, strict=True):
                env[v] = x
        return [read(v) for v in jaxpr.outvars]
    finally:
        ctx.memos.pop()
        ctx.producers.pop()


def transform_closed(
    closed: ClosedJaxpr,
    in_avals: Sequence[Any],
    ctx: Context,
    prefix: str,
    out_dtypes: Sequence[Any] | None = None,
) -> ClosedJaxpr:
    """Rewrites ``closed`` for inputs of ``in_avals``; ``out_dtypes`` pins output dtypes (None: free).

    Results are memoised on the jaxpr object and the configuration, for
    jaxprs without constants (so no cached entry keeps arrays or tracers
    alive) and not while recording for explain: JAX reuses jaxpr objects for
    repeated calls (two ``softmax`` calls share one), and handing JAX back the
    same rewritten object lets it reuse its own caches.
    """
    key = None
    if ctx.records is None and not closed.consts:
        dts = None if out_dtypes is None else tuple(out_dtypes)
        key = (closed, tuple(in_avals), ctx.policy, ctx.rules, ctx.overrides, prefix, dts)
        hit = _CACHE.get(key)
        if hit is not None:
            _CACHE.move_to_end(key)
            return hit
    result = _transform_closed(closed, in_avals, ctx, prefix, out_dtypes)
    if key is not None:
        _CACHE[key] = result
        if len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return result


_CACHE: collections.OrderedDict = collections.OrderedDict()
_CACHE_SIZE = 1024


def _transform_closed(
    closed: ClosedJaxpr,
    in_avals: Sequence[Any],
    ctx: Context,
    prefix: str,
    out_dtypes: Sequence[Any] | None,
) -> ClosedJaxpr:
    def fun(*args: Any) -> list[Any]:
        outs = eval_jaxpr(closed.jaxpr, closed.consts, args, ctx, prefix)
        if out_dtypes is None:
            return outs
        return [o if d is None else cast(o, d, ctx) for o, d in zip(outs, out_dtypes, strict=True)]

    return _jax_internals.trace_to_closed_jaxpr(fun, in_avals, "fmp.autocast")


def restore(eqn: JaxprEqn, invals: Sequence[Any], ctx: Context, scope: str = "") -> list[Any]:
    """Casts every castable float input back to the dtype the original program gave it."""
    out = []
    for v, x in zip(eqn.invars, invals, strict=True):
        want = v.aval.dtype if hasattr(v.aval, "dtype") else None
        out.append(cast(x, want, ctx, eqn, scope) if want is not None and _is_castable(want) else x)
    return out


def _record_eqn(eqn: JaxprEqn, ctx: Context, scope: str, category: str, invals: Sequence[Any], outs: Sequence[Any]):
    if ctx.records is None:
        return
    from fmp._autocast._explain import flops  # local: explain imports this module

    ctx.record(
        op=eqn.primitive.name,
        source=_source(eqn),
        scope=scope,
        category=category,
        in_before=_float_names([v.aval for v in eqn.invars]),
        in_after=_float_names([aval_of(x) for x in invals]),
        out_before=_float_names([v.aval for v in eqn.outvars]),
        out_after=_float_names([aval_of(x) for x in outs]),
        flops=flops(eqn),
    )


def rewrite_eqn(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    """Rewrites and binds one equation; returns its outputs."""
    from fmp._autocast._hops import HANDLERS  # local: _hops imports this module

    prim = eqn.primitive
    mode, policy = ctx.resolve(scope)
    if mode == "nested" or prim.name in OPAQUE or prim.name in EXACT_DTYPE:
        invals = restore(eqn, invals, ctx, scope)
        outs = bind(eqn, invals, eqn.params)
        _record_eqn(eqn, ctx, scope, "nested" if mode == "nested" else "opaque", invals, outs)
        return outs
    if mode == "override":
        invals = restore(eqn, invals, ctx, scope)
    handler = HANDLERS.get(prim)
    if handler is not None:
        sub = dataclasses.replace(ctx, policy=policy) if mode == "override" else ctx
        return handler(eqn, invals, sub, scope)
    if next(iter(jaxprs_in_params(eqn.params)), None) is not None:
        raise NotImplementedError(_MSG_UNHANDLED.format(name=prim.name))
    if prim is convert_element_type_p:
        return _user_cast(eqn, invals, ctx, scope)
    return _leaf(eqn, invals, ctx, scope, policy)


def _user_cast(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    """An explicit cast in the program is respected: its output dtype is kept."""
    (x,) = invals
    aval = aval_of(x)
    new_dtype = eqn.params["new_dtype"]
    if aval.dtype == new_dtype and aval.weak_type == eqn.params.get("weak_type", False):
        outs = [x]
    else:
        outs = bind(eqn, invals, eqn.params)
    _record_eqn(eqn, ctx, scope, "user_cast", invals, outs)
    return outs


def _leaf(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str, policy: Policy) -> list[Any]:
    prim = eqn.primitive
    category = ctx.rules.category(prim.name)
    cur = [aval_of(x) for x in invals]
    orig = [v.aval for v in eqn.invars]
    floats = [i for i, a in enumerate(cur) if hasattr(a, "dtype") and _is_castable(a.dtype)]
    # weak-typed values and scalar literals (Python numbers in the source) follow the other inputs
    follow = {i for i in floats if cur[i].weak_type or (isinstance(eqn.invars[i], Literal) and not cur[i].shape)}
    strong = [dtype_name(cur[i].dtype) for i in floats if i not in follow]
    compute = policy.compute_dtype.name
    if category is Category.BANNED and compute == "float16" and floats:
        raise ValueError(ctx.rules.banned_message(prim.name))
    target = decide(category, compute, strong)
    if category is Category.FLOAT8 and target is not None:
        if policy.fp8 is not None and len(floats) == len(invals) == 2:
            return _float8(eqn, invals, ctx, scope, policy)
        category = Category.LOWER_PRECISION  # no fp8 recipe: an ordinary lower_precision op
    rule = category.value
    if target not in (None, compute) and prim.name in ctx.rules.jax_epilogue and _is_epilogue(eqn, cur, ctx, compute):
        target, rule = compute, "epilogue"
    new = list(invals)
    if target is not None:
        new = [cast(x, target, ctx, eqn, scope) if i in floats else x for i, x in enumerate(invals)]
    else:
        changed = [i for i in floats if cur[i].dtype != orig[i].dtype]
        if changed:
            orig_set = {dtype_name(orig[i].dtype) for i in floats}
            if len(orig_set) == 1:
                unify = _dtypes.widest(strong) if strong else orig_set.pop()
                new = [cast(x, unify, ctx, eqn, scope) if i in floats else x for i, x in enumerate(invals)]
            else:
                new = [cast(x, orig[i].dtype, ctx, eqn, scope) if i in changed else x for i, x in enumerate(invals)]
    params = dict(eqn.params)
    if target is not None and params.get("preferred_element_type") is not None:
        params["preferred_element_type"] = _preferred(eqn, target)
    outs = bind(eqn, new, params)
    _record_eqn(eqn, ctx, scope, rule, new, outs)
    return outs


def _float8(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str, policy: Policy) -> list[Any]:
    """A float8-category op under a policy with an fp8 recipe: quantised from its inputs as they come."""
    recipe = policy.fp8
    compute = policy.compute_dtype.name
    out_dtype = compute if eqn.params.get("preferred_element_type") is None else _preferred(eqn, compute)
    out_dtype = np.dtype(jax.numpy.float32) if recipe.output == "float32" else out_dtype
    # delayed scaling: top-level dot_generals only (a loop body would share one history row)
    site = recipe.scaling == "delayed" and ctx.fp8_sites is not None and len(ctx.memos) == 1
    site = site and eqn.primitive.name == "dot_general"
    history = ctx.fp8_sites.take(f"{eqn.primitive.name}@{scope}") if site else None
    outs = [_fp8.bind_float8(eqn.primitive, invals, eqn.params, recipe, out_dtype, history)]
    if ctx.records is not None:
        from fmp._autocast._explain import flops  # local: explain imports this module

        ctx.record(
            op=eqn.primitive.name,
            source=_source(eqn),
            scope=scope,
            category=Category.FLOAT8.value,
            in_before=_float_names([v.aval for v in eqn.invars]),
            in_after=("float8_e4m3fn", "float8_e4m3fn"),
            out_before=_float_names([v.aval for v in eqn.outvars]),
            out_after=_float_names([aval_of(x) for x in outs]),
            flops=flops(eqn),
            detail=_fp8.scaling_label(recipe, eqn.primitive.name, site),
        )
    return outs


# Ops an epilogue operand is traced back through: they move or re-view a value
# without computing on it.
_PASS_THROUGH = frozenset({"reshape", "broadcast_in_dim", "convert_element_type", "squeeze", "transpose"})


def _root(var: Any, producers: Mapping[Any, JaxprEqn]) -> tuple[Any, JaxprEqn | None]:
    """Follows ``var`` back through pass-through ops; returns the root and the equation that made it."""
    while not isinstance(var, Literal):
        eqn = producers.get(var)
        if eqn is None or eqn.primitive.name not in _PASS_THROUGH:
            return var, eqn
        var = eqn.invars[0]
    return var, None


def _is_epilogue(eqn: JaxprEqn, cur: Sequence[Any], ctx: Context, compute: str) -> bool:
    """The epilogue rule: ``lp_result + bias`` (either order) runs in the compute dtype.

    True when the equation has two floating inputs, one of them is in the compute
    dtype now and comes (through pass-through ops, in this jaxpr) from a
    ``lower_precision`` equation, and the other comes from a value with fewer
    elements than the result (a bias broadcast over the batch).
    """
    if len(eqn.invars) != 2 or not all(hasattr(a, "dtype") and _is_castable(a.dtype) for a in cur):
        return False
    producers = ctx.producers[-1] if ctx.producers else {}
    size = int(np.prod(eqn.outvars[0].aval.shape, dtype=np.int64))
    for i in (0, 1):
        if dtype_name(cur[i].dtype) != compute:
            continue
        _, made = _root(eqn.invars[i], producers)
        if made is None or ctx.rules.category(made.primitive.name) not in (Category.LOWER_PRECISION, Category.FLOAT8):
            continue
        other, _ = _root(eqn.invars[1 - i], producers)
        if int(np.prod(other.aval.shape, dtype=np.int64)) < size:
            return True
    return False


def _preferred(eqn: JaxprEqn, target: str) -> Any:
    """dot/conv accumulation type: follows the compute dtype unless the program asked for another."""
    pet = np.dtype(eqn.params["preferred_element_type"])
    ins = {v.aval.dtype for v in eqn.invars if hasattr(v.aval, "dtype")}
    if ins == {pet}:  # jnp's default: accumulate in the input dtype
        return np.dtype(target)
    return pet


def autocast_jaxpr(
    closed_jaxpr: ClosedJaxpr,
    policy: str | Policy = "mixed_bfloat16",
    rules: RuleSet | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
) -> ClosedJaxpr:
    """Rewrites a closed jaxpr under a mixed-precision policy (the transform behind ``autocast``).

    Every equation is decided by the rule table from the dtypes its inputs have
    in the rewritten program: ``lower_precision`` ops (matmuls, convolutions) run
    in the policy's compute dtype, ``float32`` ops in float32, ``promote`` ops in
    their widest floating input, unlisted ops in the dtypes they are given. The
    epilogue rule (``rules.jax_epilogue``, default ``add``/``sub``) runs a bias
    add on a ``lower_precision`` op's result in the compute dtype. Loop carries
    take the dtypes of a fixed point of the body rewrite.
    float64, integer and boolean values are never cast, an explicit
    ``convert_element_type`` keeps its target, and ``jit``, ``scan``,
    ``while``, ``cond``, ``checkpoint``, ``custom_jvp``, ``custom_vjp`` and
    ``shard_map`` bodies are rewritten too (custom derivative rules are kept).

    Inputs keep their dtypes. Outputs that were float32 come back in the
    policy's ``output_dtype``; every other output keeps its original dtype.

    Args:
      closed_jaxpr: The program, e.g. from ``jax.make_jaxpr(f)(*args)``.
      policy: A policy spec or :class:`fmp.Policy`.
      rules: A :class:`fmp.RuleSet`; ``None`` means ``fmp.DEFAULT_RULES``.
      overrides: Optional ``{scope_substring: policy}``: equations whose name
        scope contains the substring run under that policy (the innermost match
        wins), with their inputs first returned to their original dtypes.

    Returns:
      A new ``ClosedJaxpr`` with the same input avals.

    Raises:
      ValueError: an op in the ``banned`` category runs under a float16 policy.
      NotImplementedError: a primitive carries a sub-jaxpr fmp cannot rewrite.

    Examples:
      >>> cj = jax.make_jaxpr(lambda x, w: jnp.tanh(x @ w))(jnp.ones((2, 3)), jnp.ones((3, 4)))
      >>> new = fmp.autocast_jaxpr(cj, "mixed_bfloat16")
      >>> [e.primitive.name for e in new.eqns]
      ['convert_element_type', 'convert_element_type', 'dot_general', 'tanh', 'convert_element_type']
      >>> new.out_avals[0].dtype
      dtype('float32')
    """
    if not isinstance(closed_jaxpr, ClosedJaxpr):
        raise TypeError(
            f"autocast_jaxpr(closed_jaxpr) expects a ClosedJaxpr (from jax.make_jaxpr), got {type(closed_jaxpr).__name__}"
        )
    ctx = Context(get_policy(policy), check_rules(rules), check_overrides(overrides))
    return rewrite_top(closed_jaxpr, ctx)


def _top_out_dtypes(closed: ClosedJaxpr, ctx: Context) -> list[Any]:
    """float32 outputs -> the policy's output dtype; other floating outputs keep their dtype."""
    return [
        ctx.policy.output_dtype if dtype_name(a.dtype) == "float32" else a.dtype if _is_castable(a.dtype) else None
        for a in closed.out_avals
    ]


def rewrite_top(closed: ClosedJaxpr, ctx: Context) -> ClosedJaxpr:
    """The rewritten program as a new closed jaxpr."""
    return _transform_closed(closed, closed.in_avals, ctx, "", _top_out_dtypes(closed, ctx))


def run_top(closed: ClosedJaxpr, args: Sequence[Any], ctx: Context) -> list[Any]:
    """Evaluates the rewritten program directly in the caller's trace (one trace fewer than
    ``jaxpr_as_fun(rewrite_top(...))``, with the same equations)."""
    outs = eval_jaxpr(closed.jaxpr, closed.consts, args, ctx, "")
    return [o if d is None else cast(o, d, ctx) for o, d in zip(outs, _top_out_dtypes(closed, ctx), strict=True)]


Handler = Callable[[JaxprEqn, list[Any], Context, str], list[Any]]
