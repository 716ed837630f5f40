"""``Float8Recipe``: how a float8 matmul chooses its scales (static configuration)."""

from __future__ import annotations

import dataclasses

SCALINGS = ("tensorwise", "rowwise", "blockwise", "delayed", "mx")

_MSG_SCALING = (
    "Float8Recipe(scaling=...) must be one of {choices}, got {got!r}. 'tensorwise' (one scale per tensor, from "
    "the value itself) is the default and the safe start; 'rowwise' and 'blockwise' keep outliers from crushing "
    "the rest of a tensor; 'delayed' reads scales from an fmp.Float8State; 'mx' needs a GPU."
)


@dataclasses.dataclass(frozen=True)
class Float8Recipe:
    """The scaling recipe of a float8 policy: static, hashable configuration.

    Every recipe quantises the forward operands of a matmul to ``float8_e4m3fn``
    and the output gradient of both backward matmuls to ``float8_e5m2``, with a
    saturating cast (finite values beyond the float8 maximum become the maximum; an inf
    or NaN makes its tensor, row or block NaN, so that an overflow stays visible), and
    undoes the scales on the result; products accumulate in float32.

    Args:
      scaling: ``"tensorwise"`` (one scale per tensor from its amax, ``fp8_max / amax``,
        computed from the value: current scaling), ``"rowwise"`` (one scale per row of each operand,
        i.e. per index of its non-contracting dimensions), ``"blockwise"`` (activations
        and gradients in ``1 x block_size`` tiles along each product's contraction, the
        weight in ``block_size x block_size`` blocks), ``"delayed"`` (per-tensor scales
        from an amax history kept in ``fmp.Float8State``) or ``"mx"`` (32-element
        MX blocks through ``jax.nn.scaled_dot_general``; GPU only).
      block_size: The tile edge of ``"blockwise"``.
      pow2_scales: Round every scale down to a power of two, so that scaling is exact
        in float32 (the quantised matmul then equals the dequantised one bit for bit)
        and a value that float8 holds exactly (a pixel ``k / 16``, a one-hot) stays exact.
        On by default (as in torchao's rowwise recipe and the MX formats; torchao's tensorwise
        and Transformer Engine's delayed recipes default to the exact ``fp8_max / amax``):
        trained on digits, every recipe landed closer to bfloat16 with it (see the float8
        guide). ``False`` gives the exact ``fp8_max / amax``. ``"mx"`` ignores it: MX blocks
        always have power-of-two scales.
      history_len: For ``"delayed"``: how many steps of amax history a site keeps.
      margin: For ``"delayed"``: scales are divided by ``2**margin`` (0 to 64).
      output: ``"compute"``: matmul results come out in the policy's compute dtype, as
        under the bfloat16 policy; ``"float32"``: in float32.

    Examples:
      >>> fmp.Float8Recipe("rowwise").scaling
      'rowwise'
      >>> str(fmp.get_policy("mixed_float8"))
      'params=float32,compute=bfloat16,output=float32,fp8=tensorwise'
    """

    scaling: str = "tensorwise"
    block_size: int = 128
    pow2_scales: bool = True
    history_len: int = 16
    margin: int = 0
    output: str = "compute"

    def __post_init__(self) -> None:
        if self.scaling not in SCALINGS:
            raise ValueError(_MSG_SCALING.format(choices=", ".join(SCALINGS), got=self.scaling))
        for name in ("block_size", "history_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Float8Recipe({name}=...) must be a positive int, got {value!r}")
        if not isinstance(self.pow2_scales, bool):
            raise ValueError(f"Float8Recipe(pow2_scales=...) must be True or False, got {self.pow2_scales!r}")
        if not isinstance(self.margin, int) or isinstance(self.margin, bool) or not 0 <= self.margin <= 64:
            raise ValueError(f"Float8Recipe(margin=...) must be an int from 0 to 64 (usually 0-2), got {self.margin!r}")
        if self.output not in ("compute", "float32"):
            raise ValueError(f"Float8Recipe(output=...) must be 'compute' or 'float32', got {self.output!r}")

    def __str__(self) -> str:
        return self.scaling


def as_recipe(value: object) -> Float8Recipe | None:
    """``None``, a recipe, or a scaling name -> ``Float8Recipe | None``."""
    if value is None or isinstance(value, Float8Recipe):
        return value
    if isinstance(value, str):
        return Float8Recipe(value.strip().lower())
    raise TypeError(
        f"Policy fp8 must be None, a scaling name ('tensorwise', 'rowwise', ...) or an fmp.Float8Recipe, "
        f"got {type(value).__name__}"
    )
