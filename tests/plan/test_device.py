"""The device cost model: the GEMM time formula, the size rule, the formats a device offers."""

from __future__ import annotations

import pytest

from fmp._plan._device import DEVICES, device_of, gemm_time
from fmp._plan._formats import FORMATS, formats_of
from fmp._plan._search import candidates
from fmp._plan._sites import Site

H100 = DEVICES["h100"]
F8, BF16, F32 = FORMATS["float8"], FORMATS["bfloat16"], FORMATS["float32"]


def test_a_large_gemm_is_compute_bound_at_the_formats_peak():
    g = (8192, 8192, 8192)
    flops = 2 * 8192**3
    assert gemm_time(H100, BF16, g, grads=False) == pytest.approx(flops / 989.4e12)
    quant = 2 * 8192**2 * (4 + 1) / 3.35e12  # both operands read twice in bfloat16, written in float8
    assert gemm_time(H100, F8, g, grads=False) == pytest.approx(flops / 1978.9e12 + quant)
    assert gemm_time(H100, F8, g, grads=True) == pytest.approx(3 * gemm_time(H100, F8, g, grads=False))


def test_a_thin_gemm_is_memory_bound():
    g = (16, 8192, 8192)
    bytes_bf16 = (16 * 8192 + 8192 * 8192) * 2 + 16 * 8192 * 2
    assert gemm_time(H100, BF16, g, grads=False) == pytest.approx(bytes_bf16 / 3.35e12)


def test_tiny_gemms_stay_in_bfloat16_by_the_size_rule_on_h100():
    c = candidates(Site("mlp", ((64, 256, 256),)), formats_of(("float8", "bfloat16", "float32")), H100, True)
    assert [f.name for f in c.chain] == ["bfloat16", "float32"]
    assert c.left_out == (("float8", "does not pay (tensorwise: K <= 4096 and N <= 1024)"),)
    big = candidates(Site("mlp", ((8192, 8192, 8192),)), formats_of(("float8", "bfloat16")), H100, True)
    assert [f.name for f in big.chain] == ["float8", "bfloat16"]
    rowwise = candidates(Site("mlp", ((8192, 4096, 2048),)), formats_of(("float8_rowwise", "bfloat16")), H100, True)
    assert rowwise.left_out == (("float8_rowwise", "does not pay (rowwise: N <= 2048)"),)


def test_a_block_scaled_format_left_out_by_the_size_rule_is_named_with_the_rule_it_follows():
    fmts = formats_of(("mxfp8", "nvfp4", "bfloat16"))
    c = candidates(Site("mlp", ((8192, 4096, 2048),)), fmts, DEVICES["b200"], True)
    rule = "(rowwise rule): N <= 2048"
    assert c.left_out == (("mxfp8", f"does not pay (mxfp8 {rule})"), ("nvfp4", f"does not pay (nvfp4 {rule})"))


def test_a_device_without_a_format_does_not_offer_it():
    table = device_of({"peak": {"float32": 1e13, "bfloat16": 1e14}, "bandwidth": 1e12, "size_rule": False})
    c = candidates(Site("mlp", ((8192, 8192, 8192),)), formats_of(("float8", "bfloat16", "float32")), table, False)
    assert [f.name for f in c.chain] == ["bfloat16", "float32"]
    assert c.left_out == (("float8", "custom has no float8 GEMM"),)


def test_newer_devices_are_faster_and_b200_has_the_block_scaled_kinds():
    g = (8192, 8192, 8192)
    times = [gemm_time(DEVICES[d], F8, g, grads=True) for d in ("h100", "h200", "b200")]
    assert times[0] > times[1] > times[2]
    assert {"mxfp8", "nvfp4", "mxfp4"} <= set(DEVICES["b200"].peak)
    assert not {"mxfp8", "nvfp4", "mxfp4"} & set(H100.peak)


@pytest.mark.parametrize(
    ("device", "err", "match"),
    [("a100", ValueError, "expects one of 'h100', 'h200', 'b200'"), (3, TypeError, "expects one of"),
     ({"peak": {"bfloat16": 1e14}, "bandwidth": 1e12}, ValueError, "float32 and bfloat16 are needed"),
     ({"peak": {"bfloat16": 1e14, "float32": -1}, "bandwidth": 1e12}, ValueError, "a table"),
     ({"peak": {"bfloat16": 1e14, "float32": 1e13}, "bandwidth": 1e12, "speed": 1}, ValueError, "a table")],
)  # fmt: skip
def test_bad_devices_name_the_argument(device, err, match):
    with pytest.raises(err, match=match):
        device_of(device)


@pytest.mark.parametrize(("formats", "err"), [("float8", TypeError), (("float9",), ValueError), ((), ValueError)])
def test_bad_formats_name_the_argument(formats, err):
    with pytest.raises(err, match=r"plan\(formats=...\)"):
        formats_of(formats)


def test_the_float32_format_is_priced_at_float32s_peak():
    g = (8192, 8192, 8192)
    assert gemm_time(H100, F32, g, grads=False) == pytest.approx(2 * 8192**3 / 66.9e12)


def test_block_scaled_formats_are_offered_where_the_device_has_them():
    fmts = formats_of(("nvfp4", "mxfp8", "float8", "bfloat16", "float32"))
    site = Site("mlp", ((8192, 8192, 8192),))
    b200 = candidates(site, fmts, DEVICES["b200"], True)
    assert [f.name for f in b200.chain] == ["nvfp4", "float8", "bfloat16", "float32"]
    assert ("mxfp8", "no faster than a format at least as precise") in b200.left_out  # its scales cost bytes
    h100 = candidates(site, fmts, H100, True)
    assert [f.name for f in h100.chain] == ["float8", "bfloat16", "float32"]
    assert ("nvfp4", "h100 has no nvfp4 GEMM") in h100.left_out
    assert FORMATS["nvfp4"].policy == "mixed_nvfp4" and FORMATS["nvfp4"].unit_roundoff == 2.0**-2
