"""Policy parsing, hashing, round trips and tree casting."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fmp
from fmp._core import _dtypes

SPELLINGS = [(alias, name) for name, aliases in _dtypes.FLOAT_ALIASES.items() for alias in aliases]
KEYS = {"param": ["params", "p"], "compute": ["compute", "c"], "output": ["output", "o"]}


@pytest.mark.parametrize(("alias", "name"), SPELLINGS)
@pytest.mark.parametrize("field", ["param", "compute", "output"])
def test_every_key_and_dtype_spelling(field, alias, name):
    for key in KEYS[field]:
        for spelled in (alias, alias.upper(), f" {alias} "):
            policy = fmp.get_policy(f"{key}={spelled}")
            assert getattr(policy, f"{field}_dtype") == jnp.dtype(name)


@pytest.mark.parametrize(("alias", "name"), SPELLINGS)
def test_bare_dtype_sets_all_fields(alias, name):
    p = fmp.get_policy(alias)
    assert p.param_dtype == p.compute_dtype == p.output_dtype == jnp.dtype(name)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("mixed_bfloat16", ("float32", "bfloat16", "float32")),
        ("mixed_float16", ("float32", "float16", "float32")),
        ("float32", ("float32", "float32", "float32")),
        ("MIXED_BFLOAT16", ("float32", "bfloat16", "float32")),
        ("params=float32,compute=bfloat16,output=float32", ("float32", "bfloat16", "float32")),
        ("p=f32,c=bf16,o=f32", ("float32", "bfloat16", "float32")),
        ("c=half", ("float32", "float16", "float32")),  # unspecified: params f32, output = params
        ("p=bf16", ("bfloat16", "bfloat16", "bfloat16")),  # compute and output follow params
        ("p=f32, c=bf16 , o=bf16", ("float32", "bfloat16", "bfloat16")),
        ("o=f16,c=bf16", ("float32", "bfloat16", "float16")),
    ],
)
def test_specs(spec, expected):
    p = fmp.get_policy(spec)
    assert (p.param_dtype.name, p.compute_dtype.name, p.output_dtype.name) == expected


def test_str_round_trips_for_every_combination():
    names = list(_dtypes.FLOAT_ALIASES)
    for combo in itertools.product(names, repeat=3):
        p = fmp.Policy(*combo)
        assert fmp.get_policy(str(p)) == p
        assert hash(fmp.get_policy(str(p))) == hash(p)


def test_policy_is_hashable_static_jit_argument():
    traces = []

    @jax.jit
    def f(x):
        return x

    def g(x, policy):
        traces.append(policy)
        return policy.cast_to_compute(x)

    gj = jax.jit(g, static_argnums=1)
    x = jnp.ones(3)
    assert gj(x, fmp.get_policy("mixed_bfloat16")).dtype == jnp.bfloat16
    assert gj(x, fmp.get_policy("p=f32,c=bf16,o=f32")).dtype == jnp.bfloat16
    assert len(traces) == 1  # equal policies hit the cache
    assert gj(x, fmp.get_policy("mixed_float16")).dtype == jnp.float16
    assert len(traces) == 2
    assert f(x) is not None


def test_policy_is_immutable():
    p = fmp.get_policy("mixed_bfloat16")
    with pytest.raises(AttributeError):
        p.compute_dtype = jnp.float16  # type: ignore[misc]
    assert p.with_compute_dtype("f16").compute_dtype == jnp.float16
    assert p.with_param_dtype("bf16").param_dtype == jnp.bfloat16
    assert p.with_output_dtype("bf16").output_dtype == jnp.bfloat16
    assert p.compute_dtype == jnp.bfloat16


def test_get_policy_returns_policy_unchanged():
    p = fmp.Policy("f32", "bf16", "f32")
    assert fmp.get_policy(p) is p


@pytest.mark.parametrize(
    ("spec", "token"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("mixed_float4", "'mixed_float4'"),
        ("float8=sixbit", "'sixbit'"),
        ("p=f33", "'f33'"),
        ("x=f32", "'x'"),
        ("p:f32", "'p:f32'"),
        ("p=", "''"),
        ("p=f32,,c=bf16", "empty entry"),
        ("p=f32,params=bf16", "'params' (or 'p') is given twice"),
        ("c=int32", "'int32'"),
        ("c=bool", "'bool'"),
        ("c=complex64", "'complex64'"),
        ("params=float32,compute=bfloat16,output=float32,", "empty entry"),
        ("compute=bf16=f32", "'bf16=f32'"),
        ("=bf16", "''"),
    ],
)
def test_bad_specs_name_the_token_and_list_what_is_accepted(spec, token):
    with pytest.raises(ValueError) as info:
        fmp.get_policy(spec)
    msg = str(info.value)
    assert token in msg
    assert "mixed_bfloat16" in msg and "bf16" in msg and "p=f32,c=bf16,o=f32" in msg


@pytest.mark.parametrize("spec", [None, 3, jnp.float32, ["p=f32"]])
def test_non_string_spec_is_a_type_error(spec):
    with pytest.raises(TypeError, match="get_policy"):
        fmp.get_policy(spec)


@pytest.mark.parametrize("dtype", [jnp.int32, np.bool_, jnp.complex64, "int8"])
def test_policy_rejects_non_float_dtypes(dtype):
    with pytest.raises(ValueError, match="compute_dtype"):
        fmp.Policy(jnp.float32, dtype, jnp.float32)


def test_policy_rejects_non_dtypes():
    with pytest.raises(TypeError, match="param_dtype"):
        fmp.Policy(object(), jnp.float32, jnp.float32)


def test_policy_accepts_dtype_likes():
    p = fmp.Policy(np.float32, "bf16", jnp.dtype("float16"))
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (jnp.float32, jnp.bfloat16, jnp.float16)


@pytest.mark.parametrize("method", ["cast_to_param", "cast_to_compute", "cast_to_output"])
@pytest.mark.parametrize("target", ["float16", "bfloat16", "float32"])
def test_casts_touch_only_floating_leaves(method, target):
    policy = fmp.Policy(target, target, target)
    key = jax.random.key(0)
    tree = {
        "f32": jnp.ones(3, jnp.float32),
        "bf16": jnp.ones(3, jnp.bfloat16),
        "f16": jnp.ones((), jnp.float16),
        "int": jnp.arange(3),
        "bool": jnp.array([True, False]),
        "key": key,
        "raw_key": jax.random.PRNGKey(0),
        "none": None,
        "py_float": 1.5,
        "py_int": 2,
        "string": "hello",
        "np_f32": np.ones(2, np.float32),
        "np_f64": np.ones(2, np.float64),
    }
    out = getattr(policy, method)(tree)
    for name in ("f32", "bf16", "f16"):
        assert out[name].dtype == jnp.dtype(target)
        assert isinstance(out[name], jax.Array)
    assert out["np_f32"].dtype == jnp.dtype(target) and isinstance(out["np_f32"], np.ndarray)
    assert out["np_f64"] is tree["np_f64"]  # float64 is never cast
    for name in ("int", "bool", "key", "raw_key", "py_float", "py_int", "string"):
        assert out[name] is tree[name]
    assert out["none"] is None


def test_cast_is_jittable_and_keeps_structure():
    policy = fmp.get_policy("mixed_float16")
    tree = (jnp.ones(2), [jnp.int32(1), None])
    out = jax.jit(policy.cast_to_compute)(tree)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
    assert out[0].dtype == jnp.float16 and out[1][0].dtype == jnp.int32


def test_cast_tree_rejects_bad_dtype():
    with pytest.raises(ValueError, match="dtype"):
        fmp.cast_tree(jnp.ones(2), "int32")


# every recipe field set away from its scaling's default, one recipe per scaling and a peer's
RECIPES = [
    fmp.Float8Recipe("tensorwise", pow2_scales=False, output="float32", activations=True, emulate=False),
    fmp.Float8Recipe("rowwise", grad_dtype="float8_e4m3fn", emulate=True),
    fmp.Float8Recipe("blockwise", block_size=64),
    fmp.Float8Recipe("delayed", history_len=1024, margin=2, amax_compute_algo="most_recent"),
    fmp.Float8Recipe("mxfp8", grad_dtype="float8_e5m2", scale_rounding="floor"),
    fmp.Float8Recipe("nvfp4"),
    fmp.Float8Recipe.from_peer("te_delayed"),
]


@pytest.mark.parametrize("recipe", RECIPES, ids=str)
def test_str_and_repr_name_every_recipe_option_and_round_trip(recipe):
    policy = fmp.Policy("f32", "bf16", "f32", float8=recipe)
    default = fmp.Float8Recipe(recipe.scaling)
    changed = {f for f in recipe.__dataclass_fields__ if getattr(recipe, f) != getattr(default, f)}
    for field in changed:
        assert f"{field}=" in str(policy) and f"{field}=" in repr(policy), (field, str(policy))
    assert fmp.get_policy(str(policy)) == policy  # the spec states what runs, options included
    assert fmp.Policy("f32", "bf16", "f32", float8=str(recipe)) == policy
    assert eval(repr(recipe), {"Float8Recipe": fmp.Float8Recipe}) == recipe  # noqa: S307
    assert fmp.get_policy(f"float8={recipe},c=bf16,o=f32") == policy  # the options keep their commas


def test_a_recipe_at_its_defaults_prints_its_scaling_alone():
    assert str(fmp.get_policy("mixed_float8")) == "params=float32,compute=bfloat16,output=float32,float8=tensorwise"
    # mxfp8's default gradients are e4m3, the per-tensor recipes' e5m2: each is its scaling's default
    assert str(fmp.Float8Recipe("mxfp8", grad_dtype="float8_e4m3fn")) == "mxfp8"
    assert str(fmp.Float8Recipe("rowwise", grad_dtype="float8_e4m3fn")) == "rowwise(grad_dtype=float8_e4m3fn)"
    assert repr(fmp.Float8Recipe("mx")) == "Float8Recipe(scaling='mxfp8')"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("float8=rowwise(pow2=false)", r"'pow2=false' is not field=value with a field of Float8Recipe"),
        ("float8=rowwise(margin=x)", r"margin='x' is not a value margin takes"),
        ("float8=rowwise(pow2_scales=yes)", r"pow2_scales='yes' is not a value pow2_scales takes"),
        ("float8=delayed(margin=1,margin=2)", r"'margin' is given twice"),
        ("float8=delayed(margin=1", r"parenthesis is not closed"),
        ("float8=delayed(margin=100)", r"Float8Recipe\(margin=...\) must be an int from 0 to 64"),
        ("float8=e3m4(margin=1)", r"unknown float8 scaling 'e3m4'"),
    ],
)
def test_bad_recipe_options_name_the_option(spec, message):
    with pytest.raises(ValueError, match=r"get_policy\(spec\): .*" + message):
        fmp.get_policy(spec)


def test_an_unknown_scaling_lists_the_block_scaled_formats_as_they_are_named():
    with pytest.raises(ValueError, match=r"must be one of tensorwise, .*, mxfp8, mxfp4, nvfp4, got 'e3m4'") as err:
        fmp.Float8Recipe("e3m4")
    assert "'mx'" not in str(err.value) and "emulated on any device" in str(err.value)
