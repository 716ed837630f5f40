"""``Float8Recipe``: how a float8 matmul chooses its scales (static configuration)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np

from fmp._core._dtypes import E4M3, E5M2

# the block-scaled formats a recipe can name (their facts: fmp._core._dtypes.BLOCK_FORMATS)
BLOCK_SCALINGS = ("mxfp8", "mxfp4", "nvfp4")
SCALINGS = ("tensorwise", "rowwise", "blockwise", "delayed", *BLOCK_SCALINGS)
# earlier spellings still accepted: "mx" (32-element MX blocks) is MXFP8
SCALING_ALIASES = {"mx": "mxfp8"}
SCALE_ROUNDINGS = ("rceil", "floor", "ceil", "even")
GRAD_DTYPES = (E5M2, E4M3)
AMAX_COMPUTE_ALGOS = ("max", "most_recent")

# The peers' named recipes as fmp options: what each peer's own recipe does, in fmp's terms (the float8
# guide's "Recipes from other libraries" table describes them; tests/float8/test_peers.py checks them).
PEER_RECIPES: dict[str, dict[str, Any]] = {
    # torchao Float8LinearConfig.from_recipe_name("tensorwise"): exact scales, e5m2 gradients
    "torchao_tensorwise": {"scaling": "tensorwise", "pow2_scales": False, "grad_dtype": "float8_e5m2"},
    # torchao Float8LinearConfig.from_recipe_name("rowwise"): power-of-two scales, e4m3 gradients
    "torchao_rowwise": {"scaling": "rowwise", "pow2_scales": True, "grad_dtype": "float8_e4m3fn"},
    # Transformer Engine DelayedScaling(): HYBRID format, amax_history_len=1024, "max", margin 0, exact scales
    "te_delayed": {
        "scaling": "delayed",
        "pow2_scales": False,
        "grad_dtype": "float8_e5m2",
        "history_len": 1024,
        "amax_compute_algo": "max",
        "margin": 0,
    },
}

_MSG_SCALING = (
    "Float8Recipe(scaling=...) must be one of {choices}, got {got!r}. 'tensorwise' (one scale per tensor, from "
    "the value itself) is the default and the safe start; 'rowwise' and 'blockwise' keep outliers from crushing "
    "the rest of a tensor; 'delayed' reads scales from an fmp.Float8State; 'mxfp8', 'mxfp4' and 'nvfp4' are the "
    "block-scaled formats (emulated on any device)."
)
_MSG_GRAD_DTYPE = (
    "Float8Recipe(grad_dtype=...) must be one of {choices} (or the jnp dtype), got {got!r}. 'float8_e5m2' "
    "(the default) has the range gradients usually need; 'float8_e4m3fn' has one more mantissa bit "
    "(torchao's rowwise recipe and DeepSeek-V3 quantise gradients to it)."
)
_MSG_PEER = (
    "Float8Recipe.from_peer(name) knows {choices}, got {got!r}. Each is a peer library's named recipe "
    "(see the float8 guide's recipe table); for anything else build fmp.Float8Recipe(...) directly."
)


def _dtype_name(value: object) -> object:
    """A float8 dtype given as a name, a NumPy/JAX dtype or scalar type -> its name; anything else as is."""
    if isinstance(value, str):
        return value.strip().lower()
    try:
        return np.dtype(value).name  # type: ignore[call-overload]
    except TypeError:
        return value


@dataclasses.dataclass(frozen=True)
class Float8Recipe:
    """The scaling recipe of a float8 policy: static, hashable configuration.

    Every recipe quantises the forward operands of a matmul to ``float8_e4m3fn``
    and the output gradient of both backward matmuls to ``grad_dtype``
    (``float8_e5m2`` unless chosen otherwise), with a saturating cast (finite values
    beyond the float8 maximum become the maximum; an inf or NaN makes its tensor, row or
    block NaN, so that an overflow stays visible), and
    undoes the scales on the result; products accumulate in float32.

    Args:
      scaling: ``"tensorwise"`` (one scale per tensor from its amax, ``fp8_max / amax``,
        computed from the value: current scaling), ``"rowwise"`` (one scale per row of each operand,
        i.e. per index of its non-contracting dimensions), ``"blockwise"`` (activations
        and gradients in ``1 x block_size`` tiles along each product's contraction, the
        weight in ``block_size x block_size`` blocks), ``"delayed"`` (per-tensor scales
        from an amax history kept in ``fmp.Float8State``), or a block-scaled format (see `fmp.quantize`):
        ``"mxfp8"`` (``"mx"`` is accepted for it; 32-element e4m3 blocks, power-of-two scales; all three
        products, each operand quantised along that product's own contraction, as torchao's MXFP8 linear
        and Transformer Engine's ``MXFP8BlockScaling``), ``"mxfp4"`` (the same with e2m1 elements) or
        ``"nvfp4"`` (Transformer Engine's NVFP4 recipe: activations and gradients in 16-element blocks,
        weights in 16 x 16 tiles, a random Hadamard transform on the weight-gradient product's inputs, and
        gradients rounded stochastically when ``fmp.autocast`` gets a ``key``). Block-scaled matmuls are
        emulated (quantise, dequantise, float32 matmul): on any device, bit for bit with the formats' codes.
      block_size: The tile edge of ``"blockwise"``.
      pow2_scales: Round every scale down to a power of two, so that scaling is exact
        in float32 (the quantised matmul then equals the dequantised one bit for bit)
        and a value that float8 holds exactly (a pixel ``k / 16``, a one-hot) stays exact.
        On by default (as in torchao's rowwise recipe and the MX formats; torchao's tensorwise
        and Transformer Engine's delayed recipes default to the exact ``fp8_max / amax``):
        trained on digits, every recipe landed closer to bfloat16 with it (see the float8
        guide). ``False`` gives the exact ``fp8_max / amax``. Block-scaled formats ignore it.
      history_len: For ``"delayed"``: how many steps of amax history a site keeps.
      margin: For ``"delayed"``: scales are divided by ``2**margin`` (0 to 64).
      grad_dtype: The float8 format of the output gradient in both backward products:
        ``"float8_e5m2"`` (5 exponent bits, largest value 57344; the default of the per-tensor
        recipes) or ``"float8_e4m3fn"`` (one more mantissa bit, largest value 448; torchao's rowwise
        recipe and DeepSeek-V3 use it, and ``"mxfp8"`` by default; ``"float8_e5m2"`` there gives
        MXFP8 gradients with e5m2 elements). A jnp dtype is accepted too. The 4-bit formats quantise
        gradients to their own format.
      scale_rounding: How an MX block's power-of-two scale is chosen (``"rceil"``, the default, ``"floor"``,
        ``"ceil"`` or ``"even"``; see `fmp.quantize`).
      amax_compute_algo: For ``"delayed"``: the amax a scale comes from, ``"max"`` (the
        largest of the history, the default) or ``"most_recent"`` (the last step's), as
        Transformer Engine's ``DelayedScaling`` names them.
      output: ``"compute"``: matmul results come out in the policy's compute dtype, as
        under the bfloat16 policy; ``"float32"``: in float32.
      activations: Which matmuls and convolutions run in float8. ``False`` (the default, as
        torchao, Transformer Engine and flax do): only those with a weight operand, an input
        of the autocast function (a parameter leaf) or a constant, seen through casts,
        reshapes, transposes, broadcasts, slices and scan slices; attention's activation x
        activation products (``q @ k.T``, ``p @ v``) stay in the compute dtype.
        ``True``: every matmul and convolution.
      emulate: How a tensorwise, rowwise or delayed matmul is computed. ``None`` (the default):
        as a float8 GEMM where the device has one (a GPU of compute capability 8.9 or newer),
        emulated elsewhere (a CPU). ``False``: float8 operands go into the matmul, which
        accumulates in float32, and the inverse scales multiply its result (the form of
        ``torch._scaled_mm``, which torchao uses; on a CPU, XLA widens the float8 operands
        itself). ``True``: each operand is dequantised to float32 before a float32 matmul
        (torchao's ``emulate=True``; bit for bit with it). With power-of-two scales both forms
        give the same bits on a CPU; a GPU's float8 GEMM accumulates in its own order and
        precision. Blockwise and the block-scaled formats always dequantise first.

    Examples:
      >>> fmp.Float8Recipe("rowwise").scaling
      'rowwise'
      >>> fmp.Float8Recipe("rowwise", grad_dtype="float8_e4m3fn").grad_dtype
      'float8_e4m3fn'
      >>> fmp.Float8Recipe("tensorwise").activations
      False
      >>> str(fmp.get_policy("mixed_float8"))
      'params=float32,compute=bfloat16,output=float32,float8=tensorwise'
    """

    scaling: str = "tensorwise"
    block_size: int = 128
    pow2_scales: bool = True
    history_len: int = 16
    margin: int = 0
    output: str = "compute"
    grad_dtype: str | None = None
    scale_rounding: str = "rceil"
    amax_compute_algo: str = "max"
    activations: bool = False
    emulate: bool | None = None
    PEERS: ClassVar[tuple[str, ...]] = tuple(PEER_RECIPES)

    def __post_init__(self) -> None:
        if isinstance(self.scaling, str):
            scaling = self.scaling.strip().lower()
            object.__setattr__(self, "scaling", SCALING_ALIASES.get(scaling, scaling))
        if self.grad_dtype is None:
            default = E4M3 if self.scaling in BLOCK_SCALINGS else E5M2
            object.__setattr__(self, "grad_dtype", default)
        object.__setattr__(self, "grad_dtype", _dtype_name(self.grad_dtype))
        if self.scale_rounding not in SCALE_ROUNDINGS:
            raise ValueError(
                f"Float8Recipe(scale_rounding=...) must be one of {', '.join(map(repr, SCALE_ROUNDINGS))}, "
                f"got {self.scale_rounding!r} ('rceil', the default, never saturates a block's largest value)"
            )
        if self.grad_dtype not in GRAD_DTYPES:
            raise ValueError(_MSG_GRAD_DTYPE.format(choices=", ".join(map(repr, GRAD_DTYPES)), got=self.grad_dtype))
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(
                f"Float8Recipe(amax_compute_algo=...) must be 'max' or 'most_recent', got {self.amax_compute_algo!r}"
            )
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
        if not isinstance(self.activations, bool):
            raise ValueError(f"Float8Recipe(activations=...) must be True or False, got {self.activations!r}")
        if self.emulate not in (None, True, False):
            raise ValueError(f"Float8Recipe(emulate=...) must be None, True or False, got {self.emulate!r}")
        if self.output not in ("compute", "float32"):
            raise ValueError(f"Float8Recipe(output=...) must be 'compute' or 'float32', got {self.output!r}")

    def changed(self) -> dict[str, Any]:
        """The fields that differ from the defaults of this recipe's scaling (``grad_dtype``'s default is
        the scaling's own: e4m3 for the block-scaled formats, e5m2 for the others)."""
        default = type(self)(self.scaling)  # a subclass's own fields too
        names = [f.name for f in dataclasses.fields(self) if f.name != "scaling"]
        return {n: getattr(self, n) for n in names if getattr(self, n) != getattr(default, n)}

    def __str__(self) -> str:
        """The scaling, with every field that differs from its defaults: ``"delayed(history_len=1024,margin=1)"``
        (the form a policy spec's ``float8=`` takes; `recipe_from_spec` reads it back)."""
        changed = ",".join(f"{n}={_spell(v)}" for n, v in self.changed().items())
        return f"{self.scaling}({changed})" if changed else self.scaling

    def __repr__(self) -> str:
        changed = "".join(f", {n}={v!r}" for n, v in self.changed().items())
        return f"Float8Recipe(scaling={self.scaling!r}{changed})"

    @classmethod
    def from_peer(cls, name: str, **changes: Any) -> Float8Recipe:
        """A peer library's named recipe: ``"torchao_tensorwise"``, ``"torchao_rowwise"`` or ``"te_delayed"``.

        ``torchao_tensorwise`` and ``torchao_rowwise`` equal torchao's
        ``Float8LinearConfig.from_recipe_name("tensorwise" / "rowwise")`` (exact scales and e5m2
        gradients; power-of-two scales and e4m3 gradients); ``te_delayed`` is Transformer Engine's
        ``DelayedScaling()`` (history of 1024 steps, ``amax_compute_algo="max"``, margin 0, exact
        scales, e5m2 gradients). ``changes`` override single fields, e.g.
        ``amax_compute_algo="most_recent"``.

        Args:
          name: The recipe's name, one of ``fmp.Float8Recipe.PEERS``.
          **changes: Fields to set differently from the peer's defaults.

        Returns:
          The ``Float8Recipe``.

        Raises:
          ValueError: For an unknown name (the message lists the known ones).

        Examples:
          >>> r = fmp.Float8Recipe.from_peer("torchao_rowwise")
          >>> r.scaling, r.pow2_scales, r.grad_dtype
          ('rowwise', True, 'float8_e4m3fn')
          >>> fmp.Float8Recipe.from_peer("te_delayed", amax_compute_algo="most_recent").history_len
          1024
        """
        key = name.strip().lower() if isinstance(name, str) else name
        if key not in PEER_RECIPES:
            raise ValueError(_MSG_PEER.format(choices=", ".join(map(repr, PEER_RECIPES)), got=name))
        return cls(**{**PEER_RECIPES[key], **changes})


def _spell(value: object) -> str:
    """A field's value as a recipe spec writes it (``false``, ``none``, ``1024``, ``float8_e4m3fn``)."""
    return str(value).lower() if value is None or isinstance(value, bool) else str(value)


# how a recipe spec's option values read back, per field (the other fields take their text as it is)
_WORDS = {"true": True, "false": False}
_READ: dict[str, Any] = {
    **dict.fromkeys(("block_size", "history_len", "margin"), int),
    **dict.fromkeys(("pow2_scales", "activations"), _WORDS.__getitem__),
    "emulate": {**_WORDS, "none": None}.__getitem__,
}
_MSG_OPTION = (
    "float8 recipe {spec!r}: {what}. Options follow the scaling in parentheses as field=value pairs, e.g. "
    "'rowwise(pow2_scales=false,grad_dtype=float8_e4m3fn)' or 'delayed(history_len=1024)'; the fields: {fields}."
)


def recipe_from_spec(spec: str) -> Float8Recipe:
    """A recipe's string form (``str(recipe)``: ``"rowwise"``, ``"delayed(history_len=1024,margin=1)"``) ->
    the recipe. Raises ValueError naming the bad option."""
    head, paren, rest = spec.strip().partition("(")
    fields = [f.name for f in dataclasses.fields(Float8Recipe) if f.name != "scaling"]

    def bad(what: str) -> ValueError:
        return ValueError(_MSG_OPTION.format(spec=spec, what=what, fields=", ".join(fields)))

    if paren and not rest.endswith(")"):
        raise bad("the options' parenthesis is not closed at the end")
    options: dict[str, Any] = {}
    for token in rest[:-1].split(",") if paren else ():
        key, sep, text = (part.strip() for part in token.partition("="))
        if not sep or key not in fields:
            raise bad(f"{token.strip()!r} is not field=value with a field of Float8Recipe")
        if key in options:
            raise bad(f"{key!r} is given twice")
        try:
            options[key] = _READ.get(key, str.lower)(text.lower())
        except (KeyError, ValueError):
            raise bad(f"{key}={text!r} is not a value {key} takes") from None
    return Float8Recipe(head.strip(), **options)


def as_recipe(value: object) -> Float8Recipe | None:
    """``None``, a recipe, or a recipe's string form (``"rowwise"``, ``"delayed(margin=1)"``) ->
    ``Float8Recipe | None``."""
    if value is None or isinstance(value, Float8Recipe):
        return value
    if isinstance(value, str):
        return recipe_from_spec(value)
    raise TypeError(
        f"Policy float8 must be None, a scaling name ('tensorwise', 'rowwise', ...) or an fmp.Float8Recipe, "
        f"got {type(value).__name__}"
    )
