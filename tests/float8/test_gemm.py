"""Float8 matmuls in GEMM form (float8 operands into the matmul, scales on its result) against the emulation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fmp
from fmp._float8 import _dot, _quant
from fmp._float8._dot import float8_dot_general

DN = (((1,), (0,)), ((), ()))


def _run(recipe, x, w):
    """Output, dx and dw for one fixed output cotangent (so both forms' backward products see equal inputs)."""
    g = jax.random.normal(jax.random.key(2), (x.shape[0], w.shape[1]))

    @jax.jit
    def f(x, w):
        out, vjp = jax.vjp(lambda x, w: float8_dot_general(x, w, DN, recipe, jnp.float32), x, w)
        return (out, *vjp(g))

    return f(x, w)


def _operands():
    x = jax.random.normal(jax.random.key(0), (48, 160)) * jnp.linspace(0.1, 30, 160)
    w = jax.random.normal(jax.random.key(1), (160, 24))
    return x, w


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("grad_dtype", ["float8_e5m2", "float8_e4m3fn"])
def test_gemm_form_equals_emulation_bit_for_bit_with_pow2_scales(scaling, grad_dtype):
    x, w = _operands()
    emulated = _run(fmp.Float8Recipe(scaling, grad_dtype=grad_dtype, emulate=True), x, w)
    gemm = _run(fmp.Float8Recipe(scaling, grad_dtype=grad_dtype, emulate=False), x, w)
    for a, b in zip(emulated, gemm, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_gemm_form_with_exact_scales_rounds_once_more_at_most(scaling):
    x, w = _operands()
    emulated = _run(fmp.Float8Recipe(scaling, pow2_scales=False, emulate=True), x, w)
    gemm = _run(fmp.Float8Recipe(scaling, pow2_scales=False, emulate=False), x, w)
    for a, b in zip(emulated, gemm, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.max(np.abs(a - b)) <= 1e-6 * np.max(np.abs(a))


def _dot_operand_dtypes(recipe, x, w):
    jaxpr = jax.make_jaxpr(lambda x, w: float8_dot_general(x, w, DN, recipe, jnp.float32))(x, w)
    found = []

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(tuple(v.aval.dtype.name for v in eqn.invars))
            for p in eqn.params.values():
                inner = getattr(p, "jaxpr", None)
                if inner is not None:
                    walk(getattr(inner, "jaxpr", inner))

    walk(jaxpr.jaxpr)
    return found


def test_gemm_form_gives_the_matmul_float8_operands_and_emulation_float32():
    x, w = _operands()
    assert _dot_operand_dtypes(fmp.Float8Recipe(emulate=False), x, w) == [("float8_e4m3fn", "float8_e4m3fn")]
    assert _dot_operand_dtypes(fmp.Float8Recipe(emulate=True), x, w) == [("float32", "float32")]
    # blockwise scales vary along the contraction: always dequantised first
    assert _dot_operand_dtypes(fmp.Float8Recipe("blockwise", emulate=False), x, w) == [("float32", "float32")]


def test_default_is_the_gemm_where_the_backend_has_one():
    assert _dot.use_gemm(fmp.Float8Recipe()) == _quant.float8_gemm_available()
    assert _quant.float8_gemm_available() is (jax.default_backend() == "gpu" and _quant.float8_gemm_available())
    assert _dot.use_gemm(fmp.Float8Recipe(emulate=False)) and not _dot.use_gemm(fmp.Float8Recipe(emulate=True))
    with pytest.raises(ValueError, match=r"emulate=\.\.\.\) must be None, True or False"):
        fmp.Float8Recipe(emulate="yes")


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_gemm_form_keeps_an_overflow_visible(bad):
    x, w = _operands()
    x = x.at[3, 5].set(bad)
    gemm = _run(fmp.Float8Recipe("tensorwise", emulate=False), x, w)
    emulated = _run(fmp.Float8Recipe("tensorwise", emulate=True), x, w)
    assert not np.isfinite(np.asarray(gemm[0])).all() and not np.isfinite(np.asarray(gemm[2])).all()  # out, dw
    for a, b in zip(gemm, emulated, strict=True):  # (dx = g @ w.T does not see x)
        np.testing.assert_array_equal(np.isfinite(np.asarray(a)), np.isfinite(np.asarray(b)))


def test_delayed_scaling_gemm_form_equals_emulation_and_records_the_same_history():
    x, w = _operands()

    def train(emulate):
        pol = fmp.Policy(jnp.float32, jnp.bfloat16, jnp.float32, float8=fmp.Float8Recipe("delayed", emulate=emulate))
        mm = lambda w, x: x @ w  # noqa: E731
        loss = lambda w, state, x: jnp.mean(fmp.autocast(mm, pol, float8_state=state)(w, x) ** 2)  # noqa: E731
        state = fmp.float8_state(mm, pol)(w, x)
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        outs = []
        for _ in range(3):
            val, (g, g_state) = step(w, state, x)
            state = state.update(g_state)
            outs.append((val, g))
        return outs, state

    (em, s_em), (gm, s_gm) = train(True), train(False)
    for (va, ga), (vb, gb) in zip(em, gm, strict=True):
        np.testing.assert_array_equal(np.asarray(va), np.asarray(vb))
        np.testing.assert_array_equal(np.asarray(ga), np.asarray(gb))
    for a, b in zip(jax.tree.leaves(s_em), jax.tree.leaves(s_gm), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
