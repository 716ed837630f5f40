"""One row of a precision report: ``OpRecord``, what ``fmp.explain`` (JAX) and ``fmp.torch.explain_fx`` say of
one operation. A module of its own, with no fmp imports, so that every module of the report reads the type
(the text, the verdict, the fixes, the comparison core) without importing the report back."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class OpRecord:
    """One operation after the rewrite.

    Attributes:
      index: Position in program order (nested bodies are flattened in order).
      op: Primitive or op name (``"dot_general"``, ``"aten::mm"``).
      source: The user's source line, its path relative to the working directory
        (``"src/model.py:12:8 (forward)"``), or only the file name for a file outside it
        (``"linear.py:80:4 (__call__)"``); ``""`` when unknown.
      scope: Name scope / module path the op came from, or ``""``.
      category: The rule that decided it (a ``Category`` value, or ``"cast"``
        for a cast fmp inserted, ``"user_cast"`` for one the user wrote,
        ``"statistic"`` for a jnp reduction's rounding of a float32 statistic
        back to a low-precision dtype, which fmp drops,
        ``"nested"`` for an op an inner autocast region decided, ``"opaque"``
        for one run in its original dtypes as written).
      in_before, in_after: Floating input dtype names before / after the rewrite.
      out_before, out_after: Output dtype names before / after the rewrite.
      flops: Estimated floating-point operations (0 when unknown or negligible).
      detail: Extra facts about the decision; for a ``float8`` row, the scaling
        recipe that quantised it (``"tensorwise"``, ``"rowwise"``, ...); for a
        row inside a body that an enclosing rule runs under another policy (a
        ``custom_linear_solve``'s bodies run in float32), that rule.
      why: For a matmul or convolution under a float8 policy, which side of the float8
        scope rule it fell on and why: ``"weight operand (rhs: input 1)"``,
        ``"activation x activation (...)"`` or ``"activations=True"``; ``""`` otherwise.
      source_full: ``source`` with the file's full path.
      error: With ``compare=True``: relative L2 error of the op's floating
        outputs against the same values of the program as written (error
        accumulated so far); ``None`` when not compared.
      added_error: With ``compare=True``: the error the op adds by itself (the
        op run in the policy's dtypes on the reference inputs, against the
        reference output); inf when that alone overflows.
      sqnr_db: Signal-to-quantisation-noise ratio of the outputs in dB (inf when exact).
      max_abs_error: Largest absolute difference from the reference.
      nonfinite: inf/NaN appeared in the policy run where the reference is finite.
      flips: Changed elements of integer/boolean outputs (``argmax``, ``top_k``
        indices, comparisons); 0 for floating outputs.
      suggestion: Code to paste that fixes a large added error, or ``None``: an ``overrides=`` entry for
        the innermost scope of the ops to run in float32 (``{"block/mlp": "float32"}``), or, outside any
        scope, for their source location (``{"model.py:12:8": "float32"}``); where neither is known, a
        ``rules=fmp.DEFAULT_RULES.derive(...)`` of the rules the report ran under with the op moved.
      error_mean, added_error_mean: Inside a loop body, the means over the
        iterations (the fields above hold the worst iteration's); else ``None``.
      iterations: How many times the row's op ran: the iterations of the loops around it (1 outside loops);
        under ``compare=True``, 0 for a ``cond`` branch not taken.
      underflow: A backward row with float16 outputs (``grads=True``): the fraction of the reference
        values' nonzero elements below float16's normal range at the loss scale (rounded to zero, or
        subnormal: kept, with fewer significant bits); else ``None``.
      ref_max: With ``compare=True``: the largest finite ``|value|`` of the op's floating outputs in the
        program as written (an overflow row sets it against its dtype's largest value); else ``None``.
      culprits: The ``index`` of each row ``suggestion`` runs in float32 (a float8 matmul: in its compute
        dtype): the row itself, or the rows upstream that rounded the inputs it magnified or whose changed
        values flipped it; ``()`` without a suggestion.
      gemm: A float8 matmul or convolution as a GEMM, ``(M, K, N)``: ``K`` the elements summed per output,
        ``N`` the output features (the weight operand's free size), ``M`` the rest; else ``None``.
      float8_too_small: A float8 matmul below the size where float8 pays on a GPU: the size rule it falls
        under (``"tensorwise: K <= 4096 and N <= 1024"``, see ``fmp._report._float8_choice``); else ``""``.
      added_vs_float8_median: With ``compare=True``, a float8 matmul: its ``added_error`` over the median
        ``added_error`` of the report's other float8 matmuls (the rule that keeps one in bfloat16); else ``None``.
      block_flushed: A matmul under a block-scaled format (``mxfp8``, ``mxfp4``, ``nvfp4``): the share of its
        operands' nonzero elements that quantised to zero (measured with ``compare=True``, which runs
        on values); ``None`` otherwise.
      block_saturated: The same rows: the share of the operands' nonzero blocks whose scale hit the end of its
        range (an MX exponent of -127 or 127; an NVFP4 scale that underflowed to 0).
    """

    index: int
    op: str
    source: str
    scope: str
    category: str
    in_before: tuple[str, ...]
    in_after: tuple[str, ...]
    out_before: tuple[str, ...]
    out_after: tuple[str, ...]
    flops: float = 0.0
    detail: str = ""
    source_full: str = ""
    why: str = ""
    error: float | None = None
    added_error: float | None = None
    sqnr_db: float | None = None
    max_abs_error: float | None = None
    nonfinite: bool = False
    flips: int = 0
    suggestion: str | None = None
    error_mean: float | None = None
    added_error_mean: float | None = None
    iterations: int = 1
    underflow: float | None = None
    ref_max: float | None = None
    culprits: tuple[int, ...] = ()
    gemm: tuple[int, int, int] | None = None
    float8_too_small: str = ""
    added_vs_float8_median: float | None = None
    block_flushed: float | None = None
    block_saturated: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
