"""The formats a plan may give a matmul or convolution site, as data: what each one runs as (the ``overrides``
value, a policy spec both frameworks read), what its GEMM costs (the device table's throughput entry, bits per
operand element, whether its operands are quantised first) and how precise it is (unit roundoff).

A new scaled format (``"mxfp8"``, ``"nvfp4"``) is one more entry: its policy spec, its throughput entry in
``fmp._plan._device.DEVICES`` (a device without that entry does not offer it) and the size-rule family its
scales follow (``fmp._report._float8_choice.FAMILY``).

Framework-neutral: imports neither jax nor torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fmp._core._dtypes import BLOCK_FORMATS, UNIT_ROUNDOFF


@dataclasses.dataclass(frozen=True)
class Format:
    """One candidate format of a site.

    Attributes:
      name: What a plan row says (``"float8"``, ``"float8_rowwise"``, ``"bfloat16"``, ``"float32"``).
      policy: The ``overrides`` value (a policy spec) that runs a site in it.
      kind: The device table's throughput entry its GEMMs run at.
      bits: Bits per element of the GEMM's operands (its memory traffic).
      unit_roundoff: Of the element format the operands are rounded to.
      scaling: The scaling of a quantised format (the size rule's family), ``""`` for a plain dtype.
    """

    name: str
    policy: str
    kind: str
    bits: float
    unit_roundoff: float
    scaling: str = ""

    @property
    def quantised(self) -> bool:
        """Its operands are scaled and cast before the GEMM (a pass over each, on top of the GEMM)."""
        return bool(self.scaling)


def _float8(scaling: str) -> Format:
    name = "float8" if scaling == "tensorwise" else f"float8_{scaling}"
    spec = (
        "mixed_float8"
        if scaling == "tensorwise"
        else f"params=float32,compute=bfloat16,output=float32,float8={scaling}"
    )
    return Format(name, spec, "float8", 8, UNIT_ROUNDOFF["float8_e4m3fn"], scaling)


def _block(name: str) -> Format:
    """A block-scaled format (``fmp._core._dtypes.BLOCK_FORMATS``): its elements and one 8-bit scale per block;
    its scaling is its name, as a recipe and a float8 row name it; torchao's size rule for finer-than-tensor
    scales (its rowwise boxes: ``FAMILY`` maps the format there) says where it pays."""
    f = BLOCK_FORMATS[name]
    element_bits = 8 if f.element.startswith("float8") else 4
    return Format(name, f"mixed_{name}", name, element_bits + 8 / f.block, 2.0 ** -(f.mbits + 1), name)


# every format a plan knows, cheapest kind first; ``float8`` is tensorwise, fmp's default recipe
FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        _float8("tensorwise"),
        _float8("rowwise"),
        _float8("blockwise"),
        _block("mxfp8"),
        _block("mxfp4"),
        _block("nvfp4"),
        Format("bfloat16", "mixed_bfloat16", "bfloat16", 16, UNIT_ROUNDOFF["bfloat16"]),
        Format("float32", "float32", "float32", 32, UNIT_ROUNDOFF["float32"]),
    )
}

DEFAULT_FORMATS = ("float8", "bfloat16", "float32")

_MSG_FORMATS = (
    "plan(formats=...) expects a non-empty sequence of format names from {known}, got {got!r}; "
    "'float8' is the tensorwise recipe, 'float8_rowwise' and 'float8_blockwise' the others; 'mxfp8', "
    "'mxfp4' and 'nvfp4' are offered where the device has them (b200)"
)


def formats_of(names: Sequence[str]) -> tuple[Format, ...]:
    """The ``Format`` of each name in ``names`` (validated; duplicates dropped, order kept).

    Raises:
      TypeError: ``names`` is a string or not a sequence of strings.
      ValueError: An unknown name, or none at all.
    """
    known = ", ".join(map(repr, FORMATS))
    if isinstance(names, str) or not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
        raise TypeError(_MSG_FORMATS.format(known=known, got=names))
    if not names or any(n not in FORMATS for n in names):
        raise ValueError(_MSG_FORMATS.format(known=known, got=tuple(names)))
    return tuple(FORMATS[n] for n in dict.fromkeys(names))
