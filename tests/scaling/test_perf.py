"""Hot path of loss scaling: NaN detection in large leaves, and the deterministic cost of the compiled
post-gradient step (bytes accessed, temporaries), read from XLA's cost and memory analyses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers.common import load_bench

import fmp
import fmp.optax

B = load_bench("scaler")


# --- NaN in large leaves --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
@pytest.mark.parametrize("size", [1 << 14, 1 << 16, 300_001])
def test_all_finite_sees_nan_in_large_leaves(dtype, bad, size):
    # XLA CPU's max-reduction over 16384+ elements drops NaN (jax 0.10.2): a check built on max|g|
    # passed NaN gradients as finite. Every position class: first, middle, last element.
    x = jnp.ones((size,), dtype)
    assert bool(jax.jit(fmp.all_finite)({"w": x}))
    for i in (0, size // 2 + 1, size - 1):
        assert not bool(jax.jit(fmp.all_finite)({"w": x.at[i].set(bad)})), (i, bad)


def test_nonfinite_leaves_sees_nan_in_a_large_leaf():
    g = {"big": jnp.ones((300, 300)).at[150, 7].set(jnp.nan), "ok": jnp.ones((300, 300))}
    assert fmp.nonfinite_leaves(g) == ["['big']"]


@pytest.mark.parametrize("huge", [3.0e38, -3.0e38])
def test_all_finite_accepts_the_largest_finite_values(huge):
    # a huge finite gradient must not read as an overflow
    x = jnp.zeros((1 << 15,)).at[5].set(huge)
    assert bool(jax.jit(fmp.all_finite)(x))
    assert bool(fmp.all_finite(x.astype(jnp.bfloat16)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("size", [100, 1 << 15])
def test_all_finite_is_exact_when_the_fast_sum_overflows(dtype, size):
    # The fast path sums each leaf; finite values can overflow that sum. The exact check behind it must
    # then say "finite" (torch checks element by element and would not skip this step), and still see
    # a real inf next to the overflowing values.
    big = jnp.finfo(dtype).max
    x = jnp.zeros((size,), dtype).at[1].set(big).at[size - 1].set(big)
    assert not bool(jnp.isfinite(jnp.sum(x)))  # the overflow really happens
    check = jax.jit(fmp.all_finite)
    assert bool(check({"a": x, "b": jnp.ones(3)}))
    assert not bool(check({"a": x, "b": jnp.ones(3).at[0].set(jnp.inf)}))
    assert not bool(check({"a": x.at[size // 2].set(jnp.nan), "b": jnp.ones(3)}))
    assert bool(jax.vmap(check)({"a": jnp.stack([x, x]), "b": jnp.ones((2, 3))}).all())


def test_loss_scaled_skips_a_nan_in_a_large_leaf():
    opt = fmp.optax.loss_scaled(optax.sgd(0.1), fmp.GradScaler(init_scale=4.0))
    params = {"w": jnp.ones((200, 200))}
    state = opt.init(params)
    updates, state = jax.jit(opt.update)({"w": jnp.ones((200, 200)).at[3, 3].set(jnp.nan)}, state, params)
    assert int(state.skipped_steps) == 1
    assert bool(jnp.all(updates["w"] == 0))


# --- deterministic cost of the compiled post-gradient step ----------------------------------------------------------
SHAPES = B.gpt2_like_shapes(1, 1000, d=256, ctx=256)  # 1.1M elements, leaves from 256 to 256*1000


@pytest.fixture(scope="module")
def steps():
    sgd = optax.sgd(B.LR)
    opt = fmp.optax.loss_scaled(sgd, fmp.GradScaler(init_scale=B.SCALE))
    return {
        "fmp": (B.fmp_step, lambda p: fmp.GradScaler(init_scale=B.SCALE)),
        "fmp.optax": (B.fmp_optax_step(opt), opt.init),
    }


@pytest.mark.parametrize("name", ["fmp", "fmp.optax"])
@pytest.mark.parametrize(("grad_dtype", "max_units"), [(jnp.float32, 2.02), (jnp.bfloat16, 3.02)])
def test_post_gradient_step_is_two_passes(steps, name, grad_dtype, max_units):
    # Two passes over the gradients and no more: one read for the finite check, then one fused
    # where(finite, p - lr * g * inv, p) reading grads and params and writing params in place.
    # In units of one read+write of the grads: float32 4 tree-bytes / 2 = 2.0 (floor 1.5, which no
    # design with a bitwise no-op skip and in-place params reaches: the flag must be known before the
    # first param is overwritten); bfloat16 grads 1 + 1 + 4 + 4 over 2 + 2 = 3.0 (floor 2.5).
    step, init = steps[name]
    params = B.make_tree(SHAPES, jnp.float32, 0)
    grads = B.make_tree(SHAPES, grad_dtype, 1)
    with jax.numpy_dtype_promotion("standard"):  # optax.apply_updates adds bf16 updates to f32 params
        units, temp, kernels = B.compiled_traffic(step, params, init(params), grads)
    # small leaves (biases, norms) are concatenated for the check: their bytes are read twice more
    n_small = sum(x.size for x in jax.tree.leaves(grads) if x.size <= 1 << 14)
    small_share = n_small / sum(x.size for x in jax.tree.leaves(grads))
    assert units <= max_units + small_share
    assert units >= max_units - 0.1  # the analysis really counts the passes (guards the bound above)
    assert temp < 0.02 * sum(x.nbytes for x in jax.tree.leaves(params))
    n_big = sum(int(jnp.prod(jnp.array(s))) > 1 << 14 for s in SHAPES.values())
    # one update kernel per leaf, one check kernel per big leaf, a few for scalars and the conds (the
    # exact-check fallback, loss_scaled's apply); 16-bit small leaves are converted one by one before
    # they are concatenated for the check
    assert kernels <= (1 + (grad_dtype != jnp.float32)) * len(SHAPES) + n_big + 14


def test_float16_grads_cost_three_and_a_half_units():
    # XLA CPU has no float16 arithmetic: the check is an and-reduction of isfinite, whose bool
    # intermediate is materialised (a quarter of the float32 tree); still less than max|g| did (0.5)
    params = B.make_tree(SHAPES, jnp.float32, 0)
    grads = B.make_tree(SHAPES, jnp.float16, 1)
    units, temp, _ = B.compiled_traffic(B.fmp_step, params, fmp.GradScaler(), grads)
    assert 3.4 <= units <= 3.52
    assert temp <= 0.26 * sum(x.nbytes for x in jax.tree.leaves(params))


def test_taken_path_bytes_agrees_with_cost_analysis_without_conditionals():
    params = B.make_tree(SHAPES, jnp.float32, 0)
    grads = B.make_tree(SHAPES, jnp.float32, 1)
    # jmp's step has no conditional (fmp's finite check has one: its exact fallback)
    with jax.numpy_dtype_promotion("standard"):  # jmp adds an int32 counter to a bool
        lowered = jax.jit(B.jmp_step, donate_argnums=(0, 1)).lower(params, (jnp.float32(2.0), jnp.int32(0)), grads)
    compiled = lowered.compile()
    assert "conditional(" not in compiled.as_text()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert B.taken_path_bytes(compiled) == pytest.approx(cost["bytes accessed"], rel=0.01)


# --- deterministic cost of a whole train step -----------------------------------------------------------------------
def _train_step_bytes(T, step, init):
    params = T.init_params(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (T.BATCH, T.SEQ), 0, T.VOCAB)
    with jax.numpy_dtype_promotion("standard"):  # optax 0.2.8's adamw mixes int32 and float32
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, init(params), tokens).compile()
    return B.taken_path_bytes(compiled) / sum(x.nbytes for x in jax.tree.leaves(params))


@pytest.mark.parametrize(
    ("pair", "max_extra_trees"),
    [
        # the scaled SGD step reads the grads once more for the check but skips the param copy the
        # unscaled step makes: measured -0.3 trees
        ("sgd", 0.0),
        # AdamW: +1.16 trees for the check and +3.0 for the updates crossing the cond, -1.51 for the param
        # copy the unscaled step makes (docs/benchmarks/scaler.md): measured +2.65
        ("adamw", 2.8),
        # fmp.value_and_grad + a cond around update and apply: the check's read, no updates tree crossing
        # the cond (measured +1.65)
        ("adamw-cond", 1.8),
    ],
)
def test_train_step_extra_bytes(pair, max_extra_trees):
    T = load_bench("train_step")
    if pair == "sgd":
        base = _train_step_bytes(T, T.plain_sgd, lambda p: jnp.zeros(()))
        ours = _train_step_bytes(T, T.fmp_sgd, lambda p: fmp.GradScaler())
    elif pair == "adamw":
        base = _train_step_bytes(T, T.plain_adam, T.ADAM.init)
        ours = _train_step_bytes(T, T.fmp_adam, T.SCALED_ADAM.init)
    else:
        base = _train_step_bytes(T, T.plain_adam, T.ADAM.init)
        ours = _train_step_bytes(T, T.fmp_adam_cond, lambda p: (fmp.GradScaler(), T.ADAM.init(p)))
    assert ours - base <= max_extra_trees
    assert base > 40  # the forward and backward are counted (guards the comparison above)


def test_train_step_diagnostics_differ_from_the_real_step_only_in_what_waits_for_the_flag():
    # bench/train_step.py --decompose: on a finite step both diagnostics must compute what fmp_sgd
    # computes (same params, loss and scaler), otherwise their timings would not split fmp_sgd's overhead
    T = load_bench("train_step")
    params = T.init_params(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (T.BATCH, T.SEQ), 0, T.VOCAB)
    ref_params, ref_scaler, ref_loss = jax.jit(T.fmp_sgd)(params, fmp.GradScaler(), tokens)
    for step in (T.fmp_sgd_flag_unused, T.fmp_sgd_early_flag):
        new_params, scaler, loss = jax.jit(step)(params, fmp.GradScaler(), tokens)
        assert loss == ref_loss
        assert scaler.state_dict() == ref_scaler.state_dict()
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), new_params, ref_params)
    # and the real step does skip: a non-finite gradient leaves params bit for bit
    bad = jax.tree.map(lambda x: x, params)
    bad["ln_f"] = bad["ln_f"].at[0].set(jnp.inf)
    out, scaler, _ = jax.jit(T.fmp_sgd)(bad, fmp.GradScaler(), tokens)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), out, bad)
    assert float(scaler.loss_scale) == 2.0**15  # backed off from 2**16


def test_train_step_torch_peer_is_the_same_model():
    pytest.importorskip("torch")
    T = load_bench("train_step")
    params = T.init_params(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (T.BATCH, T.SEQ), 0, T.VOCAB)
    want = float(T.loss_fn(params, tokens))
    for optimizer in ("sgd", "adamw"):
        for scaled in (False, True):
            run = T.torch_runner(T.BATCH, optimizer, scaled)
            assert run.initial_loss == pytest.approx(want, rel=1e-5)
