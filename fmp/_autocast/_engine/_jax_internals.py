"""Every use of unstable JAX internals (``jax._src``) in fmp lives in this module.

The autocast transform re-traces jaxprs with exact abstract values (shardings,
weak types and varying manual axes included), which no public API offers, and
re-binds ``shard_map``, whose primitive is not exported by ``jax.extend``.
Supported JAX range: see ``pyproject.toml`` (``jax>=0.10.2,<0.11``); importing fmp with a newer JAX warns. When JAX
moves one of these names, this is the only file to change.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.extend.linear_util as lu
from jax._src import api_util, core
from jax._src.core import Primitive
from jax._src.interpreters import partial_eval as pe
from jax._src.shard_map import shard_map_p
from jax._src.sharding_impls import UNSPECIFIED
from jax.extend.core import ClosedJaxpr
from jax.extend.core.primitives import closed_call_p, jit_p

_TESTED_BELOW = (0, 11)
if tuple(int(p) for p in jax.__version__.split(".")[:2]) >= _TESTED_BELOW:  # pragma: no cover - CI runs 0.10
    import warnings

    warnings.warn(
        f"fmp is tested with jax 0.10.x and this is jax {jax.__version__}: under fmp.autocast, scan, fori_loop, "
        "shard_map and custom_vjp bodies are known to fail on jax 0.11 (with an error). Install jax<0.11 for a "
        "tested combination.",
        RuntimeWarning,
        stacklevel=2,
    )

try:  # FlatTree: the container shard_map's body function returns since JAX 0.10
    from jax._src.tree_util import FlatTree
except ImportError:  # pragma: no cover - depends on the JAX version
    FlatTree = None  # type: ignore[assignment,misc]

__all__ = [
    "bind_shard_map",
    "closed_call_p",
    "jit_p",
    "primitives_by_name",
    "rewrap_bwd",
    "rewrap_rule_thunk",
    "shard_map_p",
    "trace_to_closed_jaxpr",
]

# Modules of JAX that define primitives a user program can hold; imported (if present) before
# ``primitives_by_name`` looks, so the answer does not depend on what the user imported first.
_PRIMITIVE_MODULES = (
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
)


def _flat(*args: Any) -> Any:  # the signature the debug info of a rewritten body names
    return args


@functools.lru_cache(maxsize=512)
def _debug_info(name: str, n_args: int) -> Any:
    """The debug info of a flat function of ``n_args`` arguments, built once (JAX reads the function's
    signature for it, a cost paid per body otherwise)."""
    return api_util.debug_info(name, _flat, (0,) * n_args, {})


def is_staging(x: Any) -> bool:
    """Whether ``x`` is a value of a trace that stages a jaxpr (where an ``inline=True`` jit call is inlined)."""
    return isinstance(x, pe.DynamicJaxprTracer)


def trace_to_closed_jaxpr(fun: Callable[..., Sequence[Any]], in_avals: Sequence[Any], name: str) -> ClosedJaxpr:
    """Traces ``fun`` (flat args -> flat list of outputs) at exactly ``in_avals``."""
    dbg = _debug_info(name, len(in_avals))
    wrapped = lu.wrap_init(lambda *args: list(fun(*args)), debug_info=dbg)
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
    return ClosedJaxpr(jaxpr, consts)


def bind_shard_map(args: Sequence[Any], params: dict[str, Any], body: Callable[..., Sequence[Any]]) -> list[Any]:
    """Binds ``shard_map_p`` with ``params`` but ``body`` (flat args -> flat outs) as its body.

    shard_map traces ``body`` itself, inside its own mesh and axis context, so
    collectives in the body see their axis names.
    """
    if FlatTree is None:  # pragma: no cover - depends on the JAX version
        raise NotImplementedError("fmp.autocast: this JAX version's shard_map is not supported")
    new_params = dict(params)
    jaxpr = new_params.pop("jaxpr")
    out_specs = new_params.pop("out_specs")

    def fun(*xs: Any) -> Any:
        return FlatTree.flatten(list(body(*xs))).with_aux(out_specs)

    new_params["subfuns"] = (fun,)
    new_params["debug_info"] = jaxpr.debug_info
    return list(shard_map_p.bind(*args, **new_params))


def jit_params_with_input(params: dict[str, Any]) -> dict[str, Any]:
    """A ``jit`` equation's params for one more (last) input, unsharded and not donated."""
    return dict(
        params,
        in_shardings=(*params["in_shardings"], UNSPECIFIED),
        in_layouts=(*params["in_layouts"], None),
        donated_invars=(*params["donated_invars"], False),
    )


def rewrap_rule_thunk(thunk: Any, rewrite: Callable[[ClosedJaxpr], ClosedJaxpr]) -> Any:
    """Wraps a custom-derivative rule thunk so the jaxpr it returns is rewritten.

    ``custom_vjp_call``'s ``fwd_jaxpr_thunk`` returns ``(jaxpr, consts)`` and
    ``custom_jvp_call``'s ``jvp_jaxpr_fun`` returns ``(jaxpr, consts, out_zeros)``;
    JAX evaluates the jaxpr with the consts. The wrapper keeps that contract.
    """

    def wrapped(*zeros: Any) -> Any:
        jaxpr, consts, *rest = thunk.call_wrapped(*zeros)
        new = rewrite(ClosedJaxpr(jaxpr, consts))
        return (new.jaxpr, new.consts, *rest)

    return lu.wrap_init(wrapped, debug_info=thunk.debug_info)


def primitives_by_name() -> dict[str, Primitive]:
    """Every primitive object defined in a loaded ``jax`` module, by name (the first found wins)."""
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


def rewrap_bwd(bwd: Any, run: Callable[[Callable[..., Any], Sequence[Any]], list[Any]]) -> Any:
    """Wraps a custom_vjp ``bwd`` (a ``WrappedFun``: flat residuals and cotangents -> flat cotangents, which
    may hold symbolic zeros) so that ``run(call, args)`` evaluates it; ``call(*args)`` calls the original."""

    def wrapped(*args: Any) -> Any:
        return run(bwd.call_wrapped, args)

    return lu.wrap_init(wrapped, debug_info=bwd.debug_info)


def user_function(wrapped: Any) -> Any:
    """The user's function inside a ``WrappedFun`` (the custom_vjp bwd rule as written)."""
    return getattr(wrapped, "f", None)


# --- keeping jnp's inline helpers as calls while autocast traces a function --------------------------------------
# JAX inlines a ``jit(..., inline=True)`` call (jnp's helpers) when it stages it into a jaxpr; no public switch
# keeps it. While ``keep_inline_calls`` is active, the staging rule below records such a call as a ``jit``
# equation instead, but only in the one trace that was current when it was entered (the trace of the user's
# function, not the traces of helper bodies or loop bodies inside it). Every other trace stages as JAX does.
_KEEP = threading.local()
_STAGE_JIT = pe.custom_staging_rules[jit_p]


def _stage_jit(trace: Any, source_info: Any, *args: Any, **params: Any) -> Any:
    if (
        params.get("inline")
        and getattr(_KEEP, "trace", None) is trace
        and _jax_own(params["jaxpr"])
        and _plain_body(params["jaxpr"])
    ):
        return trace.default_process_primitive(jit_p, args, params, source_info=source_info)
    return _STAGE_JIT(trace, source_info, *args, **params)


_JAX_DIR = " at " + os.path.dirname(os.path.abspath(jax.__file__)) + os.sep


def _jax_own(closed: ClosedJaxpr) -> bool:
    """A helper defined by JAX itself (jnp's, jax.nn's), not a user's own ``jit(..., inline=True)``
    function, which is inlined as JAX does."""
    info = closed.jaxpr.debug_info
    return info is not None and _JAX_DIR in (info.func_src_info or "")


def _plain_body(closed: ClosedJaxpr) -> bool:
    """No mutable references among the body's constants or inputs (JAX's own staging handles those)."""
    if any(isinstance(c, core.Ref) for c in closed.consts):
        return False
    return not any(getattr(v, "initial_qdd", None) for v in (*closed.jaxpr.constvars, *closed.jaxpr.invars))


pe.custom_staging_rules[jit_p] = _stage_jit


@contextlib.contextmanager
def keep_inline_calls() -> Iterator[None]:
    """Within this block, the current trace keeps ``inline=True`` jit calls as equations."""
    prev = getattr(_KEEP, "trace", None)
    _KEEP.trace = core.trace_ctx.trace
    try:
        yield
    finally:
        _KEEP.trace = prev


def staged_call_params(jitted: Callable[[Any], Any], aval: Any) -> dict[str, Any] | None:
    """The params of the ``jit`` equation ``jitted(x)`` stages for an input of ``aval`` (None: it stages
    something else), so the call can be bound again without re-deriving them."""

    def fun(x: Any) -> list[Any]:
        with keep_inline_calls():
            return [jitted(x)]

    closed = trace_to_closed_jaxpr(fun, [aval], "fmp.autocast")
    eqns = closed.jaxpr.eqns
    if closed.consts or len(eqns) != 1 or eqns[0].primitive is not jit_p:
        return None
    if list(eqns[0].invars) != list(closed.jaxpr.invars) or list(eqns[0].outvars) != list(closed.jaxpr.outvars):
        return None
    return dict(eqns[0].params)


def restaged_call_params(params: dict[str, Any], fun: Callable[[Any], Any], aval: Any) -> dict[str, Any]:
    """``params`` (from ``staged_call_params`` of ``jit(fun)`` at another shape) with ``fun``'s body traced
    for ``aval``: a one-input, one-output call without explicit shardings differs only in its body."""
    return dict(params, jaxpr=trace_to_closed_jaxpr(lambda x: [fun(x)], [aval], params["name"]))
