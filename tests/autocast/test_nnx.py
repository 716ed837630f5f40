"""flax nnx objects passed straight into an autocast function keep every state update."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fmp

nnx = pytest.importorskip("flax.nnx")


class Counter(nnx.Variable):
    pass


class CNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.lin = nnx.Linear(8, 4, rngs=rngs)
        self.calls = Counter(jnp.zeros((), jnp.int32))
        self.last = Counter(jnp.zeros((4,), jnp.float32))

    def __call__(self, x):
        self.calls[...] += 1
        h = self.drop(jax.nn.relu(self.bn(self.conv(x))))
        out = self.lin(h.mean((1, 2)))
        self.last[...] = out.mean(0).astype(jnp.float32)
        return out


def loss(model, x):
    return jnp.mean(model(x) ** 2)


def _x():
    return jax.random.normal(jax.random.key(0), (2, 5, 5, 3))


def _leaves(model):
    out = {}
    for path, value in jax.tree_util.tree_leaves_with_path(nnx.state(model)):
        key = jax.tree_util.keystr(path).replace("']['", ".").replace("['", "").replace("'].value", "")
        out[key] = value
    return out


def _check_same_updates(auto, ref, tol):
    a, r = _leaves(auto), _leaves(ref)
    assert a.keys() == r.keys()
    for key in a:
        x, y = a[key], r[key]
        assert x.dtype == y.dtype, key
        if jnp.issubdtype(x.dtype, jnp.floating):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=tol, rtol=tol, err_msg=key)
        elif jnp.issubdtype(x.dtype, jnp.integer):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=key)


def _run(how, model, f, x):
    if how == "eager":
        return f(model, x)
    if how == "nnx.value_and_grad":
        return nnx.value_and_grad(f)(model, x)
    if how == "nnx.jit":
        return nnx.jit(f)(model, x)
    return nnx.jit(lambda m, x: nnx.value_and_grad(f)(m, x))(model, x)  # the training step nnx's docs teach


@pytest.mark.parametrize(
    "how",
    [
        "nnx.jit(nnx.value_and_grad)",
        pytest.param("eager", marks=pytest.mark.gallery),  # op-by-op dispatch: ~30 s on the CI machine
        pytest.param("nnx.value_and_grad", marks=pytest.mark.gallery),
        pytest.param("nnx.jit", marks=pytest.mark.gallery),
    ],
)
def test_state_updates_survive(how: str) -> None:
    auto, ref = CNN(nnx.Rngs(0, dropout=1)), CNN(nnx.Rngs(0, dropout=1))
    x = _x()
    before = _leaves(auto)
    _run(how, auto, fmp.autocast(loss), x)
    _run(how, ref, loss, x)
    after = _leaves(auto)
    assert int(after["calls"]) == 1
    assert int(after["drop.rngs.count"]) == int(before["drop.rngs.count"]) + 1
    assert not np.array_equal(after["bn.mean"], before["bn.mean"])
    # the same updates as the float32 run: counts exactly, statistics to bfloat16 precision (a bf16 conv feeds
    # the batch mean/var, relative error ~2**-8 on O(1) values), the recorded output in float32
    _check_same_updates(auto, ref, tol=3e-2)


def test_two_steps_and_shared_variables() -> None:
    """Two modules sharing one submodule, passed in a dict; updates land once, in the shared object."""
    shared = CNN(nnx.Rngs(0, dropout=1))
    pair = {"a": shared, "b": shared}

    def f(models, x):
        return loss(models["a"], x) + loss(models["b"], x)

    step = nnx.jit(fmp.autocast(f))
    step(pair, _x())
    step(pair, _x())
    assert int(shared.calls[...]) == 4


def test_state_keeps_its_dtype_under_a_bfloat16_output_policy() -> None:
    model = CNN(nnx.Rngs(0, dropout=1))
    out = nnx.jit(fmp.autocast(loss, "p=f32,c=bf16,o=bf16"))(model, _x())
    assert out.dtype == jnp.bfloat16
    assert model.bn.mean[...].dtype == jnp.float32 and model.last[...].dtype == jnp.float32


def test_eval_mode_changes_nothing() -> None:
    model = CNN(nnx.Rngs(0, dropout=1))
    model.eval()
    before = _leaves(model)
    nnx.jit(fmp.autocast(loss))(model, _x())
    after = _leaves(model)
    for key in before:
        if key not in ("calls", "last", "drop.rngs.key"):
            np.testing.assert_array_equal(np.asarray(after[key]), np.asarray(before[key]), err_msg=key)


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dtype=None):
        self.lin = nnx.Linear(3, 16, dtype=dtype, rngs=rngs)
        self.bn = nnx.BatchNorm(16, dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(16, 2, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.bn(self.lin(x))))


def _functional_loss(graphdef):
    """nnx's functional pattern: merge, run (BatchNorm in train mode updates its statistics), split again."""

    def loss_fn(params, rest, x):
        model = nnx.merge(graphdef, params, rest)
        loss = jnp.mean(model(x).astype(jnp.float32) ** 2)
        _, _, new_rest = nnx.split(model, nnx.Param, ...)
        return loss, new_rest

    return loss_fn


_FUNCTIONAL = {
    "jit(value_and_grad(autocast(f)))": lambda f: jax.jit(jax.value_and_grad(fmp.autocast(f), has_aux=True)),
    "value_and_grad(autocast(jit(f)))": lambda f: jax.value_and_grad(fmp.autocast(jax.jit(f)), has_aux=True),
    "autocast(jit(f))": lambda f: lambda *a: (fmp.autocast(jax.jit(f))(*a), None),
}


@pytest.mark.parametrize("how", list(_FUNCTIONAL))
def test_functional_split_merge_under_transforms(how: str) -> None:
    """A loss that merges, runs and splits an nnx model works wherever ``jit(loss)`` does, with its new state
    returned (the batch statistics updated as in float32) and results as float32's and hand-cast code's."""
    x = jax.random.normal(jax.random.key(1), (16, 3))
    graphdef, params, rest = nnx.split(Net(nnx.Rngs(0)), nnx.Param, ...)
    hand_def, _, _ = nnx.split(Net(nnx.Rngs(0), dtype=jnp.bfloat16), nnx.Param, ...)
    ref_step = jax.value_and_grad(jax.jit(_functional_loss(graphdef)), has_aux=True)
    (ref_loss, ref_rest), ref_grads = ref_step(params, rest, x)
    with jax.numpy_dtype_promotion("standard"):  # flax's bfloat16 BatchNorm mixes its float32 statistics in
        hand_step = jax.value_and_grad(jax.jit(_functional_loss(hand_def)), has_aux=True)
        (hand_loss, _), hand_grads = hand_step(params, rest, x)

    (loss, new_rest), grads = _FUNCTIONAL[how](_functional_loss(graphdef))(params, rest, x)

    assert loss.dtype == jnp.float32
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-2)
    np.testing.assert_allclose(loss, hand_loss, rtol=2e-2)
    before, after, ref = (nnx.to_pure_dict(s) for s in (rest, new_rest, ref_rest))
    for stat in ("mean", "var"):
        assert not np.allclose(after["bn"][stat], before["bn"][stat])  # the statistics were updated
        assert after["bn"][stat].dtype == jnp.float32
        np.testing.assert_allclose(after["bn"][stat], ref["bn"][stat], rtol=3e-2, atol=3e-3)
    if grads is not None:
        # relative to the largest gradient: the first bias's is ~0 in exact arithmetic (BatchNorm removes it)
        scale = max(float(jnp.max(jnp.abs(r))) for r in jax.tree_util.tree_leaves(ref_grads))
        for g, r, h in zip(*(jax.tree_util.tree_leaves(t) for t in (grads, ref_grads, hand_grads)), strict=True):
            assert g.dtype == jnp.float32
            np.testing.assert_allclose(g / scale, r / scale, atol=1e-2)
            np.testing.assert_allclose(g / scale, h / scale, atol=1e-2)
    # the caller's state is not mutated (as under jit: the new state is the function's result)
    np.testing.assert_array_equal(nnx.to_pure_dict(rest)["bn"]["mean"], np.zeros(16, np.float32))
