"""Every op of the installed torch's autocast registries: ``autocast_fx`` vs eager ``torch.autocast``, bitwise.

The ops are read from the installed torch's dispatcher, so each torch release runs its own registry: an op
the release autocasts that fmp's table lacks runs unlisted in the transform and fails here.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
from _helpers.torch_registry import KEYS, live_registry, recorded_registry, recorded_releases

torch = pytest.importorskip("torch")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

import fmp  # noqa: E402
import fmp.torch  # noqa: E402
from fmp.torch._fx._common import ambient_autocast, op_key  # noqa: E402
from tests.torch.fx_op_samples import CUDA_SAMPLES, SAMPLES  # noqa: E402

CPU_OPS = live_registry("cpu")
CUDA_OPS = live_registry("cuda")
LOW = [torch.bfloat16, torch.float16]

# torch's deprecation warnings from the kernels of ops it is phasing out (torch 2.15: lu, lu_solve,
# triangular_solve, chain_matmul, frobenius_norm, nuclear_norm). Each warns once per process, on the first
# call, which in these tests is the eager reference: torch's own call, not fmp's.
TORCH_DEPRECATED = (
    r"(torch\.|at::)(lu|lu_solve|triangular_solve|chain_matmul|frobenius_norm|nuclear_norm) is deprecated"
)


@contextlib.contextmanager
def _reference():
    """The eager reference call: torch's own deprecation warnings ignored, by message."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TORCH_DEPRECATED, category=UserWarning)
        yield


# Every registry op has a sample in fx_op_samples.py. When eager autocast raises for
# an input, the transformed module must raise the same exception type (checked in
# _run); at least one input variant must run, except for these ops, where eager
# torch.autocast raises for every input on this machine:
EAGER_FAILS = {
    "aten::mkldnn_rnn_layer": "oneDNN builds no bf16/f16 LSTM primitive on CPUs without native bf16/f16 "
    "support ('could not create a primitive descriptor'); the transform raises the same RuntimeError",
}

# Outputs an op leaves undefined: only their dtype and shape are compared. mkldnn_rnn_layer's
# last output is oneDNN's uint8 workspace, uninitialised scratch bytes that differ from call to call.
UNDEFINED_OUTPUTS = {
    "aten::mkldnn_rnn_layer": {3},
}

# Ops eager torch.autocast itself does not reproduce bit for bit: compared to 1e-5.
NOT_REPRODUCIBLE = {
    "aten::linalg_lstsq": "MKL's gelsy result depends on buffer alignment: two eager calls on copies of the same "
    "inputs differ in the last bits about half the time",
}


def _resolve(key: str):
    base, _, overload = key.removeprefix("aten::").partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _convert(tree, dtype):
    def leaf(x):
        if isinstance(x, torch.Tensor) and x.dtype.is_floating_point:
            return x.to(dtype)
        return x

    return torch.utils._pytree.tree_map(leaf, tree)


def _assert_bitwise(got, expected, exact=True, undefined=frozenset()):
    got_leaves = torch.utils._pytree.tree_leaves(got)
    exp_leaves = torch.utils._pytree.tree_leaves(expected)
    assert len(got_leaves) == len(exp_leaves)
    for i, (g, e) in enumerate(zip(got_leaves, exp_leaves, strict=True)):
        if not isinstance(e, torch.Tensor):
            assert g == e
            continue
        assert g.dtype == e.dtype
        assert g.shape == e.shape
        if i in undefined:
            continue
        if e.is_complex():
            g, e = torch.view_as_real(g.resolve_conj()), torch.view_as_real(e.resolve_conj())
        assert torch.equal(g.isnan(), e.isnan())
        if exact:
            assert torch.equal(g.nan_to_num(), e.nan_to_num()), "values differ"
        else:
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def _run(op, key, args, kwargs, dtype, device="cpu", in_graph=True):
    def one_op(a, k):
        return op(*a, **k)

    try:
        with _reference(), torch.autocast(device, dtype=dtype):
            expected = one_op(args, kwargs)
    except (RuntimeError, NotImplementedError) as err:
        expected = err
    if isinstance(expected, Exception):
        with pytest.raises(type(expected)):
            fmp.torch.autocast_fx(one_op, (args, kwargs), (device, dtype))(args, kwargs)
        return False
    gm = fmp.torch.autocast_fx(one_op, (args, kwargs), (device, dtype))
    keys = [op_key(n.target) for n in gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload)]
    assert key in keys or not in_graph, f"the traced graph does not contain {key}: {keys}"
    _assert_bitwise(
        gm(args, kwargs), expected, exact=key not in NOT_REPRODUCIBLE, undefined=UNDEFINED_OUTPUTS.get(key, frozenset())
    )
    return True


def test_samples_cover_every_recorded_registry():
    """Every op of every tested release's registries has a sample, and every sample an op of some release."""
    recorded = set()
    for release in recorded_releases():
        registry = recorded_registry(release)
        recorded |= set(registry[KEYS["cpu"]]) | set(registry[KEYS["cuda"]])
    samples = set(SAMPLES) | set(CUDA_SAMPLES)
    assert sorted(recorded - samples) == [], "registry ops without a sample in fx_op_samples.py"
    assert sorted(samples - recorded) == [], "samples of ops no tested release registers"
    assert set(CPU_OPS) | set(CUDA_OPS) <= samples


@pytest.mark.skipif(not hasattr(torch.linalg, "matrix_sqrth"), reason="torch.linalg.matrix_sqrth is new in torch 2.14")
@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "f16"])
def test_matrix_sqrth_matches_eager_autocast(dtype):
    """A low-precision input: LAPACK has no bfloat16 or float16 kernel, so the op must run in float32."""
    a = torch.tensor([[4.0, 1.0], [1.0, 3.0]]).to(dtype)
    # as written, without autocast: RuntimeError in torch 2.14, NotImplementedError (a subclass) in 2.15
    with pytest.raises(RuntimeError, match="Low precision dtypes not supported"):
        torch.linalg.matrix_sqrth(a)
    with torch.autocast("cpu", dtype=dtype):
        expected = torch.linalg.matrix_sqrth(a)
    assert expected.dtype == torch.float32
    gm = fmp.torch.autocast_fx(torch.linalg.matrix_sqrth, (a,), ("cpu", dtype))
    _assert_bitwise(gm(a), expected)
    with fmp.torch.autocast("cpu", dtype=dtype):
        _assert_bitwise(torch.linalg.matrix_sqrth(a), expected)
    custom = fmp.DEFAULT_RULES.derive(framework="torch", unlisted=["aten::matmul"])  # the torch-function mode
    with fmp.torch.autocast("cpu", dtype=dtype, rules=custom):
        _assert_bitwise(torch.linalg.matrix_sqrth(a), expected)


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "f16"])
@pytest.mark.parametrize("key", CPU_OPS)
def test_registry_op_matches_eager_autocast(key, dtype):
    op = _resolve(key)
    torch.manual_seed(0)
    args, kwargs = SAMPLES[key]()
    ran = [_run(op, key, args, kwargs, dtype)]
    ran.append(_run(op, key, *_convert((args, kwargs), dtype), dtype))
    if key not in EAGER_FAILS:
        assert any(ran), f"{key}: eager autocast raised for float32 and for {dtype} inputs"


# ---- the CUDA registry's ops on CPU tensors: unlisted on CPU, but eager CPU autocast can still reach
# them (a composite decomposing into listed ops, a kernel calling listed ops: bilinear's _trilinear) --------

CUDA_ONLY_OPS = sorted(set(CUDA_OPS) - set(CPU_OPS))
# Kernels that exist only for CUDA tensors: eager raises on CPU tensors, and so does the transform.
CPU_RAISES = {
    "aten::_cudnn_rnn": "cuDNN kernel (CUDA builds only)",
    "aten::_scaled_dot_product_flash_attention": "no CPU kernel (the CPU one is _scaled_dot_product_flash_attention_for_cpu)",
    "aten::_thnn_fused_gru_cell": "CUDA-only kernel",
    "aten::_thnn_fused_lstm_cell": "CUDA-only kernel",
    "aten::cudnn_convolution": "cuDNN kernel",
    "aten::cudnn_convolution_transpose": "cuDNN kernel",
}


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "f16"])
@pytest.mark.parametrize("key", CUDA_ONLY_OPS)
def test_cuda_registry_op_on_cpu_matches_eager_autocast(key, dtype):
    op = _resolve(key)
    torch.manual_seed(0)
    args, kwargs = CUDA_SAMPLES[key]() if key in CUDA_SAMPLES else SAMPLES[key]()
    # a composite op is decomposed where autocast reaches inside it, so it need not stay in the graph
    ran = [_run(op, key, args, kwargs, dtype, in_graph=False)]
    ran.append(_run(op, key, *_convert((args, kwargs), dtype), dtype, in_graph=False))
    assert any(ran) != (key in CPU_RAISES), f"{key}: eager CPU autocast raised for float32 and for {dtype} inputs"


# ---- CUDA: no GPU here, so fake CUDA tensors; the oracle is torch's own AutocastCUDA kernel ----------
# (registered in CPU builds too). The transformed graph runs WITHOUT autocast, so every dtype it
# produces comes from the casts / dtype arguments the transform wrote.


def _fake_cuda(mode, tree):
    def leaf(x):  # values do not matter to dtypes; fake tensors carry none
        return torch.empty(x.shape, dtype=x.dtype, device="cuda") if isinstance(x, torch.Tensor) else x

    with mode:
        return torch.utils._pytree.tree_map(leaf, tree)


def _dtypes_of(tree):
    return [(x.dtype, tuple(x.shape)) for x in torch.utils._pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _cuda_variant(op, key, args, kwargs, dtype):
    mode = FakeTensorMode()
    args, kwargs = _fake_cuda(mode, (args, kwargs))

    leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))

    def one_op(*flat):
        a, k = torch.utils._pytree.tree_unflatten(list(flat), spec)
        return op(*a, **k)

    try:
        with _reference(), ambient_autocast({"cuda": (True, dtype)}), mode:
            expected = one_op(*leaves)
    except (RuntimeError, NotImplementedError) as err:
        expected = err

    def transformed():
        try:
            gm = make_fx(one_op, pre_dispatch=True)(*leaves)
        except (RuntimeError, NotImplementedError):  # the raw op refuses these dtypes; trace as autocast runs it
            with ambient_autocast({"cuda": (True, dtype)}):
                gm = make_fx(one_op, pre_dispatch=True)(*leaves)
        out = fmp.torch.autocast_graph(gm, ("cuda", dtype))
        with mode:
            return out(*leaves)

    if isinstance(expected, Exception):
        with pytest.raises(type(expected)):
            transformed()
        return False
    got = transformed()
    assert _dtypes_of(got) == _dtypes_of(expected)
    return True


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "f16"])
@pytest.mark.parametrize("key", CUDA_OPS)
def test_cuda_registry_op_dtypes_match_autocast_cuda(key, dtype):
    if key in FAKE_CUDA_UNRUNNABLE:
        pytest.skip(f"{key}: {FAKE_CUDA_UNRUNNABLE[key]}")
    op = _resolve(key)
    torch.manual_seed(0)
    args, kwargs = CUDA_SAMPLES[key]() if key in CUDA_SAMPLES else SAMPLES[key]()
    ran = [_cuda_variant(op, key, args, kwargs, dtype)]
    ran.append(_cuda_variant(op, key, *_convert((args, kwargs), dtype), dtype))
    if key not in CUDA_RAISES:
        assert any(ran), f"{key}: AutocastCUDA raised for float32 and for {dtype} inputs"


CUDA_RAISES = {
    "aten::binary_cross_entropy": "banned under CUDA autocast: both raise torch's message",
}

_NO_FAKE = "no fake/meta kernel for CUDA tensors, so neither side can run without a GPU"
_CUDA_DECOMP = "its fake CUDA path calls into the CUDA runtime, which needs a GPU (and a CUDA build)"
# Checked bitwise by test_cuda_registry_op_bitwise_on_gpu when a GPU is present.
FAKE_CUDA_UNRUNNABLE = {
    "aten::_cudnn_rnn": "its AutocastCUDA kernel flattens the weights with cuDNN, which needs a GPU",
    "aten::_thnn_fused_gru_cell": _NO_FAKE,
    "aten::_thnn_fused_lstm_cell": _NO_FAKE,
    "aten::cudnn_convolution": _NO_FAKE,
    "aten::cudnn_convolution_transpose": _NO_FAKE,
    "aten::gru_cell": _NO_FAKE + " (decomposes into _thnn_fused_gru_cell on CUDA)",
    "aten::lstm_cell": _NO_FAKE + " (decomposes into _thnn_fused_lstm_cell on CUDA)",
    "aten::grid_sampler": _NO_FAKE + " (dispatches to cudnn_grid_sampler): both sides raise",
    "aten::cosine_similarity": _CUDA_DECOMP,
    "aten::multi_margin_loss": _CUDA_DECOMP,
    "aten::multilabel_margin_loss": _CUDA_DECOMP,
    **dict.fromkeys(
        [
            "aten::_upsample_nearest_exact1d",
            "aten::_upsample_nearest_exact2d",
            "aten::_upsample_nearest_exact3d",
            "aten::upsample_bicubic2d",
            "aten::upsample_bilinear2d",
            "aten::upsample_nearest1d",
            "aten::upsample_nearest2d",
            "aten::upsample_nearest3d",
        ],
        _CUDA_DECOMP,
    ),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "f16"])
@pytest.mark.parametrize("key", CUDA_OPS)
def test_cuda_registry_op_bitwise_on_gpu(key, dtype):
    op = _resolve(key)
    torch.manual_seed(0)
    args, kwargs = CUDA_SAMPLES[key]() if key in CUDA_SAMPLES else SAMPLES[key]()
    args, kwargs = torch.utils._pytree.tree_map(
        lambda x: x.cuda() if isinstance(x, torch.Tensor) else x, (args, kwargs)
    )
    ran = [_run(op, key, args, kwargs, dtype, "cuda")]
    ran.append(_run(op, key, *_convert((args, kwargs), dtype), dtype, "cuda"))
    if key not in CUDA_RAISES:
        assert any(ran), f"{key}: eager CUDA autocast raised for float32 and for {dtype} inputs"


# ---- ops in neither registry that eager autocast still reaches: composites (decomposed, or kept in a
# one-op autocast region when fake tensors cannot trace their decomposition, as cov's) and kernels that
# call listed ops (bilinear's _trilinear), beside ones it does not reach. Forward values and dtypes, bitwise.


def _unlisted_cases():
    r = torch.randn
    nn = torch.nn
    torch.manual_seed(0)
    sq = r(4, 4)
    seq = r(3, 2, 4)
    return {
        "cov": (torch.cov, (sq,)),
        "corrcoef": (torch.corrcoef, (sq,)),
        "matrix_exp": (torch.linalg.matrix_exp, (sq,)),
        "matrix_power": (lambda a: torch.linalg.matrix_power(a, 3), (sq,)),
        "kron": (torch.kron, (sq, sq)),
        "pairwise_distance": (nn.functional.pairwise_distance, (sq, r(4, 4))),
        "matrix_norm_nuc": (lambda a: torch.linalg.matrix_norm(a, "nuc"), (sq,)),
        "bilinear": (nn.Bilinear(4, 4, 3), (sq, r(4, 4))),
        "pinv": (torch.linalg.pinv, (sq,)),
        "euclidean_dist": (torch.ops.aten._euclidean_dist.default, (sq, r(3, 4))),
        "foreach_mm": (lambda a, b: torch.ops.aten._foreach_mm.default([a], [b]), (sq, r(4, 4))),
        "rnn_tanh": (nn.RNN(4, 5, 2), (seq,)),
        "gru": (nn.GRU(4, 5, 2), (seq,)),
        "lstm_cell": (nn.LSTMCell(4, 5), (sq,)),
        "transformer_decoder": (nn.TransformerDecoderLayer(4, 2, 8, dropout=0.0), (seq, r(3, 2, 4))),
    }


UNLISTED_CASES = sorted(_unlisted_cases())


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "f16"])
@pytest.mark.parametrize("name", UNLISTED_CASES)
def test_unlisted_op_matches_eager_autocast(name, dtype):
    fn, args = _unlisted_cases()[name]
    with torch.autocast("cpu", dtype=dtype):
        expected = fn(*args)
    _assert_bitwise(fmp.torch.autocast_fx(fn, args, ("cpu", dtype))(*args), expected)
