"""Tracing and reading jaxprs: tracing at exact abstract values, call primitives, their bodies and params.

One of the three modules that use ``jax._src`` (see the package's docstring); each function names the JAX
versions it covers.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.linear_util as lu
from jax._src import api_util, core
from jax._src.core import Primitive
from jax._src.interpreters import partial_eval as pe
from jax._src.sharding_impls import UNSPECIFIED
from jax.extend.core import ClosedJaxpr

from fmp._autocast._engine._jax_version import warn_if_untested

warn_if_untested(jax.__version__)

__all__ = [
    "INLINE_WHEN_STAGED",
    "as_closed",
    "body_param",
    "inlined_when_staged",
    "is_call_primitive",
    "is_staging",
    "jit_params_with_input",
    "primitives_by_name",
    "trace_to_closed_jaxpr",
]

# What jit's ``inline`` param holds for a call JAX inlines when it stages it (jnp's helpers): jax 0.10 ``True``;
# jax 0.11 and 0.12 an ``Inline``, ``JAX_EARLY`` for those (a user's ``jit(inline=True)`` is ``JAX_LATE`` there,
# inlined only when lowered, so it stays a call in the jaxpr, and ``inline=False`` is ``AUTO``).
try:  # jax 0.11, 0.12
    from jax._src.api import Inline as _Inline

    INLINE_WHEN_STAGED: Any = _Inline.JAX_EARLY
except ImportError:  # jax 0.10
    INLINE_WHEN_STAGED = True


def inlined_when_staged(params: dict[str, Any]) -> bool:
    """Whether JAX inlines a ``jit`` equation with these params when it stages it into a jaxpr."""
    return params.get("inline", False) is INLINE_WHEN_STAGED


# Modules of JAX that define primitives a user program can hold; imported (if present) before
# ``primitives_by_name`` looks, so the answer does not depend on what the user imported first.
_PRIMITIVE_MODULES = (
    "jax._src.compute_on",
    "jax._src.core",
    "jax._src.custom_batching",
    "jax._src.custom_derivatives",
    "jax._src.custom_partitioning",
    "jax._src.custom_transpose",
    "jax._src.cudnn.fusion",
    "jax._src.export._export",
    "jax._src.hijax",
    "jax._src.lax.control_flow.solves",
    "jax._src.lax.eval_jaxpr",
    "jax._src.lax.fft",
    "jax._src.lax.lax",
    "jax._src.lax.linalg",
    "jax._src.lax.special",
    "jax._src.pallas.core",
    "jax._src.random.core",
    "jax._src.state.discharge",
    "jax._src.xla_metadata",
)


def _flat(*args: Any) -> Any:  # the signature the debug info of a rewritten body names
    return args


@functools.lru_cache(maxsize=512)
def _debug_info(name: str, n_args: int) -> Any:
    """The debug info of a flat function of ``n_args`` arguments, built once (JAX reads the function's
    signature for it, a cost paid per body otherwise)."""
    return api_util.debug_info(name, _flat, (0,) * n_args, {})


def is_staging(x: Any) -> bool:
    """Whether ``x`` is a value of a trace that stages a jaxpr (where an ``inline=True`` jit call is inlined).
    jax 0.10 to 0.12 alike."""
    return isinstance(x, pe.DynamicJaxprTracer)


def trace_to_closed_jaxpr(fun: Callable[..., Sequence[Any]], in_avals: Sequence[Any], name: str) -> ClosedJaxpr:
    """Traces ``fun`` (flat args -> flat list of outputs) at exactly ``in_avals``.

    jax 0.10 to 0.12 alike (``trace_to_jaxpr_dynamic`` returns the jaxpr, its out avals and its constants; on
    0.11 and 0.12 ``ClosedJaxpr(jaxpr, consts)`` attaches the constants to the jaxpr itself).
    """
    dbg = _debug_info(name, len(in_avals))
    wrapped = lu.wrap_init(lambda *args: list(fun(*args)), debug_info=dbg)
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
    return ClosedJaxpr(jaxpr, consts)


def jit_params_with_input(params: dict[str, Any]) -> dict[str, Any]:
    """A ``jit`` equation's params for one more (last) input, unsharded and not donated. jax 0.10 to 0.12
    alike."""
    return dict(
        params,
        in_shardings=(*params["in_shardings"], UNSPECIFIED),
        in_layouts=(*params["in_layouts"], None),
        donated_invars=(*params["donated_invars"], False),
    )


def as_closed(jaxpr: Any) -> ClosedJaxpr:
    """A body param (``remat``'s ``jaxpr``, ``call``'s ``call_jaxpr``) as a closed jaxpr.

    jax 0.10: an open ``Jaxpr``, closed here without constants. jax 0.11, 0.12: ``ClosedJaxpr`` is ``Jaxpr``
    (constants attached to the jaxpr), so the param is returned as it is, its constants kept.
    """
    return jaxpr if isinstance(jaxpr, ClosedJaxpr) else ClosedJaxpr(jaxpr, ())


def body_param(params: dict[str, Any]) -> str:
    """The name of the one param that holds a call-like primitive's body (a jaxpr).

    ``composite``: ``jaxpr`` on jax 0.10, ``call_jaxpr`` on jax 0.11 and 0.12; ``closed_call``/``call``:
    ``call_jaxpr``; jax 0.10's ``eval_jaxpr``: ``jaxpr``. Read from the params, so a rename is followed.
    """
    names = [k for k, v in params.items() if isinstance(v, ClosedJaxpr | core.Jaxpr)]
    if len(names) != 1:
        raise NotImplementedError(f"fmp.autocast: expected one body among the params, found {names or 'none'}")
    return names[0]


def _eval_jaxpr_primitive() -> Primitive | None:
    try:  # jax 0.10: its own primitive there; jax 0.11, 0.12: the same object as core's call primitive
        return importlib.import_module("jax._src.lax.eval_jaxpr").eval_jaxpr_p
    except (ImportError, AttributeError):  # pragma: no cover - depends on the JAX version
        return None


def is_call_primitive(prim: Primitive) -> bool:
    """Whether ``prim`` is a plain call of the jaxpr in its one body param: the equation's inputs are the body's
    inputs, its outputs the body's outputs, and no rule of its own depends on their dtypes.

    jax 0.10: ``core.CallPrimitive`` instances (``call``, whose body is open, and ``closed_call``), and the
    internal ``eval_jaxpr``. jax 0.11, 0.12: ``closed_call_p`` and ``call_p`` are ``eval_jaxpr``, and every
    primitive registered with its rules (``register_call_primitive_rules``: 0.11's ``program_order``, and those
    made with ``jax.extend.core.create_call_primitive``) shares its implementation.
    """
    call_cls = getattr(core, "CallPrimitive", None)
    if call_cls is not None and isinstance(prim, call_cls):
        return True
    ev = _eval_jaxpr_primitive()
    return ev is not None and (prim is ev or getattr(prim, "impl", None) is ev.impl)


def primitives_by_name() -> dict[str, Primitive]:
    """Every primitive object defined in a loaded ``jax`` module, by name (the first found wins).

    Some of ``_PRIMITIVE_MODULES`` exist only in some releases (``jax._src.lax.eval_jaxpr`` since 0.10, the call
    primitive's home from 0.11 on); a missing one is skipped.
    """
    for mod in _PRIMITIVE_MODULES:
        try:
            importlib.import_module(mod)
        except ImportError:  # pragma: no cover - depends on the JAX version and its optional parts
            pass
    out: dict[str, Primitive] = {}
    for name, module in sorted(sys.modules.items()):
        if module is None or not (name == "jax" or name.startswith("jax.")):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, Primitive):
                out.setdefault(value.name, value)
    return out
