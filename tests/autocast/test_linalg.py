"""Linear algebra, FFT and the other numerically touchy primitives run in float32 under autocast.

The rule table decides it (``fmp/_core/_rules_data.py``); these tests enumerate the installed JAX's
primitives so a new touchy one cannot be left unlisted, and compare each jnp.linalg / jnp.fft entry
point under autocast with the same program cast by hand (bitwise, eager) and with float32.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.core import Primitive

import fmp
from fmp._core import _rules_data
from fmp._core._rules import Category

BF16 = jnp.bfloat16
TOUCHY_MODULES = ("jax._src.lax.linalg", "jax._src.lax.fft", "jax._src.lax.special")


def _module_primitives(name: str) -> set[str]:
    mod = importlib.import_module(name)
    return {v.name for v in vars(mod).values() if isinstance(v, Primitive)}


@pytest.mark.parametrize("module", TOUCHY_MODULES)
def test_every_touchy_primitive_is_float32_or_exempt(module: str) -> None:
    names = _module_primitives(module)
    assert names, f"{module} defines no primitives: the enumeration is broken"
    missing = sorted(
        n
        for n in names
        if fmp.DEFAULT_RULES.category(n) is not Category.FLOAT32 and n not in _rules_data.JAX_TOUCHY_EXEMPT
    )
    assert not missing, f"unlisted numerically touchy primitives of the installed JAX: {missing}"


def test_exemptions_name_real_primitives_and_are_not_listed() -> None:
    real = set().union(*(_module_primitives(m) for m in TOUCHY_MODULES))
    for name in _rules_data.JAX_TOUCHY_EXEMPT:
        assert name in real, f"{name} is exempted but the installed JAX has no such primitive"
        assert fmp.DEFAULT_RULES.category(name) is not Category.FLOAT32


# torch's CPU autocast float32 list and the JAX primitive behind the same operation
TORCH_TO_JAX = {
    "aten::linalg_cholesky": "cholesky",
    "aten::linalg_eigh": "eigh",
    "aten::linalg_eig": "eig",
    "aten::linalg_qr": "qr",
    "aten::linalg_svd": "svd",
    "aten::_lu_with_info": "lu",
    "aten::triangular_solve": "triangular_solve",
    "aten::geqrf": "geqrf",
    "aten::ormqr": "ormqr",
    "aten::linalg_householder_product": "householder_product",
    "aten::linalg_solve": "custom_linear_solve",
    "aten::fft_fft": "fft",
    "aten::fft_rfft": "fft",
    "aten::fft_irfft": "fft",
}


@pytest.mark.parametrize(("torch_op", "jax_prim"), sorted(TORCH_TO_JAX.items()))
def test_float32_like_torch_cpu(torch_op: str, jax_prim: str) -> None:
    assert fmp.DEFAULT_RULES.category(torch_op, framework="torch", device="cpu") is Category.FLOAT32
    assert fmp.DEFAULT_RULES.category(jax_prim) is Category.FLOAT32


def _spd(a):
    # ``a = x @ x.T`` is symmetric positive semi-definite; the float32 identity promotes the sum to float32
    return a + 30.0 * jnp.eye(a.shape[0], dtype=jnp.float32)


# each case: a function of a float32 matrix ``a = x @ x.T`` (a matmul, so bfloat16 under autocast); the ops
# before the linear algebra are ones whose hand-cast twin is the same program (no bfloat16 elementwise math)
CASES = {
    "cholesky": lambda a: jnp.linalg.cholesky(_spd(a)),
    "eigh": lambda a: jnp.linalg.eigh(_spd(a))[0],
    "eigvalsh": lambda a: jnp.linalg.eigvalsh(_spd(a)),
    "qr": lambda a: jnp.linalg.qr(a)[1],
    "svd": lambda a: jnp.linalg.svd(a, compute_uv=False),
    "slogdet": lambda a: jnp.linalg.slogdet(_spd(a))[1],
    "det": lambda a: jnp.linalg.det(_spd(a) / 30.0),
    "solve": lambda a: jnp.linalg.solve(_spd(a), a[:, 0]),
    "inv": lambda a: jnp.linalg.inv(_spd(a)),
    "solve_triangular": lambda a: jax.scipy.linalg.solve_triangular(jnp.linalg.cholesky(_spd(a)), a[:, 1], lower=True),
    "cho_solve": lambda a: jax.scipy.linalg.cho_solve(jax.scipy.linalg.cho_factor(_spd(a)), a[:, 2]),
    "lu": lambda a: jax.scipy.linalg.lu(a)[2],
    "rfft": lambda a: jnp.abs(jnp.fft.rfft(a)),
    "fft2": lambda a: jnp.abs(jnp.fft.fft2(a)),
    "irfft": lambda a: jnp.fft.irfft(jnp.fft.rfft(a)),
    "eigvals": lambda a: jnp.sort(jnp.abs(jnp.linalg.eigvals(_spd(a)))),
    "norm2": lambda a: jnp.linalg.norm(a, ord=2),
}
# cases that use ``a`` twice: autocast holds ``a`` in bfloat16 (as a bfloat16 program would) and sums its two
# cotangents in bfloat16, the hand-cast twin above converts ``a`` to float32 first and sums in float32
TWO_USES = {"solve", "solve_triangular", "cho_solve"}


def _inputs():
    x = jax.random.normal(jax.random.key(0), (6, 5))
    return x, x.T


def _auto(case):
    return lambda x, w: CASES[case](x @ w)


def _hand(case):
    return lambda x, w: CASES[case]((x.astype(BF16) @ w.astype(BF16)).astype(jnp.float32))


@pytest.mark.parametrize("case", sorted(CASES))
def test_linalg_matches_hand_cast_program(case: str) -> None:
    x, w = _inputs()
    out = fmp.autocast(_auto(case))(x, w)
    hand = _hand(case)(x, w)
    ref = _auto(case)(x, w)  # float32 throughout
    assert out.dtype == ref.dtype
    np.testing.assert_array_equal(np.asarray(out), np.asarray(hand))  # the same program: bitwise
    # against float32: the only bfloat16 step is the matmul (relative error ~2**-8 per entry), the float32
    # linear algebra after it is well conditioned (30 I + a), so the result stays within a few bf16 ulps
    scale = float(jnp.max(jnp.abs(ref)))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=3e-2 * scale, rtol=0)


@pytest.mark.gallery  # ~10 s: compiles every case
def test_linalg_under_jit() -> None:
    """All cases in one jitted program. XLA on CPU may keep the matmul's bfloat16 result in float32 (in the
    hand-cast program too), so jit is held to the float32 tolerance, not to eager's bits."""
    x, w = _inputs()
    names = sorted(CASES)
    outs = jax.jit(fmp.autocast(lambda x, w: [_auto(c)(x, w) for c in names]))(x, w)
    for name, out in zip(names, outs, strict=True):
        ref = _auto(name)(x, w)
        scale = float(jnp.max(jnp.abs(ref)))
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=3e-2 * scale, rtol=0, err_msg=name)


@pytest.mark.gallery  # ~20 s in all
@pytest.mark.parametrize("case", ["cholesky", "eigh", "qr", "svd", "rfft", "inv", "cho_solve"])
def test_linalg_gradient_matches_hand_cast_program(case: str) -> None:
    x, w = _inputs()
    g = jax.grad(lambda x, w: jnp.sum(fmp.autocast(_auto(case))(x, w)), argnums=(0, 1))(x, w)
    gh = jax.grad(lambda x, w: jnp.sum(_hand(case)(x, w)), argnums=(0, 1))(x, w)
    for a, b in zip(g, gh, strict=True):
        assert a.dtype == jnp.float32
        if case in TWO_USES:  # one bfloat16 rounding of the summed cotangent: 2**-8 relative
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-2 * float(jnp.max(jnp.abs(b))))
        else:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("case", ["qr", "svd", "fft2"])  # jnp.fft.rfft refuses bfloat16 at trace time
def test_bfloat16_inputs_are_computed_in_float32(case: str) -> None:
    """A value the program itself holds in bfloat16 is factorised in float32 (it would fail or round)."""
    x, w = _inputs()
    a = (x @ w).astype(BF16)
    try:
        jax.eval_shape(CASES[case], a)
    except TypeError as e:  # jax 0.11 and 0.12: lax.linalg's qr and svd refuse bfloat16 operands
        assert "bfloat16" in str(e)
        pytest.skip(f"this JAX refuses bfloat16 for {case} when the program is traced, before fmp sees it")
    out = fmp.autocast(CASES[case])(a)
    # computed in float32, then (an output the program returns in bfloat16 keeps its dtype) rounded once
    want = CASES[case](a.astype(jnp.float32)).astype(out.dtype)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


@pytest.mark.parametrize(("case", "prim"), [("qr", "qr"), ("svd", "svd"), ("eigh", "eigh"), ("cholesky", "cholesky")])
def test_factorisations_get_float32_operands_from_a_bfloat16_matmul(case: str, prim: str) -> None:
    """The rule table puts them in float32: the matmul's bfloat16 result is cast back before them, on every JAX
    version (jax 0.11 and 0.12 would refuse a bfloat16 qr or svd operand at trace time)."""
    x, w = _inputs()
    closed = jax.make_jaxpr(fmp.autocast(_auto(case)))(x, w)
    found = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == prim:
                found.append(e.invars[0].aval.dtype)
            if e.primitive.name == "dot_general":
                found.append(("dot", e.invars[0].aval.dtype))
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                walk(getattr(sub, "jaxpr", sub))

    walk(closed.jaxpr)
    assert found[0] == ("dot", BF16) and found[1:] and set(found[1:]) == {jnp.dtype(jnp.float32)}, found


def test_linear_solve_body_runs_under_float32_policy_by_rule() -> None:
    """custom_linear_solve's bodies follow the rule table: float32 by default, the caller's policy when moved."""
    x, w = _inputs()

    def f(x, w):
        a = _spd(x @ w)
        return jax.lax.custom_linear_solve(
            lambda v: a @ v, x[:, 0], lambda mv, b: jnp.linalg.solve(a, b), symmetric=True
        )

    def body_dots(closed):
        eqn = next(e for e in closed.eqns if e.primitive.name == "custom_linear_solve")
        matvec = eqn.params["jaxprs"].matvec
        return [e.invars[0].aval.dtype for e in matvec.eqns if e.primitive.name == "dot_general"]

    cj = jax.make_jaxpr(f)(x, w)
    assert body_dots(fmp.autocast_jaxpr(cj)) == [jnp.float32]
    moved = fmp.DEFAULT_RULES.derive(unlisted=["custom_linear_solve"])
    assert body_dots(fmp.autocast_jaxpr(cj, rules=moved)) == [jnp.dtype(BF16)]
    out = fmp.autocast(f)(x, w)
    np.testing.assert_allclose(np.asarray(out), np.asarray(f(x, w)), rtol=3e-2, atol=3e-3)
    g = jax.grad(lambda x, w: jnp.sum(fmp.autocast(f)(x, w)))(x, w)
    gr = jax.grad(lambda x, w: jnp.sum(f(x, w)))(x, w)
    np.testing.assert_allclose(np.asarray(g), np.asarray(gr), rtol=5e-2, atol=5e-3)


def test_custom_root_with_matmul_and_its_gradient() -> None:
    """lax.custom_root (a custom_jvp whose rule holds a custom_linear_solve) is rewritten, rules kept."""
    x, w = _inputs()

    def f(x, w):
        c = jnp.sum(jnp.tanh(x @ w) ** 2) + 1.0

        def newton(g, y0):
            return jax.lax.fori_loop(0, 30, lambda _, y: y - g(y) / (2 * y), y0)

        return jax.lax.custom_root(lambda y: y**2 - c, 1.0, newton, lambda g, y: y / 2.0)

    out = fmp.autocast(f)(x, w)
    np.testing.assert_allclose(float(out), float(f(x, w)), rtol=1e-2)
    g = jax.grad(lambda x, w: fmp.autocast(f)(x, w))(x, w)
    gr = jax.grad(f)(x, w)
    np.testing.assert_allclose(np.asarray(g), np.asarray(gr), rtol=5e-2, atol=2e-3)


def test_random_gamma_samples_in_float32() -> None:
    """The gamma sampler's rejection loop runs in float32 on a bfloat16 shape parameter."""
    x, w = _inputs()
    key = jax.random.key(2)

    def f(x, w):
        return jax.random.gamma(key, jnp.abs(x @ w) + 1.0)

    out = fmp.autocast(f)(x, w)
    hand = jax.random.gamma(key, (jnp.abs(x.astype(BF16) @ w.astype(BF16)) + 1.0).astype(jnp.float32))
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(hand))


def test_explain_rows_in_a_float32_body_say_why() -> None:
    """Rows inside custom_linear_solve's bodies (direct, and jnp.linalg.solve's) run in float32 and name the
    enclosing rule; moved out of the float32 category, the same rows run in bfloat16 and claim no reason."""
    x, w = _inputs()

    def f(x, w):
        a = _spd(x @ w)
        y = jax.lax.custom_linear_solve(lambda v: a @ v, x[:, 0], lambda mv, b: jnp.linalg.solve(a, b))
        return y + jnp.linalg.solve(a, x[:, 1])

    rows = fmp.explain(f)(x, w).records
    inside = [r for r in rows if "custom_linear_solve" in r.detail]
    assert [r.op for r in rows if r.op == "dot_general" and r.out_after == ("bfloat16",)] == ["dot_general"]  # x @ w
    assert sum(r.op == "dot_general" for r in inside) >= 2  # the matvecs
    for r in inside:
        assert set(r.out_after) <= {"float32"}, r
        assert "float32" in r.detail, r
    # no row runs a lower_precision op in float32 without saying why
    assert not [r for r in rows if r.category == "lower_precision" and r.out_after == ("float32",) and not r.detail]
    moved = fmp.explain(f, rules=fmp.DEFAULT_RULES.derive(unlisted=["custom_linear_solve"]))(x, w).records
    assert not [r for r in moved if "custom_linear_solve" in r.detail]  # (other rows may say why they are no epilogue)
    assert sum(r.op == "dot_general" and r.out_after == ("bfloat16",) for r in moved) >= 3
