"""What ``fmp.autocast`` refuses or warns about: arguments it cannot see, and a policy that changes nothing.

A policy is silently a no-op when the traced program holds no value it may cast (float16, bfloat16, float32):
a float64 model, an integer-only function, or a function whose arrays are another framework's (torch tensors
are not JAX values: they would reach ``fn`` as static arguments and run, untouched, in torch). An
``overrides`` key is a no-op when no named scope in the program contains it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, jaxprs_in_params

from fmp._arrays import foreign_kind
from fmp._autocast._engine._context import dtype_name
from fmp._core import _dtypes, _scopes
from fmp._policy import Policy

_MSG_FOREIGN_ARG = (
    "{api}: argument {where} is a {kind}, not a JAX array: fmp.autocast rewrites JAX programs, and "
    "this value would reach the function as a static Python object and run outside the policy. For torch "
    "code use fmp.torch.autocast (torch.autocast's API) or fmp.torch.autocast_fx; to run JAX on it, "
    "convert it first (jnp.asarray(x), or jax.dlpack.from_dlpack(x) to share memory)."
)

_MSG_NO_EFFECT = (
    "fmp.autocast(policy={policy!r}) changes nothing in this function: it computes no float16, bfloat16 or "
    "float32 value ({found}), and autocast never casts float64, integer or bool values. {hint}"
)
_HINT_F64 = (
    "Build the model in float32 (float64 appears when jax_enable_x64 is on and arrays are created without a "
    "dtype), e.g. params = fmp.cast_tree(params, jnp.float32), or drop the autocast."
)
_HINT_OTHER = "Wrap the function that does the floating-point work, or drop the autocast."

_MSG_OVERRIDE_UNUSED = (
    "fmp.autocast: overrides key {key!r} matches no jax.named_scope in the traced function, so it changes "
    "nothing. Keys are case-sensitive parts of the scope paths, never cut inside a number (flax linen opens "
    "one per module: 'Dense_0', 'LayerNorm_0'; an nnx argument's submodules run under their paths: 'blocks/0/attn'); scopes seen: {seen}."
)


def check_args(args: tuple, kwargs: dict, api: str = "fmp.autocast") -> None:
    """Raises TypeError if an argument leaf is another framework's array."""
    for path, leaf in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
        kind = foreign_kind(leaf)
        if kind is not None:
            where = _arg_name(path)
            raise TypeError(_MSG_FOREIGN_ARG.format(api=api, where=where, kind=kind))


def _arg_name(path: tuple) -> str:
    # path[0] picks args (0) or kwargs (1); path[1] the position or the keyword; the rest is inside it
    kind, first, rest = path[0].idx, path[1], jax.tree_util.keystr(path[2:])
    if kind == 0:
        return f"positional argument {first.idx}{rest}"
    return f"keyword argument {first.key!r}{rest}"


def nested_jaxprs(jaxpr: Jaxpr, prefix: str = "") -> Iterator[tuple[Jaxpr, str]]:
    """``jaxpr`` and every jaxpr nested in its equations (loop and branch bodies, remat, custom rules), each with
    the name scope it sits under."""
    yield jaxpr, prefix
    for eqn in jaxpr.eqns:
        own = str(eqn.source_info.name_stack)
        scope = f"{prefix}/{own}" if prefix and own else (prefix or own)
        for sub in jaxprs_in_params(eqn.params):
            yield from nested_jaxprs(sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub, scope)


def _dtypes_and_scopes(closed: ClosedJaxpr, need_scopes: bool = True) -> tuple[set[str], set[str]]:
    """The dtype names and the name scopes in ``closed``; without ``need_scopes`` the walk stops at the first
    castable dtype (all the no-op check needs), so a model's every call does not pay a full walk."""
    names: set[str] = set()
    scopes: set[str] = set()
    for jaxpr, prefix in nested_jaxprs(closed.jaxpr):
        for v in [*jaxpr.invars, *jaxpr.constvars, *jaxpr.outvars]:
            if hasattr(getattr(v, "aval", None), "dtype"):
                names.add(dtype_name(v.aval.dtype))
        if not need_scopes and names & _dtypes.CASTABLE:
            return names, scopes
        for eqn in jaxpr.eqns:
            for v in [*eqn.invars, *eqn.outvars]:
                if hasattr(getattr(v, "aval", None), "dtype"):
                    names.add(dtype_name(v.aval.dtype))
            if need_scopes:
                own = str(eqn.source_info.name_stack)
                scope = f"{prefix}/{own}" if prefix and own else (prefix or own)
                if scope:
                    scopes.add(scope)
            elif names & _dtypes.CASTABLE:
                return names, scopes
    return names, scopes


def warn_no_effect(closed: ClosedJaxpr, policy: Policy, overrides: tuple[tuple[str, Policy], ...], label: str) -> None:
    """Warns (UserWarning, stacklevel pointing at the caller of the wrapped function) about a no-op policy
    or an override key that matches nothing; ``label`` is the policy as the user wrote it."""
    names, scopes = _dtypes_and_scopes(closed, need_scopes=bool(overrides))
    if policy.compute_dtype.name != "float32" and not names & _dtypes.CASTABLE:
        floats = sorted(n for n in names if n.startswith(("float", "bfloat")))
        found = f"its floating values are {', '.join(floats)}" if floats else "it has no floating values"
        hint = _HINT_F64 if "float64" in floats else _HINT_OTHER
        warnings.warn(_MSG_NO_EFFECT.format(policy=label, found=found, hint=hint), UserWarning, stacklevel=3)
    for key, _ in overrides:
        if _scopes.is_location(key):  # a source location, not a scope: checked by the rows it selects
            continue
        if not any(_scopes.matches(s, key) for s in scopes):
            seen = ", ".join(repr(s) for s in sorted(scopes)[:8]) + (" ..." if len(scopes) > 8 else "")
            warnings.warn(_MSG_OVERRIDE_UNUSED.format(key=key, seen=seen or "none"), UserWarning, stacklevel=3)
