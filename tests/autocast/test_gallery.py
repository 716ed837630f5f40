"""A gallery of real models trained a few steps under autocast.

Each model is trained with plain SGD for a few steps (jitted) in float32, under ``fmp.autocast``, and
cast by hand (the library's own ``dtype=bfloat16`` knobs, or explicit casts), plus one step under
autocast without jit. Tolerances, and why:

* losses vs float32 and vs the hand-cast model: 5 % (``LOSS_TOL``). bfloat16 keeps 8 mantissa bits, a
  matmul/conv entry carries ~2**-8 = 0.4 % relative error; measured gaps here are below 0.1 %.
* parameters after training vs float32: 2 % of each leaf's scale, floored at 0.05 (``PARAM_TOL``); an
  attention key bias has an exact gradient of zero (softmax ignores a shift of all logits) and holds
  only rounding noise, so it is judged on the floor.
* first-step gradients (linen) and trained parameters (nnx): no further from float32 than the hand-cast
  model's (x1.5), or within ``GRAD_TOL`` / ``PARAM_TOL``. A conv bias before a BatchNorm also has an exact
  gradient of zero; on the ResNet the hand-cast model's worst gradient leaf is ~20 % off float32 and
  autocast's ~16 %, so a fixed tolerance would measure the model, not the library.
* bitwise where the program is the same: the equinox MLP written with explicit casts, eager.
* jit vs eager, one step: 2 % (``JIT_TOL``); XLA may keep a bfloat16 intermediate in float32 under jit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fmp

pytestmark = pytest.mark.gallery

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")

BF16 = jnp.bfloat16
LOSS_TOL = 5e-2
PARAM_TOL = 2e-2
JIT_TOL = 2e-2
GRAD_TOL = 5e-2
STEPS = 3
LR = 0.05


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12))


def _sgd(params, grads):
    return jax.tree.map(lambda p, g: p - LR * g, params, grads)


def _train(loss_fn, params, batch, wrap=lambda f: f, steps=STEPS, jit=True):
    """``loss_fn(params, batch) -> (loss, aux)``; aux replaces the non-trainable part (e.g. batch stats)."""

    def step(params):
        (value, aux), grads = jax.value_and_grad(wrap(loss_fn), has_aux=True)(params, batch)
        return _sgd(params["params"], grads["params"]), aux, value, grads

    step = jax.jit(step) if jit else step
    losses, first = [], None
    for _ in range(steps):
        new, aux, value, grads = step(params)
        first = grads["params"] if first is None else first
        params = {"params": new, **aux}
        losses.append(float(value))
    _GRADS.append(first)
    return np.array(losses), params


_GRADS: list = []  # the first step's gradients of the latest runs, for _compare_grads


def _tree_error(grads, grads32):
    """The worst error of a tree (first-step gradients, trained parameters) over its leaves, each relative to its leaf's scale, floored at a
    tenth of the model's largest gradient entry (a leaf whose exact gradient is ~0, a conv bias before a
    BatchNorm or an attention key bias, holds only rounding noise)."""
    scale = max(float(np.max(np.abs(g))) for g in jax.tree_util.tree_leaves(grads32))
    worst = 0.0
    for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads32), strict=True):
        err = float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
        worst = max(worst, err / max(float(np.max(np.abs(b))), 0.1 * scale))
    return worst


def _compare_to_float32(losses, params, losses32, params32):
    assert np.all(np.isfinite(losses))
    np.testing.assert_allclose(losses, losses32, rtol=LOSS_TOL)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves(params32), strict=True
    ):
        assert a.dtype == b.dtype, path
        # relative to the leaf's scale, with an absolute floor for leaves that stay near zero (an attention
        # key bias: its exact gradient is zero, softmax ignores a shift of all logits, so it only holds noise)
        err = float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
        assert err <= PARAM_TOL * max(float(np.max(np.abs(b))), 0.05), (jax.tree_util.keystr(path), err)


def _linen_case(model, x, y, has_stats):
    cast_in = model.dtype != jnp.float32  # the hand-cast model takes its input in bfloat16 too
    with jax.numpy_dtype_promotion("standard" if cast_in else "strict"):
        variables = model.init(jax.random.key(0), x.astype(BF16) if cast_in else x)
    params = {"params": variables["params"]} | ({"batch_stats": variables["batch_stats"]} if has_stats else {})

    def loss_fn(p, batch):
        x, y = batch
        x = x.astype(BF16) if cast_in else x
        # flax's dtype=bfloat16 layers mix float32 and bfloat16 (an attention's float32 softmax, an RNN's
        # float32 carry): run the hand-cast model under JAX's default (standard) promotion, as users do
        with jax.numpy_dtype_promotion("standard" if cast_in else "strict"):
            if has_stats:
                out, upd = model.apply(p, x, mutable=["batch_stats"])
                aux = {"batch_stats": upd["batch_stats"]}
            else:
                out, aux = model.apply(p, x), {}
        return jnp.mean((out.astype(jnp.float32) - y) ** 2), aux

    return loss_fn, params, (x, y)


def _run_linen(make, x, y, has_stats=False):
    loss_fn, params, batch = _linen_case(make(jnp.float32), x, y, has_stats)
    l32, p32 = _train(loss_fn, params, batch)
    la, pa = _train(loss_fn, params, batch, fmp.autocast)
    _compare_to_float32(la, pa, l32, p32)
    # the same model cast by hand: flax's dtype=bfloat16 (params stay float32)
    hand_fn, _, _ = _linen_case(make(BF16), x, y, has_stats)
    lh, _ = _train(hand_fn, params, batch)
    np.testing.assert_allclose(la, lh, rtol=LOSS_TOL)
    # first-step gradients: no further from float32 than the hand-cast model's (x1.5), or within GRAD_TOL
    g32, gauto, ghand = _GRADS[-3:]
    auto_err, hand_err = _tree_error(gauto, g32), _tree_error(ghand, g32)
    assert auto_err <= max(GRAD_TOL, 1.5 * hand_err), (auto_err, hand_err)
    # jit vs eager, one step
    le, _ = _train(loss_fn, params, batch, fmp.autocast, steps=1, jit=False)
    np.testing.assert_allclose(la[:1], le, rtol=JIT_TOL)


# ------------------------------------------------------------------------------------------ flax linen


class ResBlock(nn.Module):
    ch: int
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x):
        h = nn.Conv(self.ch, (3, 3), dtype=self.dtype)(x)
        h = nn.relu(nn.BatchNorm(use_running_average=False, dtype=self.dtype)(h))
        h = nn.Conv(self.ch, (3, 3), dtype=self.dtype)(h)
        h = nn.BatchNorm(use_running_average=False, dtype=self.dtype)(h)
        return nn.relu(x + h)


class ResNet(nn.Module):
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(8, (3, 3), dtype=self.dtype)(x)
        x = ResBlock(8, self.dtype)(x)
        x = ResBlock(8, self.dtype)(x)
        return nn.Dense(4, dtype=self.dtype)(x.mean((1, 2)))


def test_linen_resnet_batchnorm() -> None:
    x = jax.random.normal(jax.random.key(1), (4, 8, 8, 3))
    y = jax.random.normal(jax.random.key(2), (4, 4))
    _run_linen(lambda dt: ResNet(dt), x, y, has_stats=True)


class EncoderLayer(nn.Module):
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(dtype=self.dtype)(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=4, dtype=self.dtype)(h, h)
        h = nn.LayerNorm(dtype=self.dtype)(x)
        h = nn.Dense(64, dtype=self.dtype)(h)
        return x + nn.Dense(32, dtype=self.dtype)(nn.gelu(h))


class Encoder(nn.Module):
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            x = EncoderLayer(self.dtype)(x)
        return nn.Dense(8, dtype=self.dtype)(x)


def _seq():
    x = jax.random.normal(jax.random.key(1), (4, 6, 32))
    y = jax.random.normal(jax.random.key(2), (4, 6, 8))
    return x, y


def test_linen_transformer_encoder() -> None:
    _run_linen(lambda dt: Encoder(dt), *_seq())


class RNNStack(nn.Module):
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = nn.RNN(nn.LSTMCell(32, dtype=self.dtype))(x)
        x = nn.RNN(nn.GRUCell(32, dtype=self.dtype))(x)
        return nn.Dense(8, dtype=self.dtype)(x)


def test_linen_rnn_stack() -> None:
    _run_linen(lambda dt: RNNStack(dt), *_seq())


class ScanBlock(nn.Module):
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x, _):
        h = nn.Dense(32, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))
        return x + nn.tanh(h), None


class ScanRematStack(nn.Module):
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x):
        stack = nn.scan(
            nn.remat(ScanBlock),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=3,
        )
        x, _ = stack(self.dtype)(x, None)
        return nn.Dense(8, dtype=self.dtype)(x)


def test_linen_scan_remat_stack() -> None:
    _run_linen(lambda dt: ScanRematStack(dt), *_seq())


# ------------------------------------------------------------------------------------------ flax nnx


class NNXCNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dtype=None):
        self.dtype = dtype
        self.conv1 = nnx.Conv(3, 8, (3, 3), dtype=dtype, rngs=rngs)
        self.bn = nnx.BatchNorm(8, dtype=dtype, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.conv2 = nnx.Conv(8, 8, (3, 3), dtype=dtype, rngs=rngs)
        self.lin = nnx.Linear(8, 4, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        x = x if self.dtype is None else x.astype(self.dtype)
        h = self.drop(nnx.relu(self.bn(self.conv1(x))))
        return self.lin(nnx.relu(self.conv2(h)).mean((1, 2))).astype(jnp.float32)


def _nnx_train(wrap, dtype=None):
    model = NNXCNN(nnx.Rngs(0, dropout=1), dtype)
    x = jax.random.normal(jax.random.key(1), (4, 8, 8, 3))
    y = jax.random.normal(jax.random.key(2), (4, 4))

    def loss(m, x, y):
        return jnp.mean((m(x) - y) ** 2)

    @nnx.jit
    def step(m, x, y):
        value, grads = nnx.value_and_grad(wrap(loss))(m, x, y)
        params = nnx.state(m, nnx.Param)
        nnx.update(m, jax.tree.map(lambda p, g: p - LR * g, params, grads))
        return value

    with jax.numpy_dtype_promotion("standard" if dtype is not None else "strict"):
        losses = np.array([float(step(model, x, y)) for _ in range(STEPS)])
    return losses, model


def test_nnx_cnn_batchnorm_dropout() -> None:
    l32, m32 = _nnx_train(lambda f: f)
    la, ma = _nnx_train(fmp.autocast)
    lh, mh = _nnx_train(lambda f: f, BF16)  # cast by hand: nnx's dtype=bfloat16 layers
    # the state updates happened: BatchNorm statistics and the dropout RNG count moved as in float32
    assert int(ma.drop.rngs.count[...]) == int(m32.drop.rngs.count[...]) == STEPS
    assert _rel(ma.bn.mean[...], m32.bn.mean[...]) < PARAM_TOL
    np.testing.assert_allclose(la, l32, rtol=LOSS_TOL)
    np.testing.assert_allclose(la, lh, rtol=LOSS_TOL)
    # parameters after training: no further from float32 than the hand-cast model's (x1.5), or within
    # PARAM_TOL (a conv bias moves by ~1e-2 in three steps; its bfloat16 bias add, as in the hand-cast model
    # and in torch's conv, leaves ~1e-3 of it)
    p32, pa, ph = (nnx.state(m, nnx.Param) for m in (m32, ma, mh))
    auto_err, hand_err = _tree_error(pa, p32), _tree_error(ph, p32)
    assert auto_err <= max(PARAM_TOL, 1.5 * hand_err), (auto_err, hand_err)


# ------------------------------------------------------------------------------------------ equinox


class EqxMLP(eqx.Module):
    layers: list

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.layers = [eqx.nn.Linear(16, 32, key=k1), eqx.nn.Linear(32, 32, key=k2), eqx.nn.Linear(32, 4, key=k3)]

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


def _hand_mlp(model, x):
    """The MLP cast by hand: bfloat16 matmuls with the bias added in bfloat16 (torch's linear does the same)."""
    for i, layer in enumerate(model.layers):
        x = x.astype(BF16) @ layer.weight.T.astype(BF16) + layer.bias.astype(BF16)
        if i < len(model.layers) - 1:
            x = jax.nn.relu(x)
    return x.astype(jnp.float32)


def _eqx_train(loss, model, batch, wrap=lambda f: f, steps=STEPS, jit=True):
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def step(params):
        value, grads = jax.value_and_grad(wrap(lambda p, b: loss(eqx.combine(p, static), b)))(params, batch)
        return _sgd(params, grads), value

    step = jax.jit(step) if jit else step
    losses = []
    for _ in range(steps):
        params, value = step(params)
        losses.append(float(value))
    return np.array(losses), params


def _mlp_data():
    x = jax.random.normal(jax.random.key(1), (8, 16))
    return x, jax.random.normal(jax.random.key(2), (8, 4))


def test_equinox_mlp_matches_hand_cast_bitwise() -> None:
    model = EqxMLP(jax.random.key(0))
    batch = _mlp_data()

    def loss(m, b):
        return jnp.mean((jax.vmap(m)(b[0]) - b[1]) ** 2)

    def hand_loss(m, b):
        return jnp.mean((_hand_mlp(m, b[0]) - b[1]) ** 2)

    # eager: the autocast program and the hand-cast one are the same program, so bitwise
    la, pa = _eqx_train(loss, model, batch, fmp.autocast, steps=2, jit=False)
    lh, ph = _eqx_train(hand_loss, model, batch, steps=2, jit=False)
    np.testing.assert_array_equal(la, lh)
    for a, b in zip(jax.tree_util.tree_leaves(pa), jax.tree_util.tree_leaves(ph), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    l32, p32 = _eqx_train(loss, model, batch)
    lj, pj = _eqx_train(loss, model, batch, fmp.autocast)
    _compare_to_float32(lj, pj, l32, p32)
    np.testing.assert_allclose(lj[:2], la, rtol=JIT_TOL)


class EqxAttention(eqx.Module):
    attn: eqx.nn.MultiheadAttention
    norm: eqx.nn.LayerNorm
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.attn = eqx.nn.MultiheadAttention(4, 32, key=k1)
        self.norm = eqx.nn.LayerNorm(32)
        self.out = eqx.nn.Linear(32, 8, key=k2)

    def __call__(self, x):
        h = jax.vmap(self.norm)(x)
        x = x + self.attn(h, h, h)
        return jax.vmap(self.out)(x)


class EqxLSTM(eqx.Module):
    cell: eqx.nn.LSTMCell
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.cell = eqx.nn.LSTMCell(32, 32, key=k1)
        self.out = eqx.nn.Linear(32, 8, key=k2)

    def __call__(self, xs):
        def body(carry, x):
            carry = self.cell(x, carry)
            return carry, carry[0]

        init = (jnp.zeros(32), jnp.zeros(32))
        _, hs = jax.lax.scan(body, init, xs)
        return jax.vmap(self.out)(hs)


@pytest.mark.parametrize("make", [EqxAttention, EqxLSTM], ids=["attention", "lstm_scan"])
def test_equinox_models(make) -> None:
    model = make(jax.random.key(0))
    x, y = _seq()

    def loss(m, b):
        return jnp.mean((jax.vmap(m)(b[0]) - b[1]) ** 2)

    l32, p32 = _eqx_train(loss, model, (x, y))
    la, pa = _eqx_train(loss, model, (x, y), fmp.autocast)
    _compare_to_float32(la, pa, l32, p32)
    le, _ = _eqx_train(loss, model, (x, y), fmp.autocast, steps=1, jit=False)
    np.testing.assert_allclose(la[:1], le, rtol=JIT_TOL)
