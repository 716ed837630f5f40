"""The default precision rule table, as data.

This module is the single source of truth for which operation runs in which
precision. It holds no logic and imports nothing: ``fmp._core._rules`` wraps it
in `RuleSet`, the JAX transform and the torch FX transform both read
it through that class.

Torch op names are the dispatcher keys autocast is registered on
(``"aten::" + schema name + ("." + overload if not default)``). They were read
from the registries (``AutocastCPU`` / ``AutocastCUDA`` dispatch keys) of torch
2.13.0, 2.14.1 and 2.15.0 and from the header ``ATen/autocast_mode.h``; each torch
table is the union over those releases, and ``TORCH_OP_RELEASES`` names the ops
that not every release registers. ``tests/core/test_rules.py`` checks the table
against the registries recorded from each release (``tests/core/autocast_registry``)
and against the live registry of the installed torch, and fails if they drift apart.

JAX primitive names are mapped by meaning: matrix products and convolutions run
in the compute dtype; exponentials, logarithms, powers, special functions,
sums, products and cumulative reductions run in float32; multi-input
elementwise ops promote to their widest floating input; everything else
(``max``, ``tanh``, data movement, comparisons of one dtype, ...) runs in the
types it is given.
"""

JAX_LOWER_PRECISION = ("ragged_dot_general",)

# lower_precision ops that run in float8 under a policy with a float8 recipe (lower_precision otherwise)
JAX_FLOAT8 = (
    "conv_general_dilated",
    "dot_general",
)

JAX_FLOAT32 = (
    # exponentials and logarithms
    "exp",
    "exp2",
    "expm1",
    "log",
    "log1p",
    # powers: torch's CUDA autocast runs pow (and so square, reciprocal) in float32. x**n with a
    # small integer n (``integer_pow``) is left unlisted, as torch's CPU autocast leaves pow: it keeps
    # gelu's cube in the compute dtype, as a hand-cast bfloat16 Dense + gelu would
    "pow",
    "rsqrt",
    "square",
    # trigonometric and hyperbolic functions with large dynamic range
    "acos",
    "asin",
    "cosh",
    "sinh",
    "tan",
    # special functions
    "bessel_i0e",
    "bessel_i1e",
    "digamma",
    "erf_inv",
    "erfc",
    "igamma",
    "igamma_grad_a",
    "igammac",
    "lgamma",
    "polygamma",
    "regularized_incomplete_beta",
    "zeta",
    # linear algebra and FFT (every primitive of jax.lax.linalg and jax.lax.fft that computes on floats):
    # torch's CPU autocast runs its whole linalg_* / fft_* family in float32; in bfloat16 a factorisation
    # loses all precision (8 bits of mantissa) and LAPACK has no bfloat16 kernels
    "cholesky",
    "cholesky_update",
    "eig",
    "eigh",
    "fft",
    "geqp3",
    "geqrf",
    "hessenberg",
    "householder_product",
    "lu",
    "ormqr",
    "qr",
    "schur",
    "svd",
    "symmetric_product",
    "triangular_solve",
    "tridiagonal",
    "tridiagonal_solve",
    # iterative and custom linear solves (jnp.linalg.solve / inv, lax.custom_root's jvp): their bodies run
    # under a float32 policy, their custom rules kept (fmp/_autocast/_hops/_calls.py)
    "custom_linear_solve",
    # random sampling with float parameters (gamma's rejection sampler is unstable in bfloat16)
    "random_gamma",
    # sums, products and cumulative reductions
    "cumlogsumexp",
    "cumprod",
    "cumsum",
    "reduce_prod",
    "reduce_sum",
)

JAX_PROMOTE = (
    "add",
    "add_any",
    "atan2",
    "clamp",
    "concatenate",
    "div",
    "dynamic_update_slice",
    "eq",
    "ge",
    "gt",
    "le",
    "lt",
    "max",
    "min",
    "mul",
    "ne",
    "nextafter",
    "pad",
    "rem",
    "scatter",
    "scatter-add",
    "scatter-max",
    "scatter-min",
    "scatter-mul",
    "scatter-sub",
    "select_n",
    "sub",
)

JAX_BANNED: dict[str, str] = {}

# Primitives of jax.lax.linalg, jax.lax.fft and jax.lax.special deliberately left out of the float32 list,
# with the reason; ``tests/autocast/test_linalg.py`` enumerates the installed JAX's primitives of those
# modules and fails on any that is in neither list.
JAX_TOUCHY_EXEMPT = {
    "lu_pivots_to_permutation": "integer pivots in, integer permutation out: no floating input",
    "erf": "bounded output in [-1, 1], as torch's autocast leaves erf unlisted; erfc and erf_inv are float32",
}

# Epilogue ops: a promote op listed here runs in the compute dtype when one
# operand is the compute-dtype result of a linear layer's product (a
# ``dot_general`` without batch dimensions) or of a convolution (through
# reshape / broadcast_in_dim / convert_element_type / squeeze / transpose) and
# the other is a bias as torch's linear and conv take one: smaller than the
# result, varying only along its output features (the free dimensions of one
# operand of the product; a convolution's feature dimension), not computed
# from the result. This is JAX's form of torch's linear / addmm / conv taking
# the bias inside the low-precision op: the activation after ``x @ w + b``
# stays in the compute dtype. Anything else added to a matmul's result (an
# attention mask or bias shaped like the scores or varying along their batch
# or head dimensions, a residual) takes the op's own rule: a float32 operand
# makes the add float32, as torch's type promotion does after its matmul.
JAX_EPILOGUE = (
    "add",
    "sub",
)

# Contractions with no matmul work: a listed op whose contracting dimensions
# hold one element in all (an outer product ``einsum("i,j->ij")``, a
# batch-only product, a contraction over dimensions of size 1) computes each
# output element as one product. It is decided as ``mul`` is (promote: it runs
# in its inputs' dtype), as torch's CPU autocast runs ``einsum`` and ``outer``
# without contraction (they dispatch to ``mul``), so rotary angles
# ``einsum("i,j->ij", positions, inv_freq)`` keep float32.
JAX_UNCONTRACTED = ("dot_general",)

# --- torch 2.13 to 2.15, CUDA autocast (ATen/autocast_mode.h lists + autocast_mode.cpp) ---

TORCH_CUDA_LOWER_PRECISION = (
    "aten::_convolution",
    "aten::_convolution.deprecated",
    "aten::_cudnn_rnn",  # CUDA builds only; its kernel casts to float16 whatever the autocast dtype
    "aten::_scaled_dot_product_flash_attention",
    "aten::_thnn_fused_gru_cell",
    "aten::_thnn_fused_lstm_cell",
    "aten::addbmm",
    "aten::addmm",
    "aten::addmv",
    "aten::addr",
    "aten::baddbmm",
    "aten::bmm",
    "aten::chain_matmul",
    "aten::conv1d",
    "aten::conv2d",
    "aten::conv3d",
    "aten::conv_tbc",
    "aten::conv_transpose1d",
    "aten::conv_transpose2d.input",
    "aten::conv_transpose3d.input",
    "aten::convolution",
    "aten::cudnn_convolution",
    "aten::cudnn_convolution_transpose",
    "aten::einsum",
    "aten::gru_cell",
    "aten::linalg_multi_dot",
    "aten::linalg_vecdot",
    "aten::linear",
    "aten::lstm_cell",
    "aten::matmul",
    "aten::mm",
    "aten::mv",
    "aten::prelu",
    "aten::rnn_relu_cell",
    "aten::rnn_tanh_cell",
    "aten::scaled_dot_product_attention",
)

TORCH_CUDA_FLOAT32 = (
    "aten::_upsample_bicubic2d_aa",
    "aten::_upsample_bilinear2d_aa",
    "aten::_upsample_nearest_exact1d",
    "aten::_upsample_nearest_exact2d",
    "aten::_upsample_nearest_exact3d",
    "aten::acos",
    "aten::asin",
    "aten::binary_cross_entropy_with_logits",
    "aten::cdist",
    "aten::cosh",
    "aten::cosine_embedding_loss",
    "aten::cosine_similarity",
    "aten::dist",
    "aten::erfinv",
    "aten::exp",
    "aten::expm1",
    "aten::frobenius_norm.dim",
    "aten::group_norm",
    "aten::hinge_embedding_loss",
    "aten::huber_loss",
    "aten::kl_div",
    "aten::l1_loss",
    "aten::layer_norm",
    "aten::linalg_matrix_sqrth",
    "aten::log",
    "aten::log10",
    "aten::log1p",
    "aten::log2",
    "aten::logsumexp",
    "aten::margin_ranking_loss",
    "aten::mse_loss",
    "aten::multi_margin_loss",
    "aten::multilabel_margin_loss",
    "aten::native_layer_norm",
    "aten::nll_loss",
    "aten::nll_loss2d",
    "aten::nuclear_norm",
    "aten::nuclear_norm.dim",
    "aten::pdist",
    "aten::poisson_nll_loss",
    "aten::pow.Scalar",
    "aten::pow.Tensor_Scalar",
    "aten::pow.Tensor_Tensor",
    "aten::reciprocal",
    "aten::renorm",
    "aten::rms_norm",
    "aten::rsqrt",
    "aten::sinh",
    "aten::smooth_l1_loss",
    "aten::soft_margin_loss",
    "aten::softplus",
    "aten::tan",
    "aten::triplet_margin_loss",
    "aten::upsample_bicubic2d",
    "aten::upsample_bilinear2d",
    "aten::upsample_linear1d",
    "aten::upsample_nearest1d",
    "aten::upsample_nearest2d",
    "aten::upsample_nearest3d",
    "aten::upsample_trilinear3d",
)

# float32 ops whose torch kernel passes ``dtype=float32`` instead of casting
# the inputs ("fp32_set_opt_dtype": only when the first argument is eligible)
TORCH_CUDA_FLOAT32_SET_OPT_DTYPE = (
    "aten::cumprod",
    "aten::cumsum",
    "aten::linalg_matrix_norm",
    "aten::linalg_matrix_norm.str_ord",
    "aten::linalg_vector_norm",
    "aten::log_softmax.int",
    "aten::prod",
    "aten::prod.dim_int",
    "aten::softmax.int",
    "aten::sum",
    "aten::sum.dim_IntList",
)

# float32 ops redispatched to their ``dtype=`` overload ("fp32_append_dtype")
TORCH_CUDA_FLOAT32_APPEND_DTYPE = (
    "aten::norm.Scalar",
    "aten::norm.ScalarOpt_dim",
)

TORCH_CUDA_PROMOTE = (
    "aten::addcdiv",
    "aten::addcmul",
    "aten::atan2",
    "aten::bilinear",
    "aten::cross",
    "aten::dot",
    "aten::grid_sampler",
    "aten::index_put",
    "aten::scatter_add",
    "aten::tensordot",
    "aten::vdot",
)

TORCH_CUDA_BANNED = {
    "aten::binary_cross_entropy": (
        "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
        "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
        "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
        "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
        "safe to autocast."
    ),
}

# --- torch 2.13 to 2.15, CPU autocast (autocast_mode.cpp, read from the running binaries) ---

TORCH_CPU_LOWER_PRECISION = (
    "aten::_addmm_activation",
    "aten::_convolution.deprecated",
    "aten::_native_multi_head_attention",
    "aten::addbmm",
    "aten::addmm",
    "aten::baddbmm",
    "aten::bmm",
    "aten::conv1d",
    "aten::conv1d.padding",
    "aten::conv2d",
    "aten::conv2d.padding",
    "aten::conv3d",
    "aten::conv3d.padding",
    "aten::conv_tbc",
    "aten::conv_transpose1d",
    "aten::conv_transpose2d.input",
    "aten::conv_transpose3d.input",
    "aten::linalg_vecdot",
    "aten::linear",
    "aten::matmul",
    "aten::mkldnn_rnn_layer",
    "aten::mm",
    "aten::prelu",
    "aten::scaled_dot_product_attention",
)

# Unlisted ops whose CPU kernels call listed ops through the dispatcher, so eager CPU autocast reaches
# inside them: ``aten::_trilinear`` (what ``bilinear`` decomposes into) runs its ``bmm`` calls in the
# autocast dtype and accumulates them into a float32 output; ``linalg_pinv`` multiplies its SVD factors
# with ``matmul``. Found by running every op of the CPU and CUDA registries on CPU tensors, then the
# CompositeExplicitAutograd ops (kernels made of other ops) that compute matrix products, eager autocast
# against the FX rewrite (tests/torch/fx/test_fx_ops.py).
TORCH_CPU_AUTOCAST_INSIDE = (
    "aten::_euclidean_dist",
    "aten::_foreach_mm",
    "aten::_trilinear",
    "aten::linalg_pinv.atol_rtol_tensor",
)

TORCH_CPU_PROMOTE = (
    "aten::cat",
    "aten::index_copy",
    "aten::stack",
)

TORCH_CPU_FLOAT32 = (
    "aten::_grid_sampler_2d_cpu_fallback",
    "aten::_lu_with_info",
    "aten::adaptive_avg_pool3d",
    "aten::adaptive_max_pool3d",
    "aten::avg_pool3d",
    "aten::binary_cross_entropy",
    "aten::binary_cross_entropy_with_logits",
    "aten::cdist",
    "aten::cholesky",
    "aten::cholesky_inverse",
    "aten::cholesky_solve",
    "aten::cosine_embedding_loss",
    "aten::cross_entropy_loss",
    "aten::ctc_loss.IntList",
    "aten::ctc_loss.Tensor",
    "aten::fake_quantize_per_tensor_affine",
    "aten::fft_fft",
    "aten::fft_fft2",
    "aten::fft_fftn",
    "aten::fft_hfft",
    "aten::fft_ifft",
    "aten::fft_ifft2",
    "aten::fft_ifftn",
    "aten::fft_ihfft",
    "aten::fft_irfft",
    "aten::fft_irfft2",
    "aten::fft_irfftn",
    "aten::fft_rfft",
    "aten::fft_rfft2",
    "aten::fft_rfftn",
    "aten::fractional_max_pool2d",
    "aten::fractional_max_pool3d",
    "aten::geqrf",
    "aten::grid_sampler",
    "aten::grid_sampler_2d",
    "aten::grid_sampler_3d",
    "aten::hinge_embedding_loss",
    "aten::huber_loss",
    "aten::inverse",
    "aten::kl_div",
    "aten::l1_loss",
    "aten::linalg_cholesky",
    "aten::linalg_cholesky_ex",
    "aten::linalg_cond",
    "aten::linalg_cond.p_str",
    "aten::linalg_eig",
    "aten::linalg_eigh",
    "aten::linalg_eigvals",
    "aten::linalg_eigvalsh",
    "aten::linalg_householder_product",
    "aten::linalg_inv",
    "aten::linalg_inv_ex",
    "aten::linalg_lstsq",
    "aten::linalg_matrix_rank",
    "aten::linalg_matrix_rank.atol_rtol_float",
    "aten::linalg_matrix_rank.atol_rtol_tensor",
    "aten::linalg_matrix_rank.tol_tensor",
    "aten::linalg_matrix_sqrth",
    "aten::linalg_qr",
    "aten::linalg_solve",
    "aten::linalg_svd",
    "aten::linalg_svdvals",
    "aten::linalg_tensorinv",
    "aten::linalg_tensorsolve",
    "aten::lu_solve",
    "aten::margin_ranking_loss",
    "aten::max_pool3d",
    "aten::max_unpool2d",
    "aten::max_unpool3d",
    "aten::mse_loss",
    "aten::multi_margin_loss",
    "aten::multilabel_margin_loss",
    "aten::multilabel_margin_loss_forward",
    "aten::nanquantile",
    "aten::nanquantile.scalar",
    "aten::nll_loss",
    "aten::nll_loss2d",
    "aten::orgqr",
    "aten::ormqr",
    "aten::pinverse",
    "aten::poisson_nll_loss",
    "aten::polar",
    "aten::prod",
    "aten::prod.dim_int",
    "aten::qr",
    "aten::quantile",
    "aten::quantile.scalar",
    "aten::reflection_pad1d",
    "aten::reflection_pad2d",
    "aten::replication_pad1d",
    "aten::replication_pad2d",
    "aten::replication_pad3d",
    "aten::smooth_l1_loss",
    "aten::soft_margin_loss",
    "aten::stft",
    "aten::stft.center",
    "aten::svd",
    "aten::trace",
    "aten::triangular_solve",
    "aten::triplet_margin_loss",
    "aten::view_as_complex",
)

# --- which torch release registers which op ---

# The releases whose registries the torch tables above were read from (major, minor).
TORCH_RELEASES = ((2, 13), (2, 14), (2, 15))

# Ops that not every release of TORCH_RELEASES registers: op -> (first, last) release that has an autocast
# kernel for it, None for an open end. They stay in the tables for the releases that have them; on the
# others no graph can hold them.
TORCH_OP_RELEASES = {
    "aten::cholesky": (None, (2, 13)),  # removed in 2.14: torch.linalg.cholesky
    "aten::qr": (None, (2, 13)),  # removed in 2.14: torch.linalg.qr
    "aten::linalg_matrix_sqrth": ((2, 14), None),  # new in 2.14, float32 on CPU and CUDA
}

# Ops whose AutocastCUDA kernel only CUDA builds compile (ATen/cudnn/AutocastRNN.cpp): a CPU build's
# registry lacks them.
TORCH_CUDA_BUILD_ONLY = ("aten::_cudnn_rnn",)
