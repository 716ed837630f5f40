"""What a GEMM costs on a device, per format: the model a plan's ``predicted_time`` comes from.

**The model.** A GEMM of ``M x K`` by ``K x N`` takes the larger of its FLOPs (``2MKN``) over the format's
dense peak throughput and its bytes (both operands at the format's width, the ``M x N`` result in bfloat16,
in float32 for the float32 format) over the memory bandwidth; a quantised format adds the passes that scale
and cast both operands (read twice at 2 bytes an element, for the amax and for the cast, written once at the
format's width), at the memory bandwidth. A training step (``grads=True``) runs three GEMMs per matmul: the
forward ``(M, K, N)``, the input gradient ``(M, N, K)`` and the weight gradient ``(K, M, N)``.

**The size rule.** Where torchao's measured thresholds say float8 does not pay (``K`` or ``N`` not a multiple
of 16, or the weight inside the small boxes of its scaling family, ``fmp._report._float8_choice.too_small``),
a quantised format is not offered, whatever the model says: the model has no launch or fusion overheads and
torchao measured them (on H100; no thresholds are published for other devices, so the same rule applies).

**The devices.** Dense (no 2:4 sparsity) peaks from the vendors' datasheets: H100 SXM5 (float32 67 TFLOP/s
without tensor cores, bfloat16 989.4, float8 1978.9; HBM3 3.35 TB/s); H200 SXM (the H100's compute, HBM3e
4.8 TB/s); B200 (HGX, 1000 W: float32 80, bfloat16 2250, float8 and MXFP8 4500, NVFP4/MXFP4 9000 TFLOP/s;
HBM3e 8 TB/s). The float32 format is priced at float32's peak, not TF32's (TF32 rounds operands to 10
mantissa bits: not float32's precision). A device without a format's entry (MXFP8 on Hopper) does not offer
it. A user table is a mapping ``{"peak": {kind: FLOP/s}, "bandwidth": bytes/s, "size_rule": bool}``.

Framework-neutral: imports neither jax nor torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from fmp._plan._formats import Format
from fmp._report._float8_choice import too_small

Gemm = tuple[int, int, int]

_T = 1e12


@dataclasses.dataclass(frozen=True)
class Device:
    """A device of the cost model: dense peak FLOP/s per format kind, memory bandwidth in bytes/s, and
    whether torchao's size rule decides where a quantised format pays."""

    name: str
    peak: Mapping[str, float]
    bandwidth: float
    size_rule: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "peak": dict(self.peak), "bandwidth": self.bandwidth, "size_rule": self.size_rule}


DEVICES: dict[str, Device] = {
    "h100": Device("h100", {"float32": 66.9 * _T, "bfloat16": 989.4 * _T, "float8": 1978.9 * _T}, 3.35 * _T),
    "h200": Device("h200", {"float32": 66.9 * _T, "bfloat16": 989.4 * _T, "float8": 1978.9 * _T}, 4.8 * _T),
    "b200": Device(
        "b200",
        {
            "float32": 80 * _T,
            "bfloat16": 2250 * _T,
            "float8": 4500 * _T,
            "mxfp8": 4500 * _T,
            "nvfp4": 9000 * _T,
            "mxfp4": 9000 * _T,
        },
        8 * _T,
    ),
}

_MSG_DEVICE = (
    "plan(device=...) expects one of {names} or a table {{'peak': {{'float32': FLOP/s, 'bfloat16': FLOP/s, "
    "'float8': FLOP/s}}, 'bandwidth': bytes/s, 'size_rule': True}} (dense peaks from the vendor's datasheet; "
    "float32 and bfloat16 are needed), got {got!r}"
)


def device_of(device: str | Mapping[str, Any] | Device) -> Device:
    """The ``Device`` of a name (``"h100"``, ``"h200"``, ``"b200"``), a user table or a ``Device``.

    Raises:
      ValueError: An unknown name, or a table without positive peaks and bandwidth.
      TypeError: Anything else.
    """
    names = ", ".join(map(repr, DEVICES))
    if isinstance(device, Device):
        return device
    if isinstance(device, str):
        if device.strip().lower() not in DEVICES:
            raise ValueError(_MSG_DEVICE.format(names=names, got=device))
        return DEVICES[device.strip().lower()]
    if not isinstance(device, Mapping):
        raise TypeError(_MSG_DEVICE.format(names=names, got=device))
    peak, bandwidth = device.get("peak"), device.get("bandwidth")
    ok = isinstance(peak, Mapping) and {"bfloat16", "float32"} <= set(peak) and _positive(bandwidth)
    ok = ok and all(_positive(v) for v in peak.values())  # type: ignore[union-attr]
    if not ok or set(device) - {"name", "peak", "bandwidth", "size_rule"}:
        raise ValueError(_MSG_DEVICE.format(names=names, got=dict(device)))
    size_rule = device.get("size_rule", True)
    return Device(str(device.get("name", "custom")), dict(peak), float(bandwidth), bool(size_rule))  # type: ignore[arg-type]


def _positive(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x > 0


def offers(device: Device, fmt: Format) -> bool:
    """The device runs ``fmt``'s GEMMs (its table has the format's throughput entry)."""
    return fmt.kind in device.peak


def does_not_pay(device: Device, fmt: Format, gemm: Gemm) -> str:
    """Why ``fmt`` does not pay for a ``(M, K, N)`` GEMM on ``device`` by the size rule, ``""`` when it may."""
    if not (fmt.quantised and device.size_rule):
        return ""
    return too_small(gemm[1], gemm[2], fmt.scaling)


def _one(device: Device, fmt: Format, m: int, k: int, n: int) -> float:
    out_bytes = 4 if fmt.kind == "float32" else 2
    compute = 2.0 * m * k * n / device.peak[fmt.kind]
    memory = ((m * k + k * n) * fmt.bits / 8 + m * n * out_bytes) / device.bandwidth
    quantise = (m * k + k * n) * (4 + fmt.bits / 8) / device.bandwidth if fmt.quantised else 0.0
    return max(compute, memory) + quantise


def gemm_time(device: Device, fmt: Format, gemm: Gemm, grads: bool) -> float:
    """Seconds the model gives one ``(M, K, N)`` GEMM in ``fmt`` (with ``grads``: its two backward GEMMs too)."""
    m, k, n = gemm
    shapes = [(m, k, n), (m, n, k), (k, m, n)] if grads else [(m, k, n)]
    return sum(_one(device, fmt, *s) for s in shapes)
