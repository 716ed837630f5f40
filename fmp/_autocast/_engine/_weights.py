"""The float8 scope rule: which matmuls have a weight operand.

Under a float8 recipe with ``activations=False`` (the default, as torchao,
Transformer Engine and flax scope float8), a ``dot_general`` or convolution runs
in float8 only when one operand is a weight: an input of the autocast function
(a parameter leaf of a flax or nnx param tree is one) or a constant, seen through
casts, reshapes, transposes and broadcasts (``_provenance.weight_of``).
Attention's activation x activation products stay in the compute dtype.

A body of a higher-order equation (``scan``, ``cond``, ``jit``, ``checkpoint``,
``shard_map``, ...) is rewritten on its own, so its inputs are linked here to the
operands of its call (``body_weights``): a scan's consts and ``xs`` (stacked
layer weights, sliced per iteration) that are weights stay weights in the body;
its carry never is (it changes from one iteration to the next).
"""

from __future__ import annotations

from typing import Any

from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn

from fmp._autocast._engine import _jax_internals
from fmp._autocast._engine._frames import Frame
from fmp._autocast._engine._provenance import TANGENT, weight_of

Labels = tuple[str | None, ...]


def top_weights(jaxpr: Jaxpr) -> dict[int, Labels]:
    """``weights_in`` of the autocast function's own program: every input is a weight (its constants are, as
    in every body). Set by the top-level rewrite alone: a jaxpr rewritten with no frame around it (a
    custom-derivative rule JAX asks for after the rewrite returned) is not the top level."""
    return {id(jaxpr): tuple(f"input {i}" for i in range(len(jaxpr.invars)))}


def rule_weights(labels: Labels | None, primals: int, rule: Jaxpr) -> dict[int, Labels]:
    """``weights_in`` of a custom_jvp's jvp rule or a custom_vjp's fwd rule: its first ``primals`` inputs are
    the call's operands, ``labels`` (``body_weights`` of the primal body); the rest, a jvp rule's tangents,
    are ``TANGENT``."""
    if len(rule.invars) < primals:
        return {}
    labels = (None,) * primals if labels is None else labels
    return {id(rule): (*labels, *(TANGENT,) * (len(rule.invars) - primals))}


def frame_weights(jaxpr: Jaxpr, labels: Labels | None) -> dict[Any, str]:
    """The weights of a body rewritten on its own: its constants and the inputs its call marked."""
    named = {v: "constant" for v in jaxpr.constvars}
    if labels is not None and len(labels) == len(jaxpr.invars):
        named.update({v: lab for v, lab in zip(jaxpr.invars, labels, strict=True) if lab is not None})
    return named


def _open(j: Any) -> Jaxpr | None:
    return j.jaxpr if isinstance(j, ClosedJaxpr) else j if isinstance(j, Jaxpr) else None


def body_weights(eqn: JaxprEqn, frame: Frame) -> dict[int, Labels]:
    """``id(body jaxpr) -> labels of its inputs`` (None: an activation) for the bodies of ``eqn``."""
    ops: Labels = tuple(weight_of(v, frame) for v in eqn.invars)
    if not any(ops):
        return {}
    p, out = eqn.params, {}
    name = eqn.primitive.name
    if name == "scan":
        nc, nk = _jax_internals.scan_counts(p)
        out[id(p["jaxpr"].jaxpr)] = ops[:nc] + (None,) * nk + ops[nc + nk :]
    elif name == "cond":
        for b in p["branches"]:
            out[id(b.jaxpr)] = ops[1:]
    elif name == "while":
        cc, bc = p["cond_nconsts"], p["body_nconsts"]
        carry = (None,) * (len(ops) - cc - bc)
        out[id(p["cond_jaxpr"].jaxpr)] = ops[:cc] + carry
        out[id(p["body_jaxpr"].jaxpr)] = ops[cc : cc + bc] + carry
    else:  # jit, checkpoint, shard_map, custom derivatives, calls: one body input per operand
        for v in p.values():
            body = _open(v)
            if body is not None and len(body.invars) == len(ops):
                out[id(body)] = ops
    return out
