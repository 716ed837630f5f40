"""Sample inputs for every op in torch 2.13-2.15's autocast registries (for tests/torch/fx/test_fx_ops.py).

``SAMPLES[key]()`` returns ``(args, kwargs)`` for ``torch.ops.aten.<op>.<overload>``;
floating tensors are float32 (the test also runs them in the autocast dtype).
The test runs the ops of the installed torch's registry, so the samples of ops
that only some releases register (``aten::cholesky`` and ``aten::qr`` up to 2.13,
``aten::linalg_matrix_sqrth`` from 2.14) run only on those releases;
test_fx_ops.py checks that the samples cover every recorded registry.
Built by hand from the op schemas, so the suite does not need torch's test
helpers (``torch.testing._internal`` imports ``expecttest``).
"""

from __future__ import annotations

import torch

r = torch.randn


def _spd(n: int) -> torch.Tensor:
    a = r(n, n)
    return a @ a.T + n * torch.eye(n)


def _well(n: int) -> torch.Tensor:
    return r(n, n) + n * torch.eye(n)


def _idx(high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, high, shape)


def _sign(*shape: int) -> torch.Tensor:
    return torch.randint(0, 2, shape).float() * 2 - 1


def _geqrf():
    a, tau = torch.geqrf(r(5, 3))
    return a, tau


def _lu():
    lu, piv = torch.linalg.lu_factor(_well(4))
    return lu, piv


def _unpool2d():
    x, idx = torch.nn.functional.max_pool2d(r(1, 2, 4, 4), 2, return_indices=True)
    return (x, idx, [4, 4]), {}


def _unpool3d():
    x, idx = torch.nn.functional.max_pool3d(r(1, 2, 4, 4, 4), 2, return_indices=True)
    return (x, idx, [4, 4, 4], [2, 2, 2], [0, 0, 0]), {}


def _mha():
    e, h, b, n = 8, 2, 2, 3
    q = r(b, n, e)
    return (q, q, q, e, h, r(3 * e, e), r(3 * e), r(e, e), r(e)), {"need_weights": False}


def _rnn_layer():
    n_in, hid, seq, batch = 4, 3, 5, 2
    return (
        r(seq, batch, n_in),
        r(4 * hid, n_in),
        r(4 * hid, hid),
        r(4 * hid),
        r(4 * hid),
        r(batch, hid),
        r(batch, hid),
        False,
        [],
        2,
        hid,
        1,
        True,
        False,
        False,
        False,
    ), {}


def _ctc(tensor_lengths: bool):
    t, n, c, s = 12, 2, 5, 4
    log_probs = torch.log_softmax(r(t, n, c), -1)
    targets = torch.randint(1, c, (n, s))
    if tensor_lengths:
        return (log_probs, targets, torch.tensor([t, t]), torch.tensor([s, s - 1])), {}
    return (log_probs, targets, [t, t], [s, s - 1]), {}


SAMPLES = {
    "aten::_addmm_activation": lambda: ((r(5), r(3, 4), r(4, 5)), {"use_gelu": True}),
    "aten::_convolution.deprecated": lambda: (
        (r(1, 2, 6, 6), r(3, 2, 3, 3), r(3), [1, 1], [1, 1], [1, 1], False, [0, 0], 1, False, False, False),
        {},
    ),
    "aten::_grid_sampler_2d_cpu_fallback": lambda: ((r(1, 2, 4, 4), r(1, 3, 3, 2).tanh(), 0, 0, False), {}),
    "aten::_lu_with_info": lambda: ((_well(4),), {}),
    "aten::_native_multi_head_attention": _mha,
    "aten::adaptive_avg_pool3d": lambda: ((r(1, 2, 4, 4, 4), [2, 2, 2]), {}),
    "aten::adaptive_max_pool3d": lambda: ((r(1, 2, 4, 4, 4), [2, 2, 2]), {}),
    "aten::addbmm": lambda: ((r(3, 5), r(2, 3, 4), r(2, 4, 5)), {}),
    "aten::addmm": lambda: ((r(3, 5), r(3, 4), r(4, 5)), {}),
    "aten::avg_pool3d": lambda: ((r(1, 2, 4, 4, 4), [2, 2, 2]), {}),
    "aten::baddbmm": lambda: ((r(2, 3, 5), r(2, 3, 4), r(2, 4, 5)), {}),
    "aten::binary_cross_entropy": lambda: ((torch.rand(4, 3), torch.rand(4, 3)), {}),
    "aten::binary_cross_entropy_with_logits": lambda: ((r(4, 3), torch.rand(4, 3)), {}),
    "aten::bmm": lambda: ((r(2, 3, 4), r(2, 4, 5)), {}),
    "aten::cat": lambda: (([r(2, 3), r(1, 3).bfloat16(), r(2, 3)],), {}),
    "aten::cdist": lambda: ((r(4, 3), r(5, 3)), {}),
    "aten::cholesky": lambda: ((_spd(4),), {}),
    "aten::cholesky_inverse": lambda: ((torch.linalg.cholesky(_spd(4)),), {}),
    "aten::cholesky_solve": lambda: ((r(4, 2), torch.linalg.cholesky(_spd(4))), {}),
    "aten::conv1d": lambda: ((r(1, 2, 8), r(3, 2, 3), r(3)), {}),
    "aten::conv1d.padding": lambda: ((r(1, 2, 8), r(3, 2, 3), r(3), [1], "same"), {}),
    "aten::conv2d": lambda: ((r(1, 2, 6, 6), r(3, 2, 3, 3), r(3)), {}),
    "aten::conv2d.padding": lambda: ((r(1, 2, 6, 6), r(3, 2, 3, 3), r(3), [1, 1], "same"), {}),
    "aten::conv3d": lambda: ((r(1, 2, 5, 5, 5), r(3, 2, 3, 3, 3), r(3)), {}),
    "aten::conv3d.padding": lambda: ((r(1, 2, 5, 5, 5), r(3, 2, 3, 3, 3), r(3), [1, 1, 1], "same"), {}),
    "aten::conv_tbc": lambda: ((r(6, 2, 3), r(3, 3, 4), r(4), 1), {}),
    "aten::conv_transpose1d": lambda: ((r(1, 2, 8), r(2, 3, 3), r(3)), {}),
    "aten::conv_transpose2d.input": lambda: ((r(1, 2, 5, 5), r(2, 3, 3, 3), r(3)), {}),
    "aten::conv_transpose3d.input": lambda: ((r(1, 2, 4, 4, 4), r(2, 3, 3, 3, 3), r(3)), {}),
    "aten::cosine_embedding_loss": lambda: ((r(4, 3), r(4, 3), _sign(4)), {}),
    "aten::cross_entropy_loss": lambda: ((r(4, 5), _idx(5, 4)), {}),
    "aten::ctc_loss.IntList": lambda: _ctc(False),
    "aten::ctc_loss.Tensor": lambda: _ctc(True),
    "aten::fake_quantize_per_tensor_affine": lambda: ((r(4, 3), 0.1, 0, 0, 255), {}),
    "aten::fft_fft": lambda: ((r(8),), {}),
    "aten::fft_fft2": lambda: ((r(4, 8),), {}),
    "aten::fft_fftn": lambda: ((r(2, 4, 8),), {}),
    "aten::fft_hfft": lambda: ((r(8),), {}),
    "aten::fft_ifft": lambda: ((r(8),), {}),
    "aten::fft_ifft2": lambda: ((r(4, 8),), {}),
    "aten::fft_ifftn": lambda: ((r(2, 4, 8),), {}),
    "aten::fft_ihfft": lambda: ((r(8),), {}),
    "aten::fft_irfft": lambda: ((r(8),), {}),
    "aten::fft_irfft2": lambda: ((r(4, 8),), {}),
    "aten::fft_irfftn": lambda: ((r(2, 4, 8),), {}),
    "aten::fft_rfft": lambda: ((r(8),), {}),
    "aten::fft_rfft2": lambda: ((r(4, 8),), {}),
    "aten::fft_rfftn": lambda: ((r(2, 4, 8),), {}),
    "aten::fractional_max_pool2d": lambda: ((r(1, 2, 6, 6), [2, 2], [3, 3], torch.rand(1, 2, 2)), {}),
    "aten::fractional_max_pool3d": lambda: ((r(1, 2, 6, 6, 6), [2, 2, 2], [3, 3, 3], torch.rand(1, 2, 3)), {}),
    "aten::geqrf": lambda: ((r(5, 3),), {}),
    "aten::grid_sampler": lambda: ((r(1, 2, 4, 4), r(1, 3, 3, 2).tanh(), 0, 0, False), {}),
    "aten::grid_sampler_2d": lambda: ((r(1, 2, 4, 4), r(1, 3, 3, 2).tanh(), 0, 0, False), {}),
    "aten::grid_sampler_3d": lambda: ((r(1, 2, 4, 4, 4), r(1, 2, 3, 3, 3).tanh(), 0, 0, False), {}),
    "aten::hinge_embedding_loss": lambda: ((r(4, 3), _sign(4, 3)), {}),
    "aten::huber_loss": lambda: ((r(4, 3), r(4, 3)), {}),
    "aten::index_copy": lambda: ((r(5, 3), 0, torch.tensor([0, 3]), r(2, 3).bfloat16()), {}),
    "aten::inverse": lambda: ((_well(4),), {}),
    "aten::kl_div": lambda: ((torch.log_softmax(r(4, 3), -1), torch.softmax(r(4, 3), -1)), {}),
    "aten::l1_loss": lambda: ((r(4, 3), r(4, 3)), {}),
    "aten::linalg_cholesky": lambda: ((_spd(4),), {}),
    "aten::linalg_cholesky_ex": lambda: ((_spd(4),), {}),
    "aten::linalg_cond": lambda: ((_well(4),), {}),
    "aten::linalg_cond.p_str": lambda: ((_well(4), "fro"), {}),
    "aten::linalg_eig": lambda: ((_well(4),), {}),
    "aten::linalg_eigh": lambda: ((_spd(4),), {}),
    "aten::linalg_eigvals": lambda: ((_well(4),), {}),
    "aten::linalg_eigvalsh": lambda: ((_spd(4),), {}),
    "aten::linalg_householder_product": lambda: (_geqrf(), {}),
    "aten::linalg_inv": lambda: ((_well(4),), {}),
    "aten::linalg_inv_ex": lambda: ((_well(4),), {}),
    "aten::linalg_lstsq": lambda: ((r(5, 3), r(5, 2)), {}),
    "aten::linalg_matrix_rank": lambda: ((r(4, 4), 1e-3), {}),
    "aten::linalg_matrix_rank.atol_rtol_float": lambda: ((r(4, 4),), {"atol": 1e-3}),
    "aten::linalg_matrix_rank.atol_rtol_tensor": lambda: ((r(4, 4),), {"atol": torch.tensor(1e-3)}),
    "aten::linalg_matrix_rank.tol_tensor": lambda: ((r(4, 4), torch.tensor(1e-3)), {}),
    "aten::linalg_matrix_sqrth": lambda: ((_spd(4),), {}),  # torch 2.14 and later
    "aten::linalg_qr": lambda: ((r(5, 3),), {}),
    "aten::linalg_solve": lambda: ((_well(4), r(4, 2)), {}),
    "aten::linalg_svd": lambda: ((r(5, 3),), {}),
    "aten::linalg_svdvals": lambda: ((r(5, 3),), {}),
    "aten::linalg_tensorinv": lambda: ((_well(6).reshape(2, 3, 6),), {"ind": 2}),
    "aten::linalg_tensorsolve": lambda: ((_well(6).reshape(2, 3, 2, 3), r(2, 3)), {}),
    "aten::linalg_vecdot": lambda: ((r(4, 3), r(4, 3)), {}),
    "aten::linear": lambda: ((r(3, 4), r(5, 4), r(5)), {}),
    "aten::lu_solve": lambda: ((r(4, 2), *_lu()), {}),
    "aten::margin_ranking_loss": lambda: ((r(4), r(4), _sign(4)), {}),
    "aten::matmul": lambda: ((r(2, 3, 4), r(4, 5)), {}),
    "aten::max_pool3d": lambda: ((r(1, 2, 4, 4, 4), [2, 2, 2]), {}),
    "aten::max_unpool2d": _unpool2d,
    "aten::max_unpool3d": _unpool3d,
    "aten::mkldnn_rnn_layer": _rnn_layer,
    "aten::mm": lambda: ((r(3, 4), r(4, 5)), {}),
    "aten::mse_loss": lambda: ((r(4, 3), r(4, 3)), {}),
    "aten::multi_margin_loss": lambda: ((r(4, 5), _idx(5, 4)), {}),
    "aten::multilabel_margin_loss": lambda: ((r(2, 4), torch.tensor([[3, 0, -1, 1], [0, 1, 2, 3]])), {}),
    "aten::multilabel_margin_loss_forward": lambda: ((r(2, 4), torch.tensor([[3, 0, -1, 1], [0, 1, 2, 3]]), 1), {}),
    "aten::nanquantile": lambda: ((r(4, 5), torch.tensor([0.25, 0.5])), {"dim": 1}),
    "aten::nanquantile.scalar": lambda: ((r(4, 5), 0.3), {"dim": 1}),
    "aten::nll_loss": lambda: ((torch.log_softmax(r(4, 5), -1), _idx(5, 4)), {}),
    "aten::nll_loss2d": lambda: ((torch.log_softmax(r(2, 5, 3, 3), 1), _idx(5, 2, 3, 3)), {}),
    "aten::orgqr": lambda: (_geqrf(), {}),
    "aten::ormqr": lambda: ((*_geqrf(), r(5, 2)), {}),
    "aten::pinverse": lambda: ((r(5, 3),), {}),
    "aten::poisson_nll_loss": lambda: ((r(4, 3), torch.rand(4, 3) * 3, True, False, 1e-8, 1), {}),
    "aten::polar": lambda: ((torch.rand(4, 3), r(4, 3)), {}),
    "aten::prelu": lambda: ((r(2, 3, 4), r(3)), {}),
    "aten::prod": lambda: ((r(4, 3),), {}),
    "aten::prod.dim_int": lambda: ((r(4, 3), 1), {}),
    "aten::qr": lambda: ((r(5, 3),), {}),
    "aten::quantile": lambda: ((r(4, 5), torch.tensor([0.25, 0.5])), {"dim": 1}),
    "aten::quantile.scalar": lambda: ((r(4, 5), 0.3), {"dim": 1}),
    "aten::reflection_pad1d": lambda: ((r(1, 2, 6), [2, 2]), {}),
    "aten::reflection_pad2d": lambda: ((r(1, 2, 5, 5), [2, 2, 1, 1]), {}),
    "aten::replication_pad1d": lambda: ((r(1, 2, 6), [2, 2]), {}),
    "aten::replication_pad2d": lambda: ((r(1, 2, 5, 5), [2, 2, 1, 1]), {}),
    "aten::replication_pad3d": lambda: ((r(1, 2, 4, 4, 4), [1, 1, 1, 1, 1, 1]), {}),
    "aten::scaled_dot_product_attention": lambda: ((r(2, 2, 5, 4), r(2, 2, 5, 4), r(2, 2, 5, 4)), {}),
    "aten::smooth_l1_loss": lambda: ((r(4, 3), r(4, 3)), {}),
    "aten::soft_margin_loss": lambda: ((r(4, 3), _sign(4, 3)), {}),
    "aten::stack": lambda: (([r(2, 3), r(2, 3).bfloat16()],), {}),
    "aten::stft": lambda: ((r(64), 16, 4, 16, torch.hann_window(16), False, True, True), {}),
    "aten::stft.center": lambda: ((r(64), 16, 4, 16, torch.hann_window(16), True, "reflect", False, True, True), {}),
    "aten::svd": lambda: ((r(5, 3),), {}),
    "aten::trace": lambda: ((r(4, 4),), {}),
    "aten::triangular_solve": lambda: ((r(4, 2), torch.triu(_well(4))), {}),
    "aten::triplet_margin_loss": lambda: ((r(4, 3), r(4, 3), r(4, 3)), {}),
    "aten::view_as_complex": lambda: ((r(4, 3, 2),), {}),
}


def _unary(shape=(4, 3), positive=False, unit=False):
    def make():
        x = r(*shape)
        if positive:
            x = x.abs() + 0.5
        if unit:
            x = x.tanh() * 0.9
        return (x,), {}

    return make


def _cell(kind: str):
    n_in, hid, batch = 4, 3, 2
    gates = {"lstm": 4, "gru": 3, "rnn": 1}[kind]
    hx = (r(batch, hid), r(batch, hid)) if kind == "lstm" else r(batch, hid)
    return (r(batch, n_in), hx, r(gates * hid, n_in), r(gates * hid, hid), r(gates * hid), r(gates * hid)), {}


def _thnn(kind: str):
    hid, batch = 3, 2
    gates = 4 if kind == "lstm" else 3
    if kind == "lstm":
        return (r(batch, gates * hid), r(batch, gates * hid), r(batch, hid), r(gates * hid), r(gates * hid)), {}
    return (r(batch, gates * hid), r(batch, gates * hid), r(batch, hid), r(gates * hid), r(gates * hid)), {}


def _cudnn_rnn():
    n_in, hid, seq, batch = 4, 3, 5, 2
    weights = [r(4 * hid, n_in), r(4 * hid, hid), r(4 * hid), r(4 * hid)]
    # an LSTM (mode 2): input, weights, weight_stride0, weight_buf, hx, cx, mode, hidden_size, proj_size,
    # num_layers, batch_first, dropout, train, bidirectional, batch_sizes, dropout_state
    h = (r(1, batch, hid), r(1, batch, hid))
    return (r(seq, batch, n_in), weights, 4, None, *h, 2, hid, 0, 1, False, 0.0, False, False, [], None), {}


# Ops only on the CUDA autocast lists (the CUDA test also reuses SAMPLES for shared ops).
CUDA_SAMPLES = {
    "aten::_convolution": lambda: (
        (r(1, 2, 6, 6), r(3, 2, 3, 3), r(3), [1, 1], [1, 1], [1, 1], False, [0, 0], 1, False, False, False, False),
        {},
    ),
    "aten::_cudnn_rnn": _cudnn_rnn,  # CUDA builds only
    "aten::_scaled_dot_product_flash_attention": lambda: ((r(2, 2, 5, 8), r(2, 2, 5, 8), r(2, 2, 5, 8)), {}),
    "aten::_thnn_fused_gru_cell": lambda: _thnn("gru"),
    "aten::_thnn_fused_lstm_cell": lambda: _thnn("lstm"),
    "aten::_upsample_bicubic2d_aa": lambda: ((r(1, 2, 4, 4), [8, 8], False), {}),
    "aten::_upsample_bilinear2d_aa": lambda: ((r(1, 2, 4, 4), [8, 8], False), {}),
    "aten::_upsample_nearest_exact1d": lambda: ((r(1, 2, 4), [8]), {}),
    "aten::_upsample_nearest_exact2d": lambda: ((r(1, 2, 4, 4), [8, 8]), {}),
    "aten::_upsample_nearest_exact3d": lambda: ((r(1, 2, 4, 4, 4), [8, 8, 8]), {}),
    "aten::acos": _unary(unit=True),
    "aten::addcdiv": lambda: ((r(4), r(4).half(), r(4).abs().half() + 1), {}),
    "aten::addcmul": lambda: ((r(4), r(4).half(), r(4).half()), {}),
    "aten::addmv": lambda: ((r(3), r(3, 4), r(4)), {}),
    "aten::addr": lambda: ((r(3, 4), r(3), r(4)), {}),
    "aten::asin": _unary(unit=True),
    "aten::atan2": lambda: ((r(4).half(), r(4)), {}),
    "aten::bilinear": lambda: ((r(2, 3), r(2, 4), r(5, 3, 4), r(5)), {}),
    "aten::chain_matmul": lambda: (([r(2, 3), r(3, 4), r(4, 2)],), {}),
    "aten::convolution": lambda: ((r(1, 2, 6, 6), r(3, 2, 3, 3), r(3), [1, 1], [1, 1], [1, 1], False, [0, 0], 1), {}),
    "aten::cosh": _unary(),
    "aten::cosine_similarity": lambda: ((r(4, 3), r(4, 3)), {}),
    "aten::cross": lambda: ((r(4, 3).half(), r(4, 3)), {"dim": 1}),
    "aten::cudnn_convolution": lambda: (
        (r(1, 2, 6, 6), r(3, 2, 3, 3), [1, 1], [1, 1], [1, 1], 1, False, False, True),
        {},
    ),
    "aten::cudnn_convolution_transpose": lambda: (
        (r(1, 2, 5, 5), r(2, 3, 3, 3), [0, 0], [0, 0], [1, 1], [1, 1], 1, False, False, True),
        {},
    ),
    "aten::cumprod": lambda: ((r(4, 3).half(), 1), {}),
    "aten::cumsum": lambda: ((r(4, 3).half(), 1), {}),
    "aten::dist": lambda: ((r(4, 3), r(4, 3)), {}),
    "aten::dot": lambda: ((r(4).half(), r(4)), {}),
    "aten::einsum": lambda: (("ij,jk->ik", [r(3, 4), r(4, 5)]), {}),
    "aten::erfinv": _unary(unit=True),
    "aten::exp": _unary(),
    "aten::expm1": _unary(),
    "aten::frobenius_norm.dim": lambda: ((r(4, 3), [1]), {}),
    "aten::group_norm": lambda: ((r(2, 4, 3), 2, r(4), r(4)), {}),
    "aten::gru_cell": lambda: _cell("gru"),
    "aten::index_put": lambda: ((r(5, 3), [torch.tensor([0, 2])], r(2, 3).half()), {}),
    "aten::layer_norm": lambda: ((r(4, 3), [3], r(3), r(3)), {}),
    "aten::linalg_matrix_norm": lambda: ((r(4, 3).half(), 1), {}),
    "aten::linalg_matrix_norm.str_ord": lambda: ((r(4, 3).half(),), {"ord": "fro"}),
    "aten::linalg_multi_dot": lambda: (([r(2, 3), r(3, 4), r(4, 2)],), {}),
    "aten::linalg_vector_norm": lambda: ((r(4, 3).half(),), {}),
    "aten::log": _unary(positive=True),
    "aten::log10": _unary(positive=True),
    "aten::log1p": _unary(positive=True),
    "aten::log2": _unary(positive=True),
    "aten::log_softmax.int": lambda: ((r(4, 3).half(), 1), {}),
    "aten::logsumexp": lambda: ((r(4, 3), [1]), {}),
    "aten::lstm_cell": lambda: _cell("lstm"),
    "aten::mv": lambda: ((r(3, 4), r(4)), {}),
    "aten::native_layer_norm": lambda: ((r(4, 3), [3], r(3), r(3), 1e-5), {}),
    "aten::norm.Scalar": lambda: ((r(4, 3).half(),), {}),
    "aten::norm.ScalarOpt_dim": lambda: ((r(4, 3).half(), 2, [1]), {}),
    "aten::nuclear_norm": lambda: ((r(4, 3),), {}),
    "aten::nuclear_norm.dim": lambda: ((r(4, 3), [0, 1]), {}),
    "aten::pdist": lambda: ((r(4, 3),), {}),
    "aten::pow.Scalar": lambda: ((2.0, r(4, 3)), {}),
    "aten::pow.Tensor_Scalar": lambda: ((r(4, 3), 2), {}),
    "aten::pow.Tensor_Tensor": lambda: ((r(4, 3).abs(), r(4, 3)), {}),
    "aten::reciprocal": _unary(positive=True),
    "aten::renorm": lambda: ((r(4, 3), 2, 0, 1.0), {}),
    "aten::rms_norm": lambda: ((r(4, 3), [3], r(3)), {}),
    "aten::rnn_relu_cell": lambda: _cell("rnn"),
    "aten::rnn_tanh_cell": lambda: _cell("rnn"),
    "aten::rsqrt": _unary(positive=True),
    "aten::scatter_add": lambda: ((r(3, 4), 1, torch.tensor([[0, 1], [2, 3], [1, 0]]), r(3, 2).half()), {}),
    "aten::sinh": _unary(),
    "aten::softmax.int": lambda: ((r(4, 3).half(), 1), {}),
    "aten::softplus": _unary(),
    "aten::sum": lambda: ((r(4, 3).half(),), {}),
    "aten::sum.dim_IntList": lambda: ((r(4, 3).half(), [1]), {}),
    "aten::tan": _unary(unit=True),
    "aten::tensordot": lambda: ((r(3, 4), r(4, 5), [1], [0]), {}),
    "aten::upsample_bicubic2d": lambda: ((r(1, 2, 4, 4), [8, 8], False), {}),
    "aten::upsample_bilinear2d": lambda: ((r(1, 2, 4, 4), [8, 8], False), {}),
    "aten::upsample_linear1d": lambda: ((r(1, 2, 4), [8], False), {}),
    "aten::upsample_nearest1d": lambda: ((r(1, 2, 4), [8]), {}),
    "aten::upsample_nearest2d": lambda: ((r(1, 2, 4, 4), [8, 8]), {}),
    "aten::upsample_nearest3d": lambda: ((r(1, 2, 4, 4, 4), [8, 8, 8]), {}),
    "aten::upsample_trilinear3d": lambda: ((r(1, 2, 4, 4, 4), [8, 8, 8], False), {}),
    "aten::vdot": lambda: ((r(4).half(), r(4)), {}),
}
