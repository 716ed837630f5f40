"""Canonical floating dtype names and their spellings, framework-neutral."""

from __future__ import annotations

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
