"""Clear errors and warnings where fmp would otherwise do nothing, silently: each tested with its text."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fmp

torch = pytest.importorskip("torch", reason="the foreign-array errors are tested with torch tensors")

_FIX_SCALER = (
    "not a JAX array: fmp.GradScaler and its helpers compute with JAX; for torch tensors use fmp.torch.GradScaler "
    "(torch.amp.GradScaler's API), or convert the leaves first (jnp.asarray(x), or jax.dlpack.from_dlpack(x) to "
    "share memory)."
)


@pytest.mark.parametrize(
    ("call", "where"),
    [
        (lambda s, t: s.scale(t), "GradScaler.scale: the leaf at the root"),
        (lambda s, t: s.unscale({"w": t}), "GradScaler.unscale: the leaf at ['w']"),
        (lambda s, t: fmp.all_finite({"w": [jnp.ones(2), t]}), "all_finite(tree): the leaf at ['w'][1]"),
        (lambda s, t: fmp.nonfinite_leaves({"w": t}), "nonfinite_leaves(grads): the leaf at ['w']"),
        (lambda s, t: fmp.select_tree(jnp.array(True), {"w": t}, {"w": t}), "select_tree(a): the leaf at ['w']"),
        # before: a torch bool tensor was taken as the finite flag, and a torch scalar as the new scale
        (lambda s, t: s.update(t[0] > 0), "GradScaler.update: finite"),
        (lambda s, t: s.update(new_scale=t.sum()), "GradScaler.update: new_scale"),
        (lambda s, t: fmp.select_tree(t[0] > 0, {"w": jnp.ones(2)}, {"w": jnp.zeros(2)}), "select_tree: pred"),
        (
            lambda s, t: fmp.value_and_grad(lambda w: jnp.sum(w), s)(t),
            "fmp.value_and_grad: an argument: the leaf at [0][0]",
        ),
    ],
)
def test_torch_tensors_given_to_the_jax_scaler_raise(call, where):
    # before: scale() silently converted a torch tensor, unscale()/all_finite() failed deep inside jnp
    # ("Cannot interpret 'torch.float32' as a data type")
    scaler = fmp.GradScaler(init_scale=4.0)
    with pytest.raises(TypeError) as err:
        call(scaler, torch.ones(2))
    assert str(err.value) == f"{where} is a torch.Tensor, {_FIX_SCALER}"


def test_numpy_and_python_leaves_are_still_accepted():
    scaler = fmp.GradScaler(init_scale=4.0)
    out = scaler.unscale({"w": np.full(2, 8.0, np.float32), "b": 8.0, "n": 3})
    assert out["w"].tolist() == [2.0, 2.0] and float(out["b"]) == 2.0 and out["n"] == 3
    assert bool(fmp.all_finite({"w": np.ones(2), "b": 1.0}))


_FIX_AUTOCAST = (
    " is a torch.Tensor, not a JAX array: fmp.autocast rewrites JAX programs, and this value would reach the "
    "function as a static Python object and run outside the policy. For torch code use fmp.torch.autocast "
    "(torch.autocast's API) or fmp.torch.autocast_fx; to run JAX on it, convert it first (jnp.asarray(x), or "
    "jax.dlpack.from_dlpack(x) to share memory)."
)


def test_autocast_refuses_torch_tensors():
    # before: the tensor was a static argument, the function ran in torch, and the policy did nothing
    f = fmp.autocast(lambda x, w=None: x * 2, "mixed_float16")
    with pytest.raises(TypeError) as err:
        f(torch.ones(2))
    assert str(err.value) == "fmp.autocast: argument positional argument 0" + _FIX_AUTOCAST
    with pytest.raises(TypeError) as err:
        f(jnp.ones(2), w={"a": [1, torch.ones(2)]})
    assert str(err.value) == "fmp.autocast: argument keyword argument 'w'['a'][1]" + _FIX_AUTOCAST
    # fmp.explain would report an empty program
    with pytest.raises(TypeError) as err:
        fmp.explain(lambda x: x * 2)(torch.ones(2))
    assert str(err.value) == "fmp.explain: argument positional argument 0" + _FIX_AUTOCAST


_NO_EFFECT = (
    "fmp.autocast(policy='mixed_float16') changes nothing in this function: it computes no float16, bfloat16 or "
    "float32 value ({found}), and autocast never casts float64, integer or bool values. {hint}"
)


def test_float64_model_under_mixed_float16_warns():
    with jax.enable_x64(True):
        w, x = jnp.ones((3, 3)), jnp.ones((2, 3))  # float64: x64 is on and no dtype was given
        f = fmp.autocast(lambda x, w: jnp.tanh(x @ w), "mixed_float16")
        with pytest.warns(UserWarning) as rec:
            y = f(x, w)
    assert y.dtype == jnp.float64  # ran, unchanged
    assert [str(r.message) for r in rec] == [
        _NO_EFFECT.format(
            found="its floating values are float64",
            hint="Build the model in float32 (float64 appears when jax_enable_x64 is on and arrays are created "
            "without a dtype), e.g. params = fmp.cast_tree(params, jnp.float32), or drop the autocast.",
        )
    ]
    # the warning points at the caller, not at fmp
    assert rec[0].filename == __file__


def test_integer_only_function_warns_and_float32_policy_never_does():
    with pytest.warns(UserWarning) as rec:
        out = jax.jit(fmp.autocast(lambda i: i * 2 + 1, "mixed_float16"))(jnp.arange(3))
    assert out.tolist() == [1, 3, 5]
    assert [str(r.message) for r in rec] == [
        _NO_EFFECT.format(
            found="it has no floating values",
            hint="Wrap the function that does the floating-point work, or drop the autocast.",
        )
    ]
    # a float32 policy is meant to change nothing: no warning (warnings are errors in this suite)
    assert fmp.autocast(lambda i: i * 2, "float32")(jnp.arange(3)).tolist() == [0, 2, 4]


def test_float32_model_under_mixed_float16_does_not_warn():
    # warnings are errors in this suite: any warning here fails the test
    y = fmp.autocast(lambda x, w: x @ w, "mixed_float16")(jnp.ones((2, 3)), jnp.ones((3, 3)))
    assert y.dtype == jnp.float32


def test_override_that_matches_no_scope_warns():
    def f(x, w):
        with jax.named_scope("encoder"):
            h = x @ w
        with jax.named_scope("head"):
            return jnp.sum(jax.lax.cond(True, lambda h: h @ w, lambda h: h, h))

    x, w = jnp.ones((2, 3)), jnp.ones((3, 3))
    # matched keys (also one whose only match is inside a cond branch's scope) stay silent
    fmp.autocast(f, "mixed_bfloat16", overrides={"encoder": "float32", "head": "float32"})(x, w)
    with pytest.warns(UserWarning) as rec:
        fmp.autocast(f, "mixed_bfloat16", overrides={"Encoder": "float32"})(x, w)
    (msg,) = [str(r.message) for r in rec]
    assert msg == (
        "fmp.autocast: overrides key 'Encoder' matches no jax.named_scope in the traced function, so it changes "
        "nothing. Keys are case-sensitive parts of the scope paths, never cut inside a number (flax linen opens "
        "one per module: 'Dense_0', 'LayerNorm_0'; an nnx argument's submodules run under their paths: 'blocks/0/attn'); "
        "scopes seen: 'encoder', 'head'."
    )


def test_override_inside_a_flax_module_matches():
    nn = pytest.importorskip("flax.linen")

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.LayerNorm()(nn.Dense(4)(x))

    m = M()
    x = jnp.ones((2, 3))
    params = m.init(jax.random.key(0), x)
    fmp.autocast(m.apply, "mixed_float16", overrides={"LayerNorm": "float32"})(params, x)  # silent
    with pytest.warns(UserWarning, match=re.escape("overrides key 'Layernorm' matches no jax.named_scope")):
        fmp.autocast(m.apply, "mixed_float16", overrides={"Layernorm": "float32"})(params, x)


@pytest.mark.parametrize("value", [jnp.ones(2), np.ones(2, np.float32)], ids=["jax", "numpy"])
def test_torch_facade_scaler_refuses_other_arrays(value):
    import fmp.torch as amp

    # before: torch.amp's rule iterates any iterable, so an array came back as a lazy `map` object
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    with pytest.raises(ValueError) as err:
        amp.GradScaler("cpu").scale([torch.ones(()), value])
    assert str(err.value) == (
        f"outputs must be a Tensor or an iterable of Tensors, got a {kind}: fmp.torch.GradScaler scales torch "
        "tensors (torch.amp's API). For JAX use fmp.GradScaler (scaler.scale(loss), fmp.value_and_grad); otherwise "
        "convert with torch.as_tensor(x)."
    )
