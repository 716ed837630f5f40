"""Every use of unstable JAX internals (``jax._src``) in fmp lives in this module.

The autocast transform re-traces jaxprs with exact abstract values (shardings,
weak types and varying manual axes included), which no public API offers, and
re-binds ``shard_map``, whose primitive is not exported by ``jax.extend``.
Tested JAX range: 0.10.2 through 0.12.x (``TESTED_JAX``; ``pyproject.toml`` allows ``jax>=0.10.2,<0.13``); importing
fmp with another JAX warns once. When JAX moves one of these names or changes a primitive's params, this is the
only file to change: each function below names the JAX versions it covers.
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

from fmp._autocast._engine._jax_version import warn_if_untested

warn_if_untested(jax.__version__)

# The container shard_map's body function returns: jax 0.10 ``tree_util.FlatTree.flatten``; jax 0.11 and 0.12
# ``flattree.flatten`` (scan's ``ft_in``/``ft_out`` params are of the same module there).
try:  # jax 0.11, 0.12
    from jax._src import flattree as _ft

    _flatten_tree: Callable[[Any], Any] | None = _ft.flatten
except ImportError:  # jax 0.10
    _ft = None
    try:
        from jax._src.tree_util import FlatTree as _FlatTree

        _flatten_tree = _FlatTree.flatten
    except ImportError:  # pragma: no cover - depends on the JAX version
        _flatten_tree = None

__all__ = [
    "as_closed",
    "bind_shard_map",
    "body_param",
    "closed_call_p",
    "is_call_primitive",
    "inlined_when_staged",
    "jit_p",
    "primitives_by_name",
    "rewrap_bwd",
    "rewrap_rule_thunk",
    "scan_counts",
    "scan_params_with_xs",
    "shard_map_p",
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


def bind_shard_map(args: Sequence[Any], params: dict[str, Any], body: Callable[..., Sequence[Any]]) -> list[Any]:
    """Binds ``shard_map_p`` with ``params`` but ``body`` (flat args -> flat outs) as its body.

    shard_map traces ``body`` itself, inside its own mesh and axis context, so
    collectives in the body see their axis names. jax 0.10 to 0.12: the params (``mesh``, ``in_specs``,
    ``out_specs``, ``check_vma``, ``manual_axes``/``newly_manual_axes``) pass through as the equation has them;
    only the body changes, in the form ``shard_map_p.get_bind_params`` gives it.
    """
    if _flatten_tree is None:  # pragma: no cover - depends on the JAX version
        raise NotImplementedError("fmp.autocast: this JAX version's shard_map is not supported")
    flatten = _flatten_tree
    new_params = dict(params)
    jaxpr = new_params.pop("jaxpr")
    out_specs = new_params.pop("out_specs")

    def fun(*xs: Any) -> Any:
        return flatten(list(body(*xs))).with_aux(out_specs)

    new_params["subfuns"] = (fun,)
    new_params["debug_info"] = jaxpr.debug_info
    return list(shard_map_p.bind(*args, **new_params))


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


def scan_counts(params: dict[str, Any]) -> tuple[int, int]:
    """``(consts, carries)``: how many of a ``scan`` equation's inputs are loop-invariant and how many carried;
    the rest are the scanned ``xs``. The body's inputs and outputs are in the same order (outputs: carries, ys).

    jax 0.10: the params ``num_consts`` and ``num_carry``. jax 0.11, 0.12: ``ft_in``, a flat tree packing
    ``(consts, carry, xs)`` (``ft_out`` packs ``(carry, ys)``).
    """
    if "ft_in" in params:
        consts, carry, _ = params["ft_in"].unpack()
        return len(consts), len(carry)
    return params["num_consts"], params["num_carry"]


def scan_params_with_xs(params: dict[str, Any]) -> dict[str, Any]:
    """A ``scan`` equation's params for one more (last) scanned input, its body given one more last input.

    jax 0.10: nothing to add (``linear``, in releases that had it, gets one more ``False``). jax 0.11, 0.12:
    ``ft_in``'s ``xs`` part gets one more leaf.
    """
    out = dict(params)
    if "linear" in params:
        out["linear"] = (*params["linear"], False)
    if "ft_in" in params:
        consts, carry, xs = params["ft_in"].unpack()
        out["ft_in"] = _ft.pack((consts, carry, _ft.pack((xs, _ft.nones(1)))))
    return out


def rewrap_rule_thunk(thunk: Any, rewrite: Callable[[ClosedJaxpr], ClosedJaxpr]) -> Any:
    """Wraps a custom-derivative rule thunk so the jaxpr it returns is rewritten.

    ``custom_vjp_call``'s ``fwd_jaxpr_thunk`` returns ``(jaxpr, consts)`` and
    ``custom_jvp_call``'s ``jvp_jaxpr_fun`` returns ``(jaxpr, consts, out_zeros)``;
    JAX evaluates the jaxpr with the consts. The wrapper keeps that contract (jax 0.10 to 0.12 alike).
    """

    def wrapped(*zeros: Any) -> Any:
        jaxpr, consts, *rest = thunk.call_wrapped(*zeros)
        new = rewrite(ClosedJaxpr(jaxpr, consts))
        return (new.jaxpr, new.consts, *rest)

    return lu.wrap_init(wrapped, debug_info=thunk.debug_info)


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


# Whether a custom_vjp's flat bwd returns ``(cotangents, logs)``: jax 0.11 and 0.12 (``defvjp_with_logs``); jax 0.10
# returns the flat cotangents alone.
_BWD_RETURNS_LOGS = hasattr(jax.custom_vjp, "defvjp_with_logs")


def rewrap_bwd(bwd: Any, run: Callable[[Callable[..., Any], Sequence[Any]], list[Any]]) -> Any:
    """Wraps a custom_vjp ``bwd`` (a ``WrappedFun`` of flat residuals and cotangents) so that ``run(call, args)``
    evaluates it; ``call(*args)`` calls the original and returns a flat list (cotangents, which may hold symbolic
    zeros, then the leaves of the backward-pass logs where the JAX version has them).

    jax 0.10: the bwd returns the flat cotangents. jax 0.11, 0.12: it returns ``(cotangents, logs)``, ``logs``
    None or a dict of arrays (``custom_vjp.defvjp_with_logs``); the wrapper returns the same pair.
    """
    if not _BWD_RETURNS_LOGS:  # jax 0.10

        def wrapped(*args: Any) -> Any:
            return run(bwd.call_wrapped, args)

        return lu.wrap_init(wrapped, debug_info=bwd.debug_info)

    def wrapped_with_logs(*args: Any) -> Any:
        shape: list[Any] = []  # [number of cotangents, tree of the logs], set by each call

        def call(*xs: Any) -> list[Any]:
            cts, logs = bwd.call_wrapped(*xs)
            leaves, tree = jax.tree.flatten(logs)
            shape[:] = [len(cts), tree]
            return [*cts, *leaves]

        outs = run(call, args)
        n, tree = shape
        return list(outs[:n]), jax.tree.unflatten(tree, outs[n:])

    return lu.wrap_init(wrapped_with_logs, debug_info=bwd.debug_info)


def user_function(wrapped: Any) -> Any:
    """The user's function inside a ``WrappedFun`` (the custom_vjp bwd rule as written).

    jax 0.10 to 0.12: ``wrapped.f``; jax 0.12's ``custom_vjp.defvjp_with_accums`` holds it one level deeper, in
    the flat rule's ``bwd`` (a ``functools.partial`` when the custom_vjp has ``nondiff_argnums``).
    """
    f = getattr(wrapped, "f", None)
    if hasattr(f, "call_with_accums"):  # jax 0.12: a rule written with accumulators
        f = getattr(f, "bwd", f)
    return getattr(f, "func", f) if isinstance(f, functools.partial) else f


# --- keeping jnp's inline helpers as calls while autocast traces a function --------------------------------------
# JAX inlines a jnp helper's jit call (``INLINE_WHEN_STAGED``) when it stages it into a jaxpr; no public switch
# keeps it. While ``keep_inline_calls`` is active, the staging rule below records such a call as a ``jit``
# equation instead, but only in the one trace that was current when it was entered (the trace of the user's
# function, not the traces of helper bodies or loop bodies inside it). Every other trace stages as JAX does.
_KEEP = threading.local()
_STAGE_JIT = pe.custom_staging_rules[jit_p]


def _stage_jit(trace: Any, source_info: Any, *args: Any, **params: Any) -> Any:
    if (
        inlined_when_staged(params)
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
    """Within this block, the current trace keeps jit calls JAX would inline as equations. jax 0.10 to 0.12:
    ``pe.custom_staging_rules[jit_p]`` stages a jit call, ``core.trace_ctx.trace`` is the current trace."""
    prev = getattr(_KEEP, "trace", None)
    _KEEP.trace = core.trace_ctx.trace
    try:
        yield
    finally:
        _KEEP.trace = prev


def staged_call_params(jitted: Callable[[Any], Any], aval: Any) -> dict[str, Any] | None:
    """The params of the ``jit`` equation ``jitted(x)`` stages for an input of ``aval`` (None: it stages
    something else), so the call can be bound again without re-deriving them. jax 0.10 to 0.12 alike."""

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
