"""``fmp.quantize``: MX formats bit for bit with torchao's ``to_mx`` in every scale mode, NVFP4 against an
independent float64 transcription of Transformer Engine's scale chain, padding, non-finite blocks and stochastic
rounding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fmp

F32 = np.float32
MX = {"mxfp8": ("float8_e4m3fn", 448.0), "mxfp8_e5m2": ("float8_e5m2", 57344.0), "mxfp4": ("float4_e2m1fn", 6.0)}
MODES = ("rceil", "floor", "ceil", "even")


def adversarial_blocks(block: int, top: float, seed: int = 0) -> np.ndarray:
    """Rows of ``4 * block`` float32 values; every block is a case a scale rule can get wrong."""
    rng = np.random.default_rng(seed)
    rows = []

    def add(values):
        values = np.asarray(values, F32).ravel()
        rows.append(np.resize(values, block) if values.size != block else values)

    for e in (-140, -126, -120, -60, -10, 0, 7, 8, 9, 60, 100, 120, 126):  # tiny (subnormal) to huge amax
        add(rng.standard_normal(block).astype(F32) * F32(2.0**e))
    for e in rng.integers(-135, 120, 48):  # heavy tails at random magnitudes
        add(rng.standard_t(2, block).astype(F32) * F32(2.0 ** float(e)))
    add(np.zeros(block))  # a zero block
    add(np.concatenate([[F32(3e4)], rng.standard_normal(block - 1)]))  # an outlier
    add(np.concatenate([[F32(-1e-3)], np.zeros(block - 1)]))  # one tiny value among zeros
    for k in (-140, -130, -127, -126, -20, 0, 5, 60, 100):  # amax / element_max at and above a power of two
        for ulps in (0, 1, 3, 1 << 10):
            amax = F32(top) * F32(2.0**k)
            for _ in range(ulps):
                amax = np.nextafter(amax, F32(np.inf), dtype=F32)
            add(np.concatenate([[amax], rng.uniform(-1, 1, block - 1).astype(F32) * amax]))
    grid = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 1.0 + 1 / 16, 1.0 + 3 / 16, 200.0 + 8.0], F32)
    add(np.concatenate([[F32(6.0 * 2**8)], grid * F32(2**8)]))  # element ties after scaling
    add(np.concatenate([[F32(448.0)], grid]))
    add(np.full(block, F32(np.finfo(F32).max)))  # the largest float32
    add(np.concatenate([[F32(np.finfo(F32).tiny)], np.full(block - 1, F32(1e-45))]))  # smallest normal, subnormals
    for bad in (np.inf, -np.inf, np.nan):  # non-finite blocks
        add(np.concatenate([[F32(bad)], rng.standard_normal(block - 1)]))
    x = np.concatenate(rows)
    pad = -x.size % (4 * block)
    return np.concatenate([x, np.zeros(pad, F32)]).reshape(-1, 4 * block)


def _torchao(x: np.ndarray, elem: str, mode: str):
    torch = pytest.importorskip("torch")
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    config = pytest.importorskip("torchao.prototype.mx_formats.config")
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    dtype = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}.get(elem, torch.float4_e2m1fn_x2)
    scale, data = mx.to_mx(torch.from_numpy(x), dtype, 32, config.ScaleCalculationMode(mode))
    scale = scale.view(torch.uint8).numpy()
    if elem == "float4_e2m1fn":  # packed two per byte, low nibble first
        packed = data.view(torch.uint8).numpy()
        codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(x.shape)
        del kernels
    else:
        codes = data.view(torch.uint8).numpy()
    return scale, codes


def _rceil_log2_window(x: np.ndarray, top: float) -> tuple[np.ndarray, np.ndarray]:
    """Blocks where torchao's CPU rceil, ``ceil(log2(amax / top))`` with a float32 ``log2``, misses the exact
    round-up of the quotient (the logarithm of a value just above a power of two rounds to the integer), and
    the exact answer there as an e8m0 byte (what the GPU's ``cvt.rp`` and Transformer Engine compute)."""
    torch = pytest.importorskip("torch")
    amax = torch.from_numpy(np.abs(x.reshape(*x.shape[:-1], -1, 32))).amax(-1)
    d = amax / top
    torchao = torch.clamp(torch.ceil(torch.log2(d)), -127, 127).numpy()
    with np.errstate(divide="ignore"):
        exact = np.clip(np.ceil(np.log2(d.numpy().astype(np.float64))), -127, 127)
    window = (torchao != exact) & np.isfinite(d.numpy())
    return window, (np.nan_to_num(exact) + 127).astype(np.uint8)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", list(MX))
def test_mx_bit_for_bit_with_torchao(fmt, mode):
    elem, top = MX[fmt]
    x = adversarial_blocks(32, top)
    want_scale, want_codes = _torchao(x, elem, mode)
    q = fmp.quantize(x, fmt, scale_rounding=mode)
    assert q.data.dtype == jnp.dtype(elem) and q.scale.dtype == jnp.float8_e8m0fnu and q.data.shape == x.shape
    assert q.tensor_scale is None and q.scale.shape == (x.shape[0], x.shape[1] // 32)
    scale = np.asarray(q.scale).view(np.uint8)
    codes = np.asarray(q.data).view(np.uint8)
    blocks = x.reshape(x.shape[0], -1, 32)
    finite = np.isfinite(blocks).all(-1)
    assert finite.sum() > 100 and (~finite).sum() >= 3
    window = np.zeros_like(finite)
    if mode == "rceil":  # where torchao's float32 log2 misses the round-up, ours is the exact round-up
        window, exact = _rceil_log2_window(x, top)
        assert 0 < window.sum() <= 12  # only blocks built to sit a few ulps above a power of two
        np.testing.assert_array_equal(scale[window], exact[window])
    same = finite & ~window
    np.testing.assert_array_equal(scale[same], want_scale[same])
    # every element of a finite block has torchao's code (a non-finite block's codes are unspecified: torchao's
    # rceil writes NaN codes, its other modes the saturated ones)
    elem_same = np.repeat(same, 32, axis=-1)
    np.testing.assert_array_equal(codes[elem_same], want_codes[elem_same])
    # a block holding an inf or NaN gets the NaN scale (torchao: 0xFF for NaN only) and dequantises to NaN
    assert (scale[~finite] == 0xFF).all()
    deq = np.asarray(q.dequantize()).reshape(blocks.shape)
    assert np.isnan(deq[~finite]).all() and not np.isnan(deq[finite]).any()


# --- NVFP4: an independent transcription of the scale chain ------------------------------------------------------
def _grid(dtype) -> np.ndarray:
    """Every non-negative finite value of a small float format, in code order (code parity = last mantissa bit)."""
    n = 0x7F if dtype == ml_dtypes.float8_e4m3fn else 8
    return np.arange(n, dtype=np.uint8).view(dtype).astype(np.float64)


def _round_even(v: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Round magnitudes to the nearest grid value, ties to the even code, saturating at the top."""
    mag = np.minimum(np.abs(v.astype(np.float64)), grid[-1])
    i = np.clip(np.searchsorted(grid, mag), 1, grid.size - 1)
    lo, hi = grid[i - 1], grid[i]
    pick_hi = (mag - lo > hi - mag) | ((mag - lo == hi - mag) & (i % 2 == 0))
    return np.copysign(np.where(mag <= lo, lo, np.where(pick_hi, hi, lo)), v)


def nvfp4_reference(x: np.ndarray, tiles: bool) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """(codes as values, block scales, S_enc) of a 2-D ``x`` whose dims are multiples of 16, blocks along the
    last axis (or 16 x 16 tiles), from the chain as written: float32 arithmetic, roundings to e4m3 and e2m1
    by nearest value on the format's grid."""
    e4m3, e2m1 = _grid(ml_dtypes.float8_e4m3fn), _grid(ml_dtypes.float4_e2m1fn)
    big = F32(np.finfo(F32).max)
    amax = F32(np.abs(x).max())
    with np.errstate(divide="ignore", over="ignore"):
        s_enc = min(F32(2688.0) / amax, big) if amax > 0 else F32(1.0)
        s_enc = F32(1.0) if s_enc == 0 else s_enc
        m, n = x.shape
        if tiles:
            block_amax = np.abs(x).reshape(m // 16, 16, n // 16, 16).max(axis=(1, 3))
            block_amax = np.repeat(np.repeat(block_amax, 16, 0), 16, 1)
        else:
            block_amax = np.repeat(np.abs(x).reshape(m, n // 16, 16).max(-1), 16, 1)
        s_dec = np.minimum(block_amax * F32(s_enc * F32(1.0 / 6.0)), F32(448.0)).astype(F32)
        s_dec = _round_even(s_dec, e4m3).astype(F32)
        factor = np.minimum(F32(1.0) / (s_dec * (F32(1.0) / s_enc)), big).astype(F32)
        codes = _round_even((x * factor).astype(F32), e2m1)
    scales = s_dec[::16, ::16] if tiles else s_dec[:, ::16]
    return codes, scales, s_enc


def nvfp4_input(m: int, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_t(3, (m, n)) * np.exp2(rng.integers(-8, 8, (m, 1)))).astype(F32)
    x[0, :16] = 0.0  # a zero block
    x[1, :16] *= F32(1e-9)  # a block whose scale underflows e4m3 (scale 0, codes 0)
    x[2, :16] = np.array([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -5, -0.25, 1, 2, 3, 4, 0.5, 1.5], F32)  # ties
    x[3, 16:32] *= F32(1e4)  # an outlier block: sets the tensor amax
    x[4, :16] = F32(2.0**-130)  # subnormal float32 values
    return x


@pytest.mark.parametrize("tiles", [False, True])
def test_nvfp4_follows_the_transformer_engine_scale_chain(tiles):
    x = nvfp4_input(48, 64)
    codes, scales, s_enc = nvfp4_reference(x, tiles)
    q = fmp.quantize(x, "nvfp4", block="16x16" if tiles else "1x16")
    assert q.data.dtype == jnp.float4_e2m1fn and q.scale.dtype == jnp.float8_e4m3fn
    assert q.scale.shape == ((3, 4) if tiles else (48, 4))
    np.testing.assert_array_equal(np.float32(q.tensor_scale), s_enc)
    np.testing.assert_array_equal(np.asarray(q.scale).astype(np.float32), scales)
    np.testing.assert_array_equal(np.asarray(q.data).astype(np.float32), codes)
    assert tiles or (np.asarray(q.scale).astype(np.float32) == 0).any()  # the block whose scale underflows
    per_element = np.repeat(np.repeat(scales, 16, 0), 16, 1) if tiles else np.repeat(scales, 16, 1)
    want = codes.astype(F32) * (per_element * (F32(1.0) / s_enc))
    np.testing.assert_array_equal(np.asarray(q.dequantize()), want)


def test_nvfp4_blocks_along_another_axis_are_the_transposed_blocks():
    x = nvfp4_input(32, 48)
    q0, q1 = fmp.quantize(x, "nvfp4", axis=0), fmp.quantize(x.T, "nvfp4")
    np.testing.assert_array_equal(np.asarray(q0.scale).astype(F32), np.asarray(q1.scale).astype(F32).T)
    np.testing.assert_array_equal(np.asarray(q0.dequantize()), np.asarray(q1.dequantize()).T)


@pytest.mark.parametrize(
    ("fmt", "block"), [("mxfp8", "1x16"), ("mxfp4", "1x16"), ("nvfp4", "1x16"), ("nvfp4", "16x16")]
)
def test_a_length_off_the_block_is_zero_padded(fmt, block):
    x = nvfp4_input(20, 40)
    size = 16 if fmt == "nvfp4" else 32
    padded = np.pad(x, ((0, -20 % 16 if block == "16x16" else 0), (0, -40 % size)))
    q, qp = fmp.quantize(x, fmt, block=block), fmp.quantize(padded, fmt, block=block)
    assert q.data.shape == x.shape and q.scale.shape == qp.scale.shape
    np.testing.assert_array_equal(np.asarray(q.scale).view(np.uint8), np.asarray(qp.scale).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(q.dequantize()), np.asarray(qp.dequantize())[:20, :40])


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp8_e5m2", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_a_block_holding_an_inf_or_nan_dequantises_to_nan(fmt, bad):
    x = np.linspace(-2, 2, 128, dtype=F32).reshape(2, 64)
    x[1, 3] = bad
    deq = np.asarray(fmp.quantize(x, fmt).dequantize())
    size = 16 if fmt == "nvfp4" else 32
    assert np.isnan(deq[1, :size]).all() and not np.isnan(deq[1, size:]).any() and not np.isnan(deq[0]).any()


# --- stochastic rounding ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
def test_stochastic_rounding_replays_with_the_same_key(fmt):
    x = jax.random.normal(jax.random.key(0), (64, 64), jnp.float32)
    a, b = fmp.quantize(x, fmt, key=jax.random.key(7)), fmp.quantize(x, fmt, key=jax.random.key(7))
    c = fmp.quantize(x, fmt, key=jax.random.key(8))
    view = lambda q: np.asarray(q.data).view(np.uint8)  # noqa: E731
    np.testing.assert_array_equal(view(a), view(b))
    assert (view(a) != view(c)).any()
    np.testing.assert_array_equal(np.asarray(a.scale).view(np.uint8), np.asarray(c.scale).view(np.uint8))
    # every stochastic result is the nearest value or its neighbour on the other side of x: one code step away
    magnitude = 0x7F if fmt == "mxfp8" else 0x7
    step = view(a).astype(int) & magnitude, view(fmp.quantize(x, fmt)).astype(int) & magnitude
    assert np.abs(step[0] - step[1]).max() == 1


@pytest.mark.parametrize(("fmt", "top", "value", "low", "high"), [("mxfp4", 6.0, 2.3, 2.0, 3.0),
                                                                  ("mxfp8", 448.0, 1.03, 1.0, 1.125),
                                                                  ("nvfp4", 6.0, 0.6, 0.5, 1.0)])  # fmt: skip
def test_stochastic_rounding_is_unbiased(fmt, top, value, low, high):
    n = 1 << 15
    x = np.full((n // 32, 32), F32(value))
    x[:, ::16] = top  # fixes every block's scale at 1 (NVFP4: S_enc = S_dec = 448)
    q = fmp.quantize(x, fmt, key=jax.random.key(3))
    out = np.delete(np.asarray(q.dequantize()), np.s_[::16], axis=1)
    assert set(np.unique(out)) == {F32(low), F32(high)}
    p = (value - low) / (high - low)
    sd = (high - low) * np.sqrt(p * (1 - p) / out.size)  # the standard deviation of the sample mean
    assert abs(out.mean(dtype=np.float64) - value) < 5 * sd
    nearest = np.delete(np.asarray(fmp.quantize(x, fmt).dequantize()), np.s_[::16], axis=1)
    assert abs(nearest.mean(dtype=np.float64) - value) > 20 * sd  # rounding to nearest is biased here


def test_quantize_names_the_bad_argument():
    x = jnp.ones((4, 32))
    with pytest.raises(ValueError, match="fmt must be one of"):
        fmp.quantize(x, "fp4")
    with pytest.raises(ValueError, match="scale_rounding"):
        fmp.quantize(x, "mxfp8", scale_rounding="up")
    with pytest.raises(ValueError, match="block"):
        fmp.quantize(x, "mxfp8", block="16x16")
    with pytest.raises(ValueError, match="axis"):
        fmp.quantize(x, "mxfp8", axis=2)
    with pytest.raises(TypeError, match="floating"):
        fmp.quantize(jnp.ones(4, jnp.int32), "mxfp8")


def test_quantize_runs_under_jit_and_is_a_pytree():
    x = jax.random.normal(jax.random.key(1), (8, 64), jnp.float32)
    q = jax.jit(lambda v: fmp.quantize(v, "nvfp4"))(x)
    leaves = jax.tree_util.tree_leaves(q)
    assert len(leaves) == 3
    np.testing.assert_array_equal(np.asarray(q.dequantize()), np.asarray(fmp.quantize(x, "nvfp4").dequantize()))
