"""The explain report's "before" column: each node's value with autocast off.

A traced graph's recorded values may already show autocast's dtypes (tracing
runs with torch's autocast state on), so the report recomputes them with fake
tensors from the program's own ops. Only `fmp.torch.explain_fx` and
`fmp.torch.explain_graph` read these; the rewrite itself never does.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx

from fmp.torch._fx._common import float_names


def plain(rw: Any, node: torch.fx.Node) -> Any:
    """The value ``node`` has without any autocast, memoized in ``rw.before``."""
    if node in rw.before:
        return rw.before[node]
    val = node.meta.get("val")
    if node.op == "call_function" and (
        isinstance(node.target, torch._ops.OpOverload) or node.target is operator.getitem
    ):
        args = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: plain(rw, n))
        quiet = logging.getLogger("torch._subclasses.fake_tensor")
        level = quiet.level
        quiet.setLevel(logging.CRITICAL)  # a failing meta kernel logs a traceback before raising
        try:
            with rw.fake_mode:
                val = node.target(*rw.fake(args[0]), **rw.fake(args[1]))
        except Exception:  # noqa: BLE001  (an op that only runs under autocast: keep the traced value)
            val = node.meta.get("val")
        finally:
            quiet.setLevel(level)
    rw.before[node] = val
    return val


def inputs_before(rw: Any, node: torch.fx.Node) -> tuple[str, ...]:
    """The floating dtypes of ``node``'s inputs without autocast."""
    return float_names(list(torch.fx.node.map_arg((node.args, node.kwargs), lambda n: plain(rw, n))))
