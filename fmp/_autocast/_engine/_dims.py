"""Which dimensions of a value are which: the shape facts behind the epilogue rule's bias test.

A value is labelled per dimension with a set of tags, starting at the equation
that computed it and carried forward through the ops that move or re-view it
(``_provenance.PASS_THROUGH``). A matmul's result is tagged by where each of
its dimensions comes from: ``"B"`` a batch dimension of ``dot_general``,
``"L"``/``"R"`` a free dimension of its left/right operand; a convolution's
output feature dimension is ``"R"`` and its batch and spatial dimensions ``"L"``.
A bias is tagged ``"V"`` where it varies (a dimension of more than one element);
a dimension it is broadcast along carries no tag.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from jax.extend.core import JaxprEqn

Labels = list[frozenset[str]]

_NONE: frozenset[str] = frozenset()


def contracted_size(eqn: JaxprEqn) -> int:
    """How many elements a ``dot_general`` sums per output element (1 for an outer or batch-only product)."""
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval
    return math.prod(lhs.shape[d] for d in lhs_contract)


def of_result(eqn: JaxprEqn) -> tuple[Labels, frozenset[str]] | None:
    """``(labels, feature tags)`` of a matmul or convolution's result; None for another equation.

    The feature tags name the dimensions a bias may vary along: the free
    dimensions of either operand of a ``dot_general`` without batch dimensions
    (a linear layer's product, in either operand order), the output feature
    dimension of a convolution; none for a batched product (attention scores).
    """
    ndim = len(eqn.outvars[0].aval.shape)
    if eqn.primitive.name == "dot_general":
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = (len(v.aval.shape) for v in eqn.invars)
        n_l, n_r = lhs - len(lc) - len(lb), rhs - len(rc) - len(rb)
        labels = [frozenset("B")] * len(lb) + [frozenset("L")] * n_l + [frozenset("R")] * n_r
        return labels, (frozenset() if lb else frozenset("LR"))
    if eqn.primitive.name == "conv_general_dilated":
        feature = eqn.params["dimension_numbers"].out_spec[1]
        return [frozenset("R") if d == feature else frozenset("L") for d in range(ndim)], frozenset("R")
    return None


def of_bias(shape: Sequence[int]) -> Labels:
    """``"V"`` on every dimension of more than one element."""
    return [frozenset("V") if n != 1 else _NONE for n in shape]


def forward(labels: Labels, eqn: JaxprEqn) -> Labels:
    """The labels of the output of pass-through ``eqn`` whose operand has ``labels``."""
    name, params = eqn.primitive.name, eqn.params
    src = eqn.invars[0].aval.shape
    dst = eqn.outvars[0].aval.shape
    if name == "transpose":
        return [labels[p] for p in params["permutation"]]
    if name == "squeeze":
        drop = {d % len(src) for d in params["dimensions"]}
        return [lab for d, lab in enumerate(labels) if d not in drop]
    if name == "broadcast_in_dim":
        out = [_NONE] * len(dst)
        for k, d in enumerate(params["broadcast_dimensions"]):
            out[d] = labels[k] if src[k] == dst[d] else _NONE
        return out
    if name == "reshape":
        return _reshape(labels, src, dst)
    return list(labels)  # convert_element_type


def _reshape(labels: Labels, src: Sequence[int], dst: Sequence[int]) -> Labels:
    """A reshape maps blocks of dimensions with equal products onto each other; each output dimension of a
    block takes the tags of the whole input block (dimensions of one element take none)."""
    if 0 in src:
        return [_NONE] * len(dst)
    a = [(n, labels[k]) for k, n in enumerate(src) if n != 1]
    b = [k for k, n in enumerate(dst) if n != 1]
    out = [_NONE] * len(dst)
    i = j = 0
    while i < len(a) and j < len(b):
        have, tags = a[i][0], set(a[i][1])
        want, block = dst[b[j]], [b[j]]
        i, j = i + 1, j + 1
        while have != want:
            if have < want:
                have, tags = have * a[i][0], tags | a[i][1]
                i += 1
            else:
                want, block = want * dst[b[j]], [*block, b[j]]
                j += 1
        for k in block:
            out[k] = frozenset(tags)
    return out


def along_features(result: Labels, features: frozenset[str], bias: Labels) -> str:
    """``""`` when ``bias`` (the other operand's labels) varies only along feature dimensions of one kind
    of ``result`` (the matmul side's labels), else why not."""
    varies = [d for d, lab in enumerate(bias) if lab]
    if not varies:
        return ""
    kinds = {result[d] for d in varies}
    if len(kinds) == 1 and len(next(iter(kinds))) == 1 and next(iter(kinds)) <= features:
        return ""
    return "the other operand varies along dimensions other than the output features"
