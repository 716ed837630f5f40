"""The rules for first-order equations: the rule table's decision, the epilogue rule, user casts.

``leaf`` is what the interpreter (``_interp``) runs for every equation that
carries no sub-jaxpr: it casts the inputs as the rule table decides (from the
dtypes they have in the rewritten program), with refinements that need the
equation's shapes and the program around it: a contraction that sums one
element per output is decided as ``mul`` (``RuleSet.jax_uncontracted``), a
bias added to a linear layer's result stays in the compute dtype (the epilogue
rule), an op never casts a constant into a dtype that cannot hold it, and a jnp
reduction's own rounding of a float32 statistic back to a low-precision dtype
is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from jax.extend.core import JaxprEqn, Literal
from jax.extend.core.primitives import convert_element_type_p

from fmp._autocast._engine import _constants
from fmp._autocast._engine._cast import cast, round_once
from fmp._autocast._engine._context import Context, aval_of, dtype_name, is_castable, is_scalar_constant, record_eqn
from fmp._autocast._engine._dims import contracted_size
from fmp._autocast._engine._interp import bind
from fmp._autocast._engine._provenance import BIAS, NOT_LOW, TANGENT, epilogue_sides, weight_of
from fmp._autocast._float8 import float8
from fmp._core import _dtypes
from fmp._core._rules import OVERRIDE, Category, decide, joined, moved
from fmp._policy import Policy


def leaf(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str, policy: Policy) -> list[Any]:
    """Rewrites and binds one first-order equation under ``policy``."""
    if eqn.primitive is convert_element_type_p:
        return _user_cast(eqn, invals, ctx, scope)
    return _decided(eqn, invals, ctx, scope, policy)


_STATISTICS_FILE = "jax/_src/numpy/reductions.py"


def _is_statistic_rounding(eqn: JaxprEqn, dtype: Any) -> bool:
    """A float32 -> low-precision cast that a jnp reduction wrote (``jnp.sum``/``mean``/``var``/``std``...
    of a low-precision array accumulate in float32 and round the result back): it is dropped, so the
    statistic stays float32, as torch's autocast returns float32 from its float32-list reductions."""
    if dtype_name(dtype) != "float32" or dtype_name(eqn.params["new_dtype"]) not in _dtypes.LOW_PRECISION:
        return False
    tb = eqn.source_info.traceback
    if tb is None:
        return False
    return any(f.file_name.replace("\\", "/").endswith(_STATISTICS_FILE) for f in tb.frames)


def _user_cast(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str) -> list[Any]:
    """An explicit cast in the program is respected: its output dtype is kept (except a jnp reduction's own
    rounding of a float32 statistic back to a low-precision dtype, see ``_is_statistic_rounding``)."""
    (x,) = invals
    aval = aval_of(x)
    new_dtype = eqn.params["new_dtype"]
    rule = "user_cast"
    if aval.dtype == new_dtype and aval.weak_type == eqn.params.get("weak_type", False):
        outs = [x]
    elif is_scalar_constant(x) and is_castable(new_dtype):
        # a scalar constant (a literal passed into an inlined helper): folded, as JAX folds it when it inlines
        outs = [float(x) if eqn.params.get("weak_type", False) else np.asarray(x, dtype=new_dtype)]
    elif _is_statistic_rounding(eqn, aval.dtype):
        outs, rule = [x], "statistic"
    else:
        outs = [round_once(o, aval.dtype) for o in bind(eqn, invals, eqn.params)]
    record_eqn(eqn, ctx, scope, rule, invals, outs)
    return outs


class Decision(NamedTuple):
    """The rule table's decision for one equation, from its inputs' types (``_decision``)."""

    category: Category  # the op's rule (a contraction that sums one element per output: ``mul``'s)
    detail: str  # why the rule is not the op's own, or ""
    floats: list[int]  # the positions of its castable floating inputs
    strong: list[str]  # the dtypes the decision reads (``_strong``)
    target: str | None  # the dtype the floating inputs are cast to, or None to leave them


def _decision(eqn: JaxprEqn, avals: Sequence[Any], scalar: list[bool], ctx: Context, compute: str) -> Decision:
    """The decision ``_decided`` (on the rewritten program's types) and ``keeps`` (on the original ones) both
    read: ``scalar`` marks the inputs that are scalar constants (Python numbers in the source)."""
    category, detail = ctx.rules.category(eqn.primitive.name), ""
    if eqn.primitive.name in ctx.rules.jax_uncontracted and contracted_size(eqn) == 1:
        category = ctx.rules.category("mul")
        detail = "sums one element per output: an elementwise product, decided as mul"
    floats = [i for i, a in enumerate(avals) if hasattr(a, "dtype") and is_castable(a.dtype)]
    strong = _strong(category, avals, floats, scalar)
    return Decision(category, detail, floats, strong, decide(category, compute, strong))


def _decided(eqn: JaxprEqn, invals: list[Any], ctx: Context, scope: str, policy: Policy) -> list[Any]:
    prim = eqn.primitive
    cur = [aval_of(x) for x in invals]
    orig = [v.aval for v in eqn.invars]
    compute = policy.compute_dtype.name
    category, detail, floats, strong, target = _decision(
        eqn, cur, [is_scalar_constant(x) for x in invals], ctx, compute
    )
    if category is Category.BANNED and compute == "float16" and floats:
        raise ValueError(ctx.rules.banned_message(prim.name))
    why = ""
    if category is Category.FLOAT8:
        if target is not None and policy.float8 is not None and len(floats) == len(invals) == 2:
            why = _float8_scope(eqn, ctx, policy)
            if not why.startswith((_ACTIVATIONS, _TANGENTS)):
                out = compute if eqn.params.get("preferred_element_type") is None else _preferred(eqn, compute)
                return float8(eqn, invals, ctx, scope, policy, out, why)
        # no float8 recipe, nothing to cast (float64 inputs), or two activations: an ordinary lower_precision op
        category = Category.LOWER_PRECISION
    rule = category.value
    if target not in (None, compute) and prim.name in ctx.rules.jax_epilogue:
        verdict = _epilogue(eqn, cur, ctx, compute)
        if verdict == BIAS:
            target, rule, detail = compute, "epilogue", "a bias along the output features"
        elif verdict:
            detail = f"no epilogue: {verdict}"
    new = list(invals)
    if target is not None:
        target, detail = _holding_constants(eqn, cur, floats, target, ctx, detail)
        if rule == "epilogue" and target != compute:
            rule = category.value  # a constant kept it out of the compute dtype
        new = [cast(x, target, ctx, eqn, scope) if i in floats else x for i, x in enumerate(invals)]
    else:
        changed = [i for i in floats if cur[i].dtype != orig[i].dtype]
        if changed:
            orig_set = {dtype_name(orig[i].dtype) for i in floats}
            if len(orig_set) == 1:
                unify = _dtypes.widest(strong) if strong else orig_set.pop()
                unify, detail = _holding_constants(eqn, cur, floats, unify, ctx, detail)
                new = [cast(x, unify, ctx, eqn, scope) if i in floats else x for i, x in enumerate(invals)]
            else:
                new = [cast(x, orig[i].dtype, ctx, eqn, scope) if i in changed else x for i, x in enumerate(invals)]
    by_rules = moved(ctx.rules, prim.name)
    if by_rules:
        rule, detail = OVERRIDE, joined(by_rules, detail)
    params = dict(eqn.params)
    if target is not None and params.get("preferred_element_type") is not None:
        params["preferred_element_type"] = _preferred(eqn, target)
    outs = bind(eqn, new, params)
    record_eqn(eqn, ctx, scope, rule, new, outs, detail=detail, why=why)
    return outs


def _strong(category: Category, avals: Sequence[Any], floats: list[int], scalar: list[bool]) -> list[str]:
    """The dtypes an op's decision reads: its floating inputs', less the followers. Weak-typed values and
    scalar literals (Python numbers in the source) follow the other inputs, as in JAX's promotion. A matmul
    or convolution whose floating inputs are all weak-typed arrays (``jnp.full(shape, 2.0)``,
    ``jnp.arange(n) * 0.5``) has nothing to follow: it still runs in the policy's dtype, so their type counts."""
    follow = {i for i in floats if avals[i].weak_type or scalar[i]}
    strong = [dtype_name(avals[i].dtype) for i in floats if i not in follow]
    if not strong and category in (Category.LOWER_PRECISION, Category.FLOAT8):
        strong = [dtype_name(avals[i].dtype) for i in floats if not scalar[i] and avals[i].shape]
    return strong


def keeps(eqn: JaxprEqn, ctx: Context, policy: Policy) -> bool:
    """Whether ``leaf`` binds ``eqn`` exactly as written when its inputs have the original program's types.

    The same decision as ``_decided`` (``_decision``), read off the original types: no input is cast and no
    parameter changes. Conservative: a cast the program wrote between float32 and a low-precision type, a
    float8 or banned op, and a literal cast are not kept.
    """
    avals = [v.aval for v in eqn.invars]
    if eqn.primitive is convert_element_type_p:
        names = {dtype_name(avals[0].dtype), dtype_name(eqn.params["new_dtype"])}
        return not isinstance(eqn.invars[0], Literal) and not names & _dtypes.LOW_PRECISION
    scalar = [isinstance(v, Literal) for v in eqn.invars]
    category, _, floats, _, target = _decision(eqn, avals, scalar, ctx, policy.compute_dtype.name)
    if category in (Category.FLOAT8, Category.BANNED):
        return False
    if target is None:
        return True
    if (
        eqn.params.get("preferred_element_type") is not None
        and _preferred(eqn, target) != eqn.params["preferred_element_type"]
    ):
        return False
    # every input already in the target type (so the epilogue rule, which needs an input in the compute
    # dtype and a target other than it, cannot apply either)
    return all(dtype_name(avals[i].dtype) == target for i in floats)


_ACTIVATIONS = "activation x activation"
_TANGENTS = "a tangent of a custom_jvp rule"


def _float8_scope(eqn: JaxprEqn, ctx: Context, policy: Policy) -> str:
    """Why a float8-category op runs in float8 or not (the float8 scope rule, ``_weights``), for explain:
    ``"weight operand (rhs: input 1)"``, ``"activations=True"`` or ``"activation x activation (...)"``."""
    frame = ctx.frames[-1] if ctx.frames else None
    if policy.float8.activations and (frame is None or not frame.tangents):
        return "activations=True"
    named = [weight_of(var, frame) if frame is not None else None for var in eqn.invars]
    if TANGENT in named:
        return _TANGENTS
    if policy.float8.activations:
        return "activations=True"
    for side, label in reversed(list(zip(("lhs", "rhs"), named, strict=False))):
        if label is not None:
            return f"weight operand ({side}: {label})"
    return f"{_ACTIVATIONS} (Float8Recipe(activations=True) puts it in float8)"


def _epilogue(eqn: JaxprEqn, cur: Sequence[Any], ctx: Context, compute: str) -> str:
    """The epilogue rule: ``lp_result + bias`` (either order) runs in the compute dtype.

    ``BIAS`` when the equation has two floating inputs, one of them is in the
    compute dtype now and is the result of a linear layer's product or a
    convolution (through pass-through ops, across jnp's helper calls), and the
    other is a bias of it (``_provenance.epilogue_sides``); else ``""`` when no
    such result takes part, or why the other operand is no bias.
    """
    if len(eqn.invars) != 2 or not all(hasattr(a, "dtype") and is_castable(a.dtype) for a in cur):
        return ""
    if not ctx.frames:
        return ""
    frame = ctx.frames[-1]
    sides = frame.hints.get(id(eqn)) or epilogue_sides(eqn, frame, lambda name: ctx.rules.category(name) in _LOW)
    low = [v for i, v in enumerate(sides) if v != NOT_LOW and dtype_name(cur[i].dtype) == compute]
    return BIAS if BIAS in low else (low[0] if low else "")


def _holding_constants(
    eqn: JaxprEqn, cur: Sequence[Any], floats: Sequence[int], target: str, ctx: Context, detail: str
) -> tuple[str, str]:
    """``target``, widened to the dtype of any input that is a constant ``target`` cannot hold.

    A value known while tracing (``_constants.bound``: ``finfo(float32).min``,
    ``-1e9`` under float16, a closed-over mask) that would round to infinity
    in ``target`` is not cast into it: the op runs in the constant's dtype
    instead, as the program wrote it. Runtime values are cast as decided, so
    an activation or gradient that overflows still becomes inf (what loss
    scaling detects).
    """
    if not ctx.frames:
        return target, detail
    for i in floats:
        have = dtype_name(cur[i].dtype)
        if have == target or _dtypes.widest([have, target]) == target:
            continue
        magnitude = _constants.bound(eqn.invars[i], ctx.frames[-1])
        if magnitude is not None and _constants.overflows(magnitude, target):
            detail = f"a constant of magnitude {magnitude:.3g} overflows {target}: not cast into it"
            target = _dtypes.widest([have, target])
    return target, detail


_LOW = (Category.LOWER_PRECISION, Category.FLOAT8)


def _preferred(eqn: JaxprEqn, target: str) -> Any:
    """dot/conv accumulation type: follows the compute dtype unless the program asked for another."""
    pet = np.dtype(eqn.params["preferred_element_type"])
    ins = {v.aval.dtype for v in eqn.invars if hasattr(v.aval, "dtype")}
    if ins == {pet}:  # jnp's default: accumulate in the input dtype
        return np.dtype(target)
    return pet
