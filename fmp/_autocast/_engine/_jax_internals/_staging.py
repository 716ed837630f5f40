"""Keeping jnp's inline helpers as calls while autocast traces a function: fmp's one change to a JAX rule.

JAX inlines a jnp helper's jit call (``INLINE_WHEN_STAGED``) when it stages it into a jaxpr; no public switch
keeps it. While ``keep_inline_calls`` is active, the staging rule below records such a call as a ``jit``
equation instead, but only in the one trace that was current when it was entered (the trace of the user's
function, not the traces of helper bodies or loop bodies inside it). Every other trace stages as JAX does.

The rule is put in front of JAX's own (``pe.custom_staging_rules[jit_p]``) by the first ``keep_inline_calls``,
not at import: ``import fmp`` leaves JAX's rules as they were. Installing it late caches nothing wrongly: JAX
looks the rule up at every bind, and the rule differs from JAX's only inside a trace that ``keep_inline_calls``
marks, which autocast opens afresh each time (a new function, so no jaxpr JAX cached before is reused there).
Every jaxpr traced elsewhere, before or after the install, is staged by JAX's rule.

One of the three modules that use ``jax._src`` (see the package's docstring).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax._src import core
from jax._src.interpreters import partial_eval as pe
from jax.extend.core import ClosedJaxpr
from jax.extend.core.primitives import jit_p

from fmp._autocast._engine._jax_internals._trace import inlined_when_staged, trace_to_closed_jaxpr

__all__ = ["keep_inline_calls", "restaged_call_params", "staged_call_params"]

_KEEP = threading.local()
_INSTALL = threading.Lock()
_JAX_RULE: list[Callable[..., Any]] = []  # the rule found when ours was installed (JAX's own), once installed


def _install() -> None:
    """Puts ``_stage_jit`` in front of the staging rule of ``jit``, once per process. jax 0.10 to 0.12:
    ``pe.custom_staging_rules[jit_p]`` stages a jit call."""
    if _JAX_RULE:
        return
    with _INSTALL:
        if not _JAX_RULE:
            _JAX_RULE.append(pe.custom_staging_rules[jit_p])
            pe.custom_staging_rules[jit_p] = _stage_jit


def _stage_jit(trace: Any, source_info: Any, *args: Any, **params: Any) -> Any:
    if (
        inlined_when_staged(params)
        and getattr(_KEEP, "trace", None) is trace
        and _jax_own(params["jaxpr"])
        and _plain_body(params["jaxpr"])
    ):
        return trace.default_process_primitive(jit_p, args, params, source_info=source_info)
    return _JAX_RULE[0](trace, source_info, *args, **params)


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


@contextlib.contextmanager
def keep_inline_calls() -> Iterator[None]:
    """Within this block, the current trace keeps jit calls JAX would inline as equations (the staging rule is
    installed on the first entry). jax 0.10 to 0.12: ``core.trace_ctx.trace`` is the current trace."""
    _install()
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
