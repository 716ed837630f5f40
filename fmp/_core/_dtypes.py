"""Canonical floating dtype names and their spellings, framework-neutral."""

from __future__ import annotations

import dataclasses

# canonical name -> accepted spellings (case-insensitive)
FLOAT_ALIASES: dict[str, tuple[str, ...]] = {
    "float16": ("float16", "f16", "half", "fp16"),
    "bfloat16": ("bfloat16", "bf16"),
    "float32": ("float32", "f32", "full", "single", "fp32"),
    "float64": ("float64", "f64", "double", "fp64"),
}

_ALIAS_TO_NAME = {alias: name for name, aliases in FLOAT_ALIASES.items() for alias in aliases}

# the dtypes autocast moves values between; float64 is never cast by a rule
CASTABLE = frozenset({"float16", "bfloat16", "float32"})
LOW_PRECISION = frozenset({"float16", "bfloat16"})

# (exponent bits, mantissa bits) of the low-precision formats, for lax.reduce_precision
FORMAT_BITS = {"float16": (5, 10), "bfloat16": (8, 7)}

_WIDTH = {"float16": 16, "bfloat16": 16, "float32": 32, "float64": 64}


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
    "mxfp8": BlockFormat("mxfp8", "float8_e4m3fn", 448.0, 8, 3, 32, "float8_e8m0fnu"),
    "mxfp8_e5m2": BlockFormat("mxfp8_e5m2", "float8_e5m2", 57344.0, 15, 2, 32, "float8_e8m0fnu"),
    "mxfp4": BlockFormat("mxfp4", "float4_e2m1fn", 6.0, 2, 1, 32, "float8_e8m0fnu"),
    "nvfp4": BlockFormat("nvfp4", "float4_e2m1fn", 6.0, 2, 1, 16, "float8_e4m3fn"),
}
# the largest e4m3 value: NVFP4's block scale saturates there
E4M3_MAX = 448.0
