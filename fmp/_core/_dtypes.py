"""Dtype facts, framework-neutral: names and spellings, which dtypes count as low precision, each format's
bits, largest finite value and unit roundoff, the bounds of a scale, and the loss scaler's initial scale.

Plain Python (no JAX, torch or numpy): JAX and torch turn a name into their own dtype
(``jnp.dtype(name)``, ``getattr(torch, name)``); both read every number from here.
"""

from __future__ import annotations

import dataclasses

# --- names and spellings ---------------------------------------------------------------------------------

# canonical name -> accepted spellings (case-insensitive)
FLOAT_ALIASES: dict[str, tuple[str, ...]] = {
    "float16": ("float16", "f16", "half", "fp16"),
    "bfloat16": ("bfloat16", "bf16"),
    "float32": ("float32", "f32", "full", "single", "fp32"),
    "float64": ("float64", "f64", "double", "fp64"),
}

_ALIAS_TO_NAME = {alias: name for name, aliases in FLOAT_ALIASES.items() for alias in aliases}

# the float8 formats: e4m3fn (no infinities) for values, e5m2 (more range) for gradients
E4M3 = "float8_e4m3fn"
E5M2 = "float8_e5m2"
FLOAT8 = (E4M3, E5M2)

# --- groups ----------------------------------------------------------------------------------------------

# the dtypes autocast moves values between; float64 is never cast by a rule
CASTABLE = frozenset({"float16", "bfloat16", "float32"})
# the 16-bit compute dtypes of a policy (float8 is reached through a recipe, not as a compute dtype)
LOW_PRECISION = frozenset({"float16", "bfloat16"})
# every dtype narrower than float32 an op may run in: the ones whose rounding a report draws
BELOW_FLOAT32 = LOW_PRECISION | frozenset(FLOAT8)

# --- per-format numbers ----------------------------------------------------------------------------------

# (exponent bits, mantissa bits) of the low-precision formats, for lax.reduce_precision
FORMAT_BITS = {"float16": (5, 10), "bfloat16": (8, 7)}

_WIDTH = {"float16": 16, "bfloat16": 16, "float32": 32, "float64": 64}

# the largest finite value of each format narrower than float32 (what an overflow is set against)
MAX_FINITE = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, E4M3: 448.0, E5M2: 57344.0}

# the smallest normal number of each format narrower than float32 (below it: subnormals, then zero)
SMALLEST_NORMAL = {"float16": 2.0**-14, "bfloat16": 2.0**-126, E4M3: 2.0**-6, E5M2: 2.0**-14}

# unit roundoff (half the machine epsilon) of each floating dtype an op may run in
UNIT_ROUNDOFF = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
    E4M3: 2.0**-4,
    E5M2: 2.0**-3,
    "float4_e2m1fn": 2.0**-2,
}

# --- scales ----------------------------------------------------------------------------------------------

# a float8 scale is clamped to these, so that the scale and its inverse stay normal float32 numbers
SCALE_MIN, SCALE_MAX = 2.0**-126, 2.0**126

# the loss scaler's initial scale (fmp.GradScaler's, torch.amp.GradScaler's)
INIT_SCALE = 2.0**16


# --- block-scaled formats -------------------------------------------------------------------------------


# The block-scaled ("microscaled") formats: the element format, its largest value and the exponent of its
# largest power of two (``emax``), its mantissa bits, the block length along the contraction, and the dtype of
# the per-block scale. MX: the OCP Microscaling spec v1.0 (e8m0 scales, 32-element blocks); NVFP4: NVIDIA's
# (e4m3 scales, 16-element blocks, plus one float32 scale per tensor).
@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """The static facts of one block-scaled format (names are NumPy/JAX dtype names)."""

    name: str
    element: str
    element_max: float
    emax: int
    mbits: int
    block: int
    scale: str


BLOCK_FORMATS: dict[str, BlockFormat] = {
    "mxfp8": BlockFormat("mxfp8", E4M3, MAX_FINITE[E4M3], 8, 3, 32, "float8_e8m0fnu"),
    "mxfp8_e5m2": BlockFormat("mxfp8_e5m2", E5M2, MAX_FINITE[E5M2], 15, 2, 32, "float8_e8m0fnu"),
    "mxfp4": BlockFormat("mxfp4", "float4_e2m1fn", 6.0, 2, 1, 32, "float8_e8m0fnu"),
    "nvfp4": BlockFormat("nvfp4", "float4_e2m1fn", 6.0, 2, 1, 16, E4M3),
}
# the largest e4m3 value: NVFP4's block scale saturates there
E4M3_MAX = MAX_FINITE[E4M3]


def accepted_spellings() -> str:
    """All accepted dtype spellings, for error messages."""
    return ", ".join(alias for aliases in FLOAT_ALIASES.values() for alias in aliases)


def canonical_name(spelling: str) -> str | None:
    """Returns the canonical float dtype name for ``spelling`` or None."""
    return _ALIAS_TO_NAME.get(spelling.strip().lower())


def widest(names: list[str] | tuple[str, ...]) -> str:
    """The narrowest floating dtype that holds every dtype in ``names``.

    float16 and bfloat16 together promote to float32 (neither holds the other).
    """
    if not names:
        raise ValueError("widest() needs at least one dtype name")
    unique = set(names)
    if len(unique) == 1:
        return names[0]
    if unique == {"float16", "bfloat16"}:
        return "float32"
    return max(unique, key=lambda n: _WIDTH[n])
