"""Higher-order primitives' params and rules: ``shard_map``'s body, ``scan``'s input counts, custom-derivative
rules.

One of the three modules that use ``jax._src`` (see the package's docstring); each function names the JAX
versions it covers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.linear_util as lu
from jax._src.shard_map import shard_map_p
from jax.extend.core import ClosedJaxpr

__all__ = [
    "bind_shard_map",
    "rewrap_bwd",
    "rewrap_rule_thunk",
    "scan_counts",
    "scan_params_with_xs",
    "shard_map_p",
    "user_function",
]

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
