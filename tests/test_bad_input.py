"""Bad input, everywhere: every public function of fmp and fmp.optax (and the torch facade's constructors)
gets wrong types, shapes and dtypes and answers with a clear error naming the argument, or a documented
pass-through; nothing is silently mangled.

Documented pass-throughs checked here:
* integer and bool leaves are ignored by ``all_finite``/``nonfinite_leaves`` and returned as they are by
  ``GradScaler.unscale`` (they cannot hold inf/NaN and are not gradients);
* float64 NumPy leaves become float32 without ``jax_enable_x64``, as everywhere in JAX;
* empty trees (``None``, ``{}``, ``[]``) are finite, and select/scale/unscale to themselves;
* Python floats are leaves like 0-d float arrays;
* the torch facade's ``GradScaler`` validates exactly what torch validates (growth/backoff factors only).

Each property runs with a modest number of examples by default; the ``slow`` copies run 20 times as many.
"""

from __future__ import annotations

import math
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fmp
import fmp.optax


def property_test(n: int, **strategies):
    """A default-suite property test with ``n`` examples, and a ``slow`` copy with ``20 * n``."""

    def deco(fn):
        fast = settings(max_examples=n, deadline=None)(given(**strategies)(fn))
        slow = pytest.mark.slow(settings(max_examples=20 * n, deadline=None)(given(**strategies)(fn)))
        return fast, slow

    return deco


# --- strategies -----------------------------------------------------------------------------------------------------
SHAPES = st.sampled_from([(), (3,), (2, 2)])
FLOAT_DTYPES = st.sampled_from([jnp.float16, jnp.bfloat16, jnp.float32])
SPECIAL = st.sampled_from([0.0, 1.5, -2.0, math.inf, -math.inf, math.nan])


@st.composite
def float_arrays(draw):
    shape, dtype = draw(SHAPES), draw(FLOAT_DTYPES)
    values = draw(st.lists(SPECIAL, min_size=math.prod(shape), max_size=math.prod(shape)))
    return jnp.asarray(np.array(values, np.float32).reshape(shape)).astype(dtype)


@st.composite
def other_leaves(draw):
    """Leaves that are not float32-like arrays: ints, bools, float64 NumPy, complex, Python numbers."""
    shape = draw(SHAPES)
    kind = draw(st.sampled_from(["int", "bool", "f64", "complex", "pyfloat", "pyint", "pybool"]))
    if kind == "int":
        return jnp.arange(math.prod(shape), dtype=jnp.int32).reshape(shape)
    if kind == "bool":
        return jnp.zeros(shape, jnp.bool_)
    if kind == "f64":
        return np.full(shape, draw(SPECIAL), np.float64)
    if kind == "complex":
        return jnp.full(shape, complex(draw(SPECIAL), 1.0), jnp.complex64)
    if kind == "pyfloat":
        return draw(SPECIAL)
    if kind == "pyint":
        return draw(st.integers(-5, 5))
    return draw(st.booleans())


LEAVES = st.one_of(float_arrays(), other_leaves())
TREES = st.recursive(
    st.one_of(LEAVES, st.none()),
    lambda kids: st.one_of(
        st.lists(kids, max_size=3),
        st.dictionaries(st.sampled_from(["w", "b", "emb"]), kids, max_size=3),
        st.tuples(kids, kids),
    ),
    max_leaves=6,
)


def _np_nonfinite(x) -> bool:
    """Reference: does this leaf hold an inf/NaN (only float and complex leaves can)?"""
    if isinstance(x, bool | int):
        return False
    arr = np.asarray(x if not hasattr(x, "dtype") or x.dtype != jnp.bfloat16 else x.astype(jnp.float32))
    if not np.issubdtype(arr.dtype, np.inexact):
        return False
    return not bool(np.all(np.isfinite(arr)))


# --- all_finite / nonfinite_leaves ----------------------------------------------------------------------------------
def _finite_checks(tree):
    expected = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0] if _np_nonfinite(x)]
    assert fmp.nonfinite_leaves(tree) == expected
    flag = fmp.all_finite(tree)
    assert flag.dtype == jnp.bool_ and flag.shape == ()
    assert bool(flag) == (not expected)
    assert bool(jax.jit(fmp.all_finite)(tree)) == (not expected) if _all_arrays(tree) else True


def _all_arrays(tree) -> bool:
    return all(hasattr(x, "dtype") for x in jax.tree.leaves(tree))


test_all_finite_any_tree, test_all_finite_any_tree_slow = property_test(20, tree=TREES)(_finite_checks)


@pytest.mark.parametrize("leaf", ["abc", object(), b"x"])
def test_non_numeric_leaves_are_rejected_with_their_path(leaf):
    tree = {"ok": jnp.ones(2), "bad": [leaf]}
    with pytest.raises(TypeError, match=re.escape("all_finite(tree): every leaf must be an array or a number, got")):
        fmp.all_finite(tree)
    with pytest.raises(TypeError, match=re.escape("['bad'][0]")):
        fmp.nonfinite_leaves(tree)
    with pytest.raises(TypeError, match="GradScaler.scale: tree leaves must be float or integer arrays"):
        fmp.GradScaler().scale(tree)


def test_complex_and_python_float_leaves_are_checked():
    # before: complex leaves and Python floats were skipped, so a NaN in them read as finite
    assert not bool(fmp.all_finite({"z": jnp.array([1 + 1j, complex(math.nan, 0)])}))
    assert not bool(fmp.all_finite([1.0, math.inf]))
    assert fmp.nonfinite_leaves({"lr": math.nan}) == ["['lr']"]


# --- GradScaler.scale / unscale -------------------------------------------------------------------------------------
def _unscale_checks(tree):
    s = fmp.GradScaler(init_scale=4.0)
    out = s.unscale(tree)
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(out), strict=True):
        if isinstance(x, bool | int) or (hasattr(x, "dtype") and not jnp.issubdtype(x.dtype, jnp.inexact)):
            assert y is x  # integer and bool leaves pass through untouched
            continue
        xa = jnp.asarray(x)  # the canonical dtype: float64 NumPy is float32 without x64
        assert y.dtype == xa.dtype and y.shape == xa.shape
        if jnp.iscomplexobj(xa):  # real and imaginary parts are unscaled separately
            np.testing.assert_array_equal(np.asarray(y).real, np.asarray(xa).real * np.float32(0.25))
            np.testing.assert_array_equal(np.asarray(y).imag, np.asarray(xa).imag * np.float32(0.25))
        else:
            want = np.asarray(xa.astype(jnp.float32)) * np.float32(0.25)
            np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)), want.astype(np.float32))


test_unscale_any_tree, test_unscale_any_tree_slow = property_test(30, tree=TREES)(_unscale_checks)


def test_scale_rejects_bool_and_complex_and_keeps_empty_trees():
    s = fmp.GradScaler(init_scale=2.0)
    for bad, name in ((jnp.array(True), "bool"), (jnp.array(1j), "complex64")):
        with pytest.raises(
            TypeError, match=f"GradScaler.scale: tree leaves must be float or integer arrays, got {name}"
        ):
            s.scale(bad)
    assert s.scale(None) is None and s.scale({}) == {} and s.unscale([]) == []
    assert s.scale(np.float64(3.0)).dtype == jnp.float32  # float64 NumPy: float32 without x64
    assert s.scale(jnp.arange(2)).dtype == jnp.float32


# --- select_tree ----------------------------------------------------------------------------------------------------
@st.composite
def tree_pairs(draw):
    a = {"w": draw(float_arrays()), "b": draw(float_arrays())}
    kind = draw(st.sampled_from(["same", "structure", "dtype", "shape"]))
    b = jax.tree.map(lambda x: -x, a)
    if kind == "structure":
        b = {"w": b["w"], "c": b["b"]}
    elif kind == "dtype":
        new = jnp.float32 if b["w"].dtype != jnp.float32 else jnp.bfloat16
        b = {**b, "w": b["w"].astype(new)}
    elif kind == "shape":
        b = {**b, "w": jnp.zeros((5,), b["w"].dtype)}
    return kind, a, b


def _select_checks(pair, pred):
    kind, a, b = pair
    if kind == "structure":
        with pytest.raises(ValueError, match="select_tree: a and b must have the same tree structure"):
            fmp.select_tree(jnp.array(pred), a, b)
    elif kind == "dtype":
        with pytest.raises(TypeError, match="select_tree: leaves of a and b must have the same dtype"):
            fmp.select_tree(jnp.array(pred), a, b)
    elif kind == "shape":
        with pytest.raises(ValueError, match="select_tree: leaves of a and b must have the same shape"):
            fmp.select_tree(jnp.array(pred), a, b)
    else:
        out = fmp.select_tree(jnp.array(pred), a, b)
        for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(a if pred else b), strict=True):
            assert x.dtype == y.dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()


test_select_tree_pairs, test_select_tree_pairs_slow = property_test(30, pair=tree_pairs(), pred=st.booleans())(
    _select_checks
)


@pytest.mark.parametrize("pred", [1.0, jnp.float32(1.0), jnp.array([True]), jnp.int32(1), "yes"])
def test_select_tree_pred_must_be_a_bool_scalar(pred):
    with pytest.raises(TypeError, match="pred must be a bool scalar"):
        fmp.select_tree(pred, jnp.ones(2), jnp.zeros(2))


def test_select_tree_empty_trees_and_python_bools():
    assert fmp.select_tree(jnp.array(True), None, None) is None
    assert fmp.select_tree(True, {}, {}) == {}
    assert float(fmp.select_tree(False, 1.0, 2.0)) == 2.0


# --- value_and_grad / grad ------------------------------------------------------------------------------------------
LOSS_KINDS = st.sampled_from(["f32", "f16", "bf16", "vector", "matrix", "int", "bool", "complex"])


def _loss_of(kind):
    def loss(w):
        s = jnp.sum(w**2)
        return {
            "f32": s,
            "f16": s.astype(jnp.float16),
            "bf16": s.astype(jnp.bfloat16),
            "vector": w**2,
            "matrix": jnp.outer(w, w),
            "int": s.astype(jnp.int32),
            "bool": s > 0,
            "complex": s.astype(jnp.complex64),
        }[kind]

    return loss


def _vag_checks(kind, use_grad, has_aux):
    fn = _loss_of(kind)
    f = (lambda w: (fn(w), {"n": 1})) if has_aux else fn
    wrap = fmp.grad if use_grad else fmp.value_and_grad
    call = wrap(f, fmp.GradScaler(init_scale=8.0), has_aux=has_aux)
    w = jnp.array([1.0, -2.0])
    if kind in ("f32", "f16", "bf16"):
        out = call(w)
        grads = (out[0][0] if has_aux else out[0]) if use_grad else out[1]
        np.testing.assert_array_equal(np.asarray(grads, np.float32), [2.0, -4.0])
    else:
        with pytest.raises(
            TypeError,
            match=r"fun must return a float scalar loss .*, got (float32\[2|float32\[2, 2|int32\[\]|bool\[\]|complex64\[\])",
        ):
            call(w)


test_value_and_grad_losses, test_value_and_grad_losses_slow = property_test(
    16, kind=LOSS_KINDS, use_grad=st.booleans(), has_aux=st.booleans()
)(_vag_checks)


@pytest.mark.parametrize("wrap", [fmp.value_and_grad, fmp.grad])
def test_value_and_grad_arguments_are_checked(wrap):
    name = wrap.__name__
    s = fmp.GradScaler()
    loss = lambda w: jnp.sum(w)  # noqa: E731
    with pytest.raises(TypeError, match=re.escape(f"{name}(fun) expects a callable (the loss function), got int")):
        wrap(3, s)
    with pytest.raises(TypeError, match=re.escape(f"fmp.{name}(fun, scaler) needs scaler, an fmp.GradScaler; got no")):
        wrap(loss, None)
    with pytest.raises(TypeError, match="needs scaler, an fmp.GradScaler; got a dict"):
        wrap(loss, fmp.GradScaler().state_dict())
    for argnums in ("a", 1.0, (), (0, "x"), True):
        with pytest.raises(TypeError, match="argnums must be an int or a non-empty sequence of ints, got"):
            wrap(loss, s, argnums=argnums)
    with pytest.raises(TypeError, match="has_aux must be a bool, got 1"):
        wrap(loss, s, has_aux=1)
    with pytest.raises(TypeError, match=re.escape("with has_aux=True, fun must return a pair (loss, aux)")):
        wrap(loss, s, has_aux=True)(jnp.ones(2))
    # integer parameters: jax.grad's own TypeError (documented pass-through)
    with pytest.raises(TypeError, match="grad requires real- or complex-valued inputs"):
        wrap(lambda w: jnp.sum(w).astype(jnp.float32), s)(jnp.arange(2))


# --- GradScaler hyper-parameters ------------------------------------------------------------------------------------
JUNK = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-3, 3),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
    st.sampled_from([np.float32(2.0), jnp.float32(2.0), [2.0], (1,)]),
)
HPARAMS = ["init_scale", "growth_factor", "backoff_factor", "growth_interval", "min_scale", "max_scale"]


def _valid(name, v) -> bool:
    if name in ("growth_interval", "max_consecutive_overflows"):
        return type(v) is int and v >= 1
    if isinstance(v, bool) or not isinstance(v, int | float):
        return name in ("min_scale", "max_scale") and v is None
    if name == "growth_factor":
        return math.isfinite(v) and v > 1
    if name == "backoff_factor":
        return 0 < v < 1
    return 1.1754943508222875e-38 <= v <= 3.4028234663852886e38  # a normal float32 > 0


def _hparam_checks(name, value):
    if name == "max_consecutive_overflows":
        name = "max_consecutive_overflows"
    try:
        s = fmp.GradScaler(**{name: value})
    except (TypeError, ValueError) as exc:
        assert not _valid(name, value), (name, value, exc)
        assert str(exc).startswith(name), str(exc)  # the message names the argument first
        assert repr(value) in str(exc) or type(value).__name__ in str(exc)
    else:
        assert _valid(name, value), (name, value)
        assert getattr(s, name) == value
        assert math.isfinite(float(s.loss_scale)) and float(s.loss_scale) > 0


test_gradscaler_hparams, test_gradscaler_hparams_slow = property_test(
    60, name=st.sampled_from([*HPARAMS, "max_consecutive_overflows"]), value=JUNK
)(_hparam_checks)


def test_gradscaler_flags_and_state_dicts():
    for field in ("enabled", "dynamic"):
        with pytest.raises(TypeError, match=f"{field} must be a bool, got 1"):
            fmp.GradScaler(**{field: 1})
    good = fmp.GradScaler().state_dict()
    with pytest.raises(TypeError, match="state_dict must be a mapping, got list"):
        fmp.GradScaler.from_state_dict([1, 2])
    with pytest.raises(ValueError, match="The source state dict is empty"):
        fmp.GradScaler.from_state_dict({})
    with pytest.raises(ValueError, match=re.escape("scaler state_dict lacks keys ['_growth_tracker']")):
        fmp.GradScaler.from_state_dict({k: v for k, v in good.items() if k != "_growth_tracker"})
    with pytest.raises(TypeError, match=re.escape("state_dict['scale'] must be a number (or a 0-d array), got 'x'")):
        fmp.GradScaler.from_state_dict({**good, "scale": "x"})
    with pytest.raises(TypeError, match=re.escape("state_dict['growth_interval'] must be a number")):
        fmp.GradScaler.from_state_dict({**good, "growth_interval": None})
    with pytest.raises(ValueError, match="init_scale must be a finite number > 0, got nan"):
        fmp.GradScaler.from_state_dict({**good, "scale": math.nan})


@settings(max_examples=40, deadline=None)
@given(value=st.floats(allow_nan=True, allow_infinity=True))
def test_update_new_scale_python_numbers(value):
    s = fmp.GradScaler()
    if not (math.isfinite(value) and value > 0):
        with pytest.raises(ValueError, match="new_scale must be a finite number > 0, got"):
            s.update(new_scale=value)
    elif not 1.1754943508222875e-38 <= value <= 3.4028234663852886e38:
        with pytest.raises(ValueError, match=r"new_scale must be between .* \(normal float32 numbers\)"):
            s.update(new_scale=value)
    else:
        scale = float(s.update(new_scale=value).loss_scale)
        assert math.isfinite(scale) and scale > 0 and scale == float(np.float32(value))


@pytest.mark.parametrize("finite", [1, 1.0, jnp.float32(1.0), jnp.array([True, False]), jnp.int32(0), "True"])
def test_update_finite_must_be_a_bool_scalar(finite):
    with pytest.raises(TypeError, match="finite must be a bool scalar"):
        fmp.GradScaler().update(finite)
    with pytest.raises(TypeError, match=re.escape("update() needs finite")):
        fmp.GradScaler().update()


# --- policies -------------------------------------------------------------------------------------------------------
NON_FLOAT_DTYPES = st.sampled_from(
    [jnp.int32, jnp.int8, jnp.uint8, jnp.bool_, bool, int, jnp.complex64, "int32", "int8", "bool", "complex64"]
)
FIELDS = st.sampled_from(["param_dtype", "compute_dtype", "output_dtype"])


def _policy_checks(field, dtype):
    kwargs = {"param_dtype": "f32", "compute_dtype": "bf16", "output_dtype": "f32", field: dtype}
    with pytest.raises((TypeError, ValueError), match=f"Policy {field}"):
        fmp.Policy(**kwargs)
    with pytest.raises((TypeError, ValueError), match="Policy dtype|get_policy"):
        fmp.cast_tree({"w": jnp.ones(2)}, dtype)
    key = {"param_dtype": "p", "compute_dtype": "c", "output_dtype": "o"}[field]
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    with pytest.raises(ValueError, match=re.escape(f"get_policy(spec): unknown dtype '{name}'")):
        fmp.get_policy(f"{key}={name}")


test_policy_integer_dtypes, test_policy_integer_dtypes_slow = property_test(20, field=FIELDS, dtype=NON_FLOAT_DTYPES)(
    _policy_checks
)


def test_policy_none_is_not_float64():
    # np.dtype(None) is float64: a missing dtype used to become a silent float64 policy
    with pytest.raises(TypeError, match="Policy param_dtype must be a floating dtype .*got None"):
        fmp.Policy(None, "f32", "f32")
    with pytest.raises(TypeError, match="Policy dtype must be a floating dtype .*got None"):
        fmp.cast_tree({"w": jnp.ones(2)}, None)
    with pytest.raises(TypeError, match="get_policy.spec. expects a str or a Policy, got NoneType"):
        fmp.get_policy(None)
    with pytest.raises(ValueError, match="get_policy.spec.: the spec is empty"):
        fmp.get_policy("  ")


def test_cast_tree_passes_through_what_it_documents():
    tree = {"i": jnp.arange(2), "b": jnp.array([True]), "f64": np.ones(2), "s": "x", "n": None, "py": 1.5}
    out = fmp.cast_tree(tree, "bf16")
    assert out["i"] is tree["i"] and out["b"] is tree["b"] and out["f64"] is tree["f64"]
    assert out["s"] == "x" and out["n"] is None and out["py"] == 1.5


# --- autocast / explain / autocast_jaxpr ----------------------------------------------------------------------------
@pytest.mark.parametrize("api", [fmp.autocast, fmp.explain])
def test_autocast_and_explain_arguments(api):
    name = api.__name__
    with pytest.raises(TypeError, match=re.escape(f"{name}(fn) expects a callable, got int")):
        api(3)
    with pytest.raises(ValueError, match=re.escape("get_policy(spec): unknown preset or dtype 'int32'")):
        api(lambda x: x, policy="int32")
    with pytest.raises(TypeError, match=re.escape("get_policy(spec) expects a str or a Policy, got int")):
        api(lambda x: x, policy=3)
    with pytest.raises(TypeError, match="rules must be an fmp.RuleSet"):
        api(lambda x: x, rules={"dot_general": "lower"})
    with pytest.raises(TypeError, match="overrides must be a mapping"):
        api(lambda x: x, overrides=["LayerNorm"])
    with pytest.raises(TypeError, match=re.escape("autocast(enabled=...) expects a bool, got int")):
        fmp.autocast(lambda x: x, enabled=1)
    with pytest.raises(TypeError, match=re.escape("autocast_jaxpr(closed_jaxpr) expects a ClosedJaxpr")):
        fmp.autocast_jaxpr(lambda x: x)


def test_autocast_never_casts_integers_bools_or_float64_and_passes_static_args():
    f = fmp.autocast(lambda x, n, flag, k: (x @ x, n * 2, flag, k), policy="mixed_float16")
    x = jnp.ones((2, 2))
    out = f(x, jnp.arange(2), jnp.array([True]), 3)
    assert out[0].dtype == jnp.float32 and out[1].dtype == jnp.int32 and out[2].dtype == jnp.bool_ and out[3] == 3


# --- fmp.optax ------------------------------------------------------------------------------------------------------
PARAMS = {"w": jnp.ones((2, 2)), "b": jnp.zeros(2)}
BUILDERS = {
    "loss_scaled": lambda: fmp.optax.loss_scaled(optax.sgd(0.1), fmp.GradScaler(init_scale=4.0)),
    "skip_nonfinite": lambda: fmp.optax.skip_nonfinite(optax.sgd(0.1)),
    "master_weights": lambda: fmp.optax.master_weights(optax.sgd(0.1)),
    "stochastic_round": lambda: fmp.optax.stochastic_round(),
    "kahan": lambda: fmp.optax.kahan(),
    "state_dtypes": lambda: fmp.optax.state_dtypes(optax.sgd(0.1, momentum=0.9), trace="bfloat16"),
}


@st.composite
def bad_updates(draw):
    kind = draw(st.sampled_from(["int", "bool", "structure", "shape", "extra", "missing"]))
    leaf = draw(st.sampled_from(["w", "b"]))
    g = jax.tree.map(jnp.ones_like, PARAMS)
    if kind == "int":
        g[leaf] = g[leaf].astype(jnp.int32)
    elif kind == "bool":
        g[leaf] = g[leaf].astype(jnp.bool_)
    elif kind == "structure":
        g = {"w": g["w"], "c": g["b"]}
    elif kind == "shape":
        g[leaf] = jnp.ones((3,))
    elif kind == "extra":
        g["extra"] = jnp.ones(2)
    else:
        g.pop(leaf)
    return kind, g


def _optax_update_checks(which, bad):
    kind, grads = bad
    opt = BUILDERS[which]()
    state = opt.init(PARAMS)
    if kind in ("int", "bool"):
        err, msg = (
            TypeError,
            f"{which}.update: updates must be float gradients, got {'int32' if kind == 'int' else 'bool'}",
        )
    elif kind == "shape":
        err, msg = ValueError, f"{which}.update: updates and params must have the same shapes"
    else:
        err, msg = ValueError, f"{which}.update: updates and params must have the same tree structure"
    with pytest.raises(err, match=re.escape(msg)):
        opt.update(grads, state, PARAMS)


test_optax_bad_updates, test_optax_bad_updates_slow = property_test(
    24, which=st.sampled_from(sorted(BUILDERS)), bad=bad_updates()
)(_optax_update_checks)


@pytest.mark.parametrize("which", ["loss_scaled", "skip_nonfinite", "master_weights", "state_dtypes"])
@pytest.mark.parametrize("inner", [None, lambda g: g, "sgd", optax.sgd])
def test_optax_wrappers_reject_an_inner_that_is_not_a_transformation(which, inner):
    factory = getattr(fmp.optax, which)
    with pytest.raises(TypeError, match=re.escape(f"{which}(inner) expects an optax GradientTransformation")):
        factory(inner)


def test_optax_states_empty_trees_and_float64():
    for which in ("loss_scaled", "skip_nonfinite"):
        opt = BUILDERS[which]()
        with pytest.raises(
            TypeError, match=f"{which}.update: state must be the .*State returned by init/update, got NoneType"
        ):
            opt.update(PARAMS, None, PARAMS)
        with pytest.raises(TypeError, match=f"{which}.update: state must be the"):
            opt.update(PARAMS, opt.init(PARAMS).inner_state, PARAMS)
        # empty trees: nothing to do, no error, the counters still run
        u, st_ = opt.update({}, opt.init({}), {})
        assert u == {} and int(st_.skipped_steps) == 0
        u, _ = opt.update(None, opt.init(None))
        assert u is None
        # float64 NumPy gradients: float32 without x64 (documented pass-through)
        u, _ = opt.update(jax.tree.map(lambda x: np.asarray(x, np.float64), PARAMS), opt.init(PARAMS), PARAMS)
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(u))
    with pytest.raises(ValueError, match="master_weights needs the current params"):
        BUILDERS["master_weights"]().update(PARAMS, BUILDERS["master_weights"]().init(PARAMS))
    with pytest.raises(TypeError, match="scaler must be an fmp.GradScaler or None, got float"):
        fmp.optax.loss_scaled(optax.sgd(0.1), 2.0)
    for dtype in (jnp.int32, jnp.bool_, "foo", None):
        with pytest.raises(TypeError, match="master_dtype must be a floating dtype"):
            fmp.optax.master_weights(optax.sgd(0.1), master_dtype=dtype)


@pytest.mark.parametrize("junk", [None, {}, fmp.GradScaler(), optax.sgd(0.1).init(PARAMS)])
def test_state_finders_reject_states_without_their_transformation(junk):
    with pytest.raises(ValueError, match="no fmp.optax.loss_scaled state found in opt_state"):
        fmp.optax.current_scaler(junk)
    with pytest.raises(ValueError, match="master_params: expected exactly one MasterWeightsState"):
        fmp.optax.master_params(junk, PARAMS)
    if not isinstance(junk, fmp.GradScaler):
        with pytest.raises(TypeError, match=re.escape("check_scaler_health(state): expected an fmp.GradScaler")):
            fmp.check_scaler_health(junk)


# --- torch facade constructors --------------------------------------------------------------------------------------
TORCH_JUNK = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.integers(-3, 3),
    st.booleans(),
    st.none(),
    st.just("x"),
)


def _outcome(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            obj = fn()
        except Exception as exc:
            return ("raise", type(exc).__name__, str(exc)), [str(w.message) for w in caught]
    return ("ok", obj), [str(w.message) for w in caught]


def _torch_gradscaler_checks(name, value):
    torch = pytest.importorskip("torch")
    import fmp.torch

    ref, ref_w = _outcome(lambda: torch.amp.GradScaler("cpu", **{name: value}))
    got, got_w = _outcome(lambda: fmp.torch.GradScaler("cpu", **{name: value}))
    assert ref_w == got_w
    if ref[0] == "raise":
        assert got[:3] == ref  # same type, same message
    else:
        assert got[0] == "ok"  # torch accepts it: so does the facade (documented pass-through)
        # what torch stores, the facade stores; its five-key state_dict() then converts it with
        # float()/int(), so junk torch would write back raises there instead of being saved
        private = "_init_scale" if name == "init_scale" else f"_{name}"
        assert str(getattr(got[1], private)) == str(getattr(ref[1], private))


test_torch_gradscaler_ctor_matches_torch, test_torch_gradscaler_ctor_matches_torch_slow = property_test(
    25, name=st.sampled_from(["init_scale", "growth_factor", "backoff_factor", "growth_interval"]), value=TORCH_JUNK
)(_torch_gradscaler_checks)


def test_torch_facade_own_arguments_and_autocast_constructor():
    torch = pytest.importorskip("torch")
    import fmp.torch

    for bad, err in ((0, ValueError), (2.0, TypeError), (True, TypeError), (None, TypeError)):
        with pytest.raises(err, match="max_consecutive_overflows must be an int >= 1"):
            fmp.torch.GradScaler("cpu", max_consecutive_overflows=bad)
    # autocast: torch's own validation and warnings, identical
    for kwargs in ({"device_type": 3}, {"device_type": "cpu", "dtype": torch.int32}, {"device_type": "nope"}):
        ref = _outcome(lambda kwargs=kwargs: torch.autocast(**kwargs))
        got = _outcome(lambda kwargs=kwargs: fmp.torch.autocast(**kwargs))
        assert ref[0][0] == got[0][0] and ref[1] == got[1], kwargs  # both raise or both build; same warnings
        if ref[0][0] == "raise":
            assert ref[0][1:] == got[0][1:], kwargs  # same type and message
        else:
            assert ref[0][1]._enabled == got[0][1]._enabled
    with pytest.raises(ValueError, match=re.escape("get_policy(spec): unknown dtype 'int8'")):
        fmp.torch.autocast("cpu", policy="c=int8")
    with pytest.raises(ValueError, match="disagrees with the policy's compute dtype"):
        fmp.torch.autocast("cpu", dtype=torch.float16, policy="mixed_bfloat16")
    with pytest.raises(TypeError, match=re.escape("autocast(rules=...) expects an fmp.RuleSet")):
        fmp.torch.autocast("cpu", rules="default")


# --- rule sets ------------------------------------------------------------------------------------------------------
def test_rule_set_derive_arguments():
    rules = fmp.DEFAULT_RULES
    with pytest.raises(ValueError, match="framework must be one of"):
        rules.derive(framework=3)
    with pytest.raises(ValueError, match="unknown precision category 'lower'"):
        rules.derive(lower=["exp"])
    with pytest.raises(
        TypeError, match=re.escape("derive(unlisted=...) expects a list of op names, got the string 'exp'")
    ):
        rules.derive(unlisted="exp")
    with pytest.raises(TypeError, match=re.escape("derive(float32=...) expects op names as str, got 3")):
        rules.derive(float32=[3])
    with pytest.raises(ValueError, match="op 'exp' is moved to both"):
        rules.derive(float32=["exp"], unlisted=["exp"])
    with pytest.raises(ValueError, match="'x' is not a valid Category"):
        fmp.Category("x")
    # documented pass-through: a name the table does not know is a new op, and may be given a category
    assert rules.derive(float32=["my_custom_prim"]).category("my_custom_prim") is fmp.Category.FLOAT32


# --- misuse that used to pass or gave a message without the fix ---------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "key", "hint"),
    [
        ("param=float32,compute=bfloat16,output=float32", "param", " (did you mean 'params'?)"),
        ("params=float32,outputs=float32", "outputs", " (did you mean 'output'?)"),
        ("cmp=bf16", "cmp", " (did you mean 'compute'?)"),
        ("dtype=bf16", "dtype", ""),
    ],
)
def test_policy_spec_takes_only_the_documented_keys(spec, key, hint):
    # before: "param=" was taken as "params=" although the message and jmp list only params|p
    token = next(t for t in spec.split(",") if t.startswith(key + "="))
    with pytest.raises(ValueError) as err:
        fmp.get_policy(spec)
    msg = str(err.value)
    first = f"get_policy(spec): unknown key {key!r} in {token!r}{hint}; the accepted keys are params|p, compute|c, "
    assert msg.startswith(first + "output|o, float8. A policy spec is a preset (mixed_bfloat16, "), msg
    for ok in ("params=f32,compute=bf16,output=f32", "p=f32,c=bf16,o=f32", "PARAMS=f32, C=bf16"):
        assert fmp.get_policy(ok) == fmp.get_policy("mixed_bfloat16")


def test_jax_grad_scaler_given_a_device_points_to_the_torch_scaler():
    # before: "init_scale must be a Python number, got 'cuda' of type str"
    for device in ("cuda", "cpu", "cuda:1"):
        with pytest.raises(TypeError) as err:
            fmp.GradScaler(device)
        assert str(err.value) == (
            f"init_scale must be a Python number, got the device string {device!r}: fmp.GradScaler is the JAX "
            f"scaler and takes no device (JAX places its arrays). For torch tensors use fmp.torch.GradScaler("
            f"{device!r}) (torch.amp.GradScaler's API); for JAX write fmp.GradScaler() or "
            "fmp.GradScaler(init_scale=2.0**16)."
        )
    with pytest.raises(TypeError, match="^init_scale must be a Python number, got '1e4' of type str$"):
        fmp.GradScaler("1e4")


@pytest.mark.parametrize("policy", ["mixed_bfloat16", fmp.get_policy("p=f32,c=f16")], ids=["str", "Policy"])
def test_autocast_with_the_policy_first_says_it_transforms_a_function(policy):
    # before: a str first gave "autocast(fn) expects a callable, got str" with no word on the context-manager form
    got = policy if isinstance(policy, str) else str(policy)
    msg = (
        f"fmp.autocast(fn, policy) is a function transform and takes the function first, got the policy {got!r}: "
        f"write fmp.autocast(fn, {got!r}), or @fmp.autocast(policy={got!r}) on a def. It is not a context manager "
        "(`with fmp.autocast(...)`); for torch code the context manager is fmp.torch.autocast: "
        f"with fmp.torch.autocast('cpu', policy={got!r}): (or 'cuda')."
    )
    with pytest.raises(TypeError) as err:
        with fmp.autocast(policy):
            pass
    assert str(err.value) == msg
    with pytest.raises(TypeError) as err:

        @fmp.autocast(policy)
        def f(x):
            return x

    assert str(err.value) == msg


@pytest.mark.parametrize("wrap", [fmp.value_and_grad, fmp.grad])
def test_loss_scaled_grad_without_a_scaler_says_how_to_make_one(wrap):
    # before: Python's "missing 1 required positional argument: 'scaler'"
    name = wrap.__name__
    with pytest.raises(TypeError) as err:
        wrap(lambda w: jnp.sum(w))
    assert str(err.value) == (
        f"fmp.{name}(fun, scaler) needs scaler, an fmp.GradScaler; got no scaler. Make one with scaler = "
        "fmp.GradScaler() (dynamic loss scaling, for float16) and carry it through the train step like the params: "
        "the function returns the next one. bfloat16 needs no loss scaling: pass fmp.GradScaler.static(1.0) (keeps "
        f"the finite flag) or use plain jax.{name}."
    )
    # the advice works: a static scale of 1 gives jax's own gradients
    g = jax.grad(lambda w: jnp.sum(w**2))(jnp.arange(3.0))
    out = wrap(lambda w: jnp.sum(w**2), fmp.GradScaler.static(1.0))(jnp.arange(3.0))
    assert out[-3 if name == "value_and_grad" else 0].tolist() == g.tolist()
