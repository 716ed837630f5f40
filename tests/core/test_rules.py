"""The precision rule table: structure, derivation, and drift against torch's live registry."""

from __future__ import annotations

import jax
import pytest
from _helpers.torch_registry import KEYS, live_registry, recorded_registry, recorded_releases

import fmp
from fmp import Category
from fmp._core import _rules_data
from fmp._core._rules import decide
from fmp._core._torch_releases import release_of, torch_registry

CATS = [Category.LOWER_PRECISION, Category.FLOAT32, Category.PROMOTE, Category.BANNED]


def test_issue_named_jax_primitives():
    r = fmp.DEFAULT_RULES
    for name in ("dot_general", "conv_general_dilated"):
        assert r.category(name) is Category.FLOAT8  # lower_precision unless the policy has an fp8 recipe
    for name in (
        "exp log log1p expm1 pow rsqrt erf_inv tan sinh cosh acos asin "
        "reduce_sum reduce_prod cumsum cumprod cumlogsumexp"
    ).split():
        assert r.category(name) is Category.FLOAT32, name
    for name in ("add", "sub", "mul", "div", "max", "min", "atan2", "select_n", "concatenate"):
        assert r.category(name) is Category.PROMOTE, name
    for name in ("tanh", "reduce_max", "transpose", "reshape", "convert_element_type", "sqrt"):
        assert r.category(name) is Category.UNLISTED, name


def test_jax_names_are_real_primitives():
    # Every JAX name in the table must be a primitive this JAX knows; a typo would silently never match.
    from fmp._autocast._engine._jax_internals import primitives_by_name

    known = set(primitives_by_name())
    assert {"dot_general", "exp", "cholesky", "fft", "custom_linear_solve"} <= known
    unknown = sorted(set(fmp.DEFAULT_RULES.jax) - known)
    assert unknown == [], unknown


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_each_torch_op_in_exactly_one_category(device):
    table = fmp.DEFAULT_RULES.table("torch", device)
    per_cat = [set(fmp.DEFAULT_RULES.ops(c, "torch", device)) for c in CATS]
    union = set().union(*per_cat)
    assert sum(len(s) for s in per_cat) == len(union) == len(table)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_torch_table_matches_live_registry(device):
    torch = pytest.importorskip("torch")
    release = release_of(torch.__version__)
    live = set(live_registry(device))
    ours = set(torch_registry(release, device, cuda_build=torch.version.cuda is not None))
    assert live, f"torch reports no {KEYS[device]} kernels: the registry API changed"
    assert release in _rules_data.TORCH_RELEASES, (
        f"torch {torch.__version__} is not a release the table was read from ({_rules_data.TORCH_RELEASES}): "
        "record its registry (tests/_helpers/torch_registry.py) and add it"
    )
    assert sorted(live - ours) == [], f"ops torch {torch.__version__} autocasts that the table lacks ({KEYS[device]})"
    assert sorted(ours - live) == [], f"table ops torch {torch.__version__} does not autocast ({KEYS[device]})"


def test_every_table_release_is_recorded():
    assert recorded_releases() == list(_rules_data.TORCH_RELEASES)


@pytest.mark.parametrize("release", recorded_releases(), ids=lambda r: f"{r[0]}.{r[1]}")
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_torch_table_matches_recorded_registry(device, release):
    """The registry recorded from each tested release (a CUDA build), with no torch installed."""
    recorded = recorded_registry(release)
    assert recorded["cuda"], "recorded from a CPU build: its AutocastCUDA registry lacks the CUDA-only kernels"
    recorded = set(recorded[KEYS[device]])
    ours = set(torch_registry(release, device))
    assert sorted(recorded - ours) == [], f"ops torch {release} autocasts that the table lacks ({device})"
    assert sorted(ours - recorded) == [], f"ops in the table that torch {release} does not autocast ({device})"


def test_version_guards_name_table_ops():
    for op in _rules_data.TORCH_OP_RELEASES:
        assert op in fmp.DEFAULT_RULES.torch_cpu or op in fmp.DEFAULT_RULES.torch_cuda, op
    assert set(_rules_data.TORCH_CUDA_BUILD_ONLY) <= set(fmp.DEFAULT_RULES.torch_cuda)
    assert torch_registry((2, 13), "cuda") - torch_registry((2, 13), "cuda", cuda_build=False) == {"aten::_cudnn_rnn"}


@pytest.mark.parametrize(
    ("version", "release"), [("2.13.0+cpu", (2, 13)), ("2.15.0", (2, 15)), ("2.16.0a0+git0123", (2, 16))]
)
def test_release_of(version, release):
    assert release_of(version) == release


def test_release_of_and_registry_errors():
    with pytest.raises(ValueError, match="version must look like"):
        release_of("nightly")
    with pytest.raises(ValueError, match="device must be one of"):
        torch_registry((2, 15), "mps")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_removed_and_added_ops_follow_their_releases(device):
    """cholesky and qr left torch's CPU registry in 2.14, linalg_matrix_sqrth came (float32, as torch runs it)."""
    old, new = torch_registry((2, 13), device), torch_registry((2, 15), device)
    if device == "cpu":
        assert {"aten::cholesky", "aten::qr"} <= old and not {"aten::cholesky", "aten::qr"} & new
    assert "aten::linalg_matrix_sqrth" in new and "aten::linalg_matrix_sqrth" not in old
    assert fmp.DEFAULT_RULES.category("aten::linalg_matrix_sqrth", "torch", device) is Category.FLOAT32


def test_cuda_categories_match_torch_header():
    # The CUDA categories come from torch's own header macros; re-read them from the installed wheel.
    torch = pytest.importorskip("torch")
    import pathlib
    import re

    header = pathlib.Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
    text = header.read_text()

    def macro(name):
        body = re.search(rf"#define {name}\(_\)(.*?)\n\n", text, re.S).group(1)
        out = set()
        for op, overload in re.findall(r"_\((\w+)(?:,\s*(\w+))?\)", body):
            out.add("aten::" + op + (f".{overload}" if overload else ""))
        return out

    r = fmp.DEFAULT_RULES
    lower = set(r.ops("lower_precision", "torch", "cuda"))
    f32 = set(r.ops("float32", "torch", "cuda"))
    promote = set(r.ops("promote", "torch", "cuda"))
    assert macro("AT_FORALL_LOWER_PRECISION_FP") <= lower
    assert lower - macro("AT_FORALL_LOWER_PRECISION_FP") == {
        "aten::_cudnn_rnn",
        "aten::cudnn_convolution",
        "aten::cudnn_convolution_transpose",
    }
    assert macro("AT_FORALL_FP32") | macro("AT_FORALL_FP32_SET_OPT_DTYPE") <= f32
    # registered outside the header's lists (autocast_mode.cpp, from torch 2.14)
    outside = f32 - macro("AT_FORALL_FP32") - macro("AT_FORALL_FP32_SET_OPT_DTYPE")
    assert outside - set(_rules_data.TORCH_CUDA_FLOAT32_APPEND_DTYPE) == {"aten::linalg_matrix_sqrth"}
    assert macro("AT_FORALL_PROMOTE") == promote
    set_opt = {k for k, v in r.torch_cuda_variants.items() if v == "set_opt_dtype"}
    assert set_opt == macro("AT_FORALL_FP32_SET_OPT_DTYPE")


def test_cpu_categories_match_torch_behaviour():
    """Run a few ops of each CPU category under torch.autocast and compare with the table."""
    torch = pytest.importorskip("torch")
    a = torch.randn(4, 4)
    cases = {
        "aten::mm": lambda: torch.mm(a, a),
        "aten::linear": lambda: torch.nn.functional.linear(a, a),
        "aten::prod": lambda: torch.prod(a.to(torch.bfloat16)),
        "aten::mse_loss": lambda: torch.nn.functional.mse_loss(a.bfloat16(), a.bfloat16()),
        "aten::cat": lambda: torch.cat([a, a.bfloat16()]),
    }
    expected = {
        Category.LOWER_PRECISION: torch.bfloat16,
        Category.FLOAT32: torch.float32,
        Category.PROMOTE: torch.float32,
    }
    for name, fn in cases.items():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn()
        assert out.dtype == expected[fmp.DEFAULT_RULES.category(name, "torch", "cpu")], name


def test_cuda_banned_message_is_torchs():
    msg = fmp.DEFAULT_RULES.banned_message("aten::binary_cross_entropy")
    assert msg.startswith("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.")
    assert "binary_cross_entropy_with_logits" in msg
    assert fmp.DEFAULT_RULES.category("aten::binary_cross_entropy", "torch", "cuda") is Category.BANNED
    assert fmp.DEFAULT_RULES.category("aten::binary_cross_entropy", "torch", "cpu") is Category.FLOAT32


def test_default_banned_message_names_safe_alternative():
    r = fmp.DEFAULT_RULES.derive(banned=["logistic"])
    assert "float32" in r.banned_message("logistic") and "bfloat16" in r.banned_message("logistic")


def test_derive_moves_without_mutating():
    base = fmp.DEFAULT_RULES
    r = base.derive(float32=["dot_general"], unlisted=["exp"], lower_precision=["tanh"])
    assert r.category("dot_general") is Category.FLOAT32
    assert r.category("exp") is Category.UNLISTED and "exp" not in r.jax
    assert r.category("tanh") is Category.LOWER_PRECISION
    assert base.category("dot_general") is Category.FLOAT8
    assert base.category("exp") is Category.FLOAT32
    assert r != base and hash(r) != hash(base)
    assert base.derive() == base and hash(base.derive()) == hash(base)


def test_derive_torch_per_device():
    r = fmp.DEFAULT_RULES.derive(framework="torch", device="cpu", float32=["aten::mm"])
    assert r.category("aten::mm", "torch", "cpu") is Category.FLOAT32
    assert r.category("aten::mm", "torch", "cuda") is Category.LOWER_PRECISION
    both = fmp.DEFAULT_RULES.derive(framework="torch", lower_precision=["aten::softmax.int"])
    assert both.category("aten::softmax.int", "torch", "cuda") is Category.LOWER_PRECISION
    assert both.category("aten::softmax.int", "torch", "cpu") is Category.LOWER_PRECISION
    assert "aten::softmax.int" not in both.torch_cuda_variants
    assert "aten::softmax.int" in fmp.DEFAULT_RULES.torch_cuda_variants


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"fp32": ["exp"]}, ValueError, "unknown precision category 'fp32'"),
        ({"float32": "exp"}, TypeError, r"write float32=\['exp'\]"),
        ({"float32": [3]}, TypeError, "op names as str"),
        ({"float32": ["exp"], "unlisted": ["exp"]}, ValueError, "name it once"),
        ({"framework": "tf", "float32": ["exp"]}, ValueError, "framework must be one of"),
        ({"framework": "torch", "device": "mps", "float32": ["aten::mm"]}, ValueError, "device must be one of"),
    ],
)
def test_derive_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        fmp.DEFAULT_RULES.derive(**kwargs)


@pytest.mark.parametrize("cat", list(Category))
@pytest.mark.parametrize("compute", ["float16", "bfloat16", "float32"])
def test_float64_and_non_float_never_cast(cat, compute):
    assert decide(cat, compute, ["float64"]) is None
    assert decide(cat, compute, []) is None


@pytest.mark.parametrize(
    ("cat", "compute", "inputs", "expected"),
    [
        (Category.LOWER_PRECISION, "bfloat16", ["float32"], "bfloat16"),
        (Category.LOWER_PRECISION, "float16", ["bfloat16"], "float16"),
        (Category.FLOAT32, "bfloat16", ["bfloat16"], "float32"),
        (Category.PROMOTE, "bfloat16", ["bfloat16", "bfloat16"], "bfloat16"),
        (Category.PROMOTE, "bfloat16", ["bfloat16", "float32"], "float32"),
        (Category.PROMOTE, "float16", ["float16", "bfloat16"], "float32"),
        (Category.PROMOTE, "float16", ["float16", "float64"], "float16"),
        (Category.UNLISTED, "bfloat16", ["float32"], None),
        (Category.BANNED, "float16", ["float32"], None),
    ],
)
def test_decide(cat, compute, inputs, expected):
    assert decide(cat, compute, inputs) == expected


def test_rule_set_is_static_jit_argument():
    calls = []

    def f(x, rules):
        calls.append(rules)
        return x

    fj = jax.jit(f, static_argnums=1)
    fj(1.0, fmp.DEFAULT_RULES)
    fj(1.0, fmp.DEFAULT_RULES.derive())
    assert len(calls) == 1


def test_data_module_has_no_duplicates_within_a_device():
    for names in (
        _rules_data.TORCH_CPU_LOWER_PRECISION + _rules_data.TORCH_CPU_FLOAT32 + _rules_data.TORCH_CPU_PROMOTE,
        _rules_data.JAX_LOWER_PRECISION + _rules_data.JAX_FLOAT8 + _rules_data.JAX_FLOAT32 + _rules_data.JAX_PROMOTE,
    ):
        assert len(names) == len(set(names))
