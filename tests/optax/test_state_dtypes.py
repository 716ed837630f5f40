"""fmp.optax.state_dtypes: named optax state fields stored in their own dtypes; low-precision states round-trip
through flax serialisation and orbax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

optax = pytest.importorskip("optax")
from _helpers.common import optax_not_strict  # noqa: E402
from _helpers.common import tree_bits as bits  # noqa: E402

import fmp.optax  # noqa: E402


def _dtypes(tree):
    return [x.dtype for x in jax.tree.leaves(tree)]


@optax_not_strict
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_fields_keep_their_dtypes_through_jitted_updates(rounding):
    params = {"w": jnp.ones((4, 4), jnp.bfloat16), "b": jnp.zeros(4, jnp.float32)}
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))  # nested: chain in chain
    opt = fmp.optax.state_dtypes(inner, mu="bfloat16", nu="float32", rounding=rounding, seed=1)
    state = opt.init(params)
    adam = state.inner_state[1][0]
    assert {adam.mu["w"].dtype, adam.mu["b"].dtype} == {jnp.dtype(jnp.bfloat16)}
    assert {adam.nu["w"].dtype, adam.nu["b"].dtype} == {jnp.dtype(jnp.float32)}
    before = _dtypes(state)
    step = jax.jit(opt.update)
    grads = {"w": jnp.full((4, 4), 0.1, jnp.bfloat16), "b": jnp.full(4, 0.1, jnp.float32)}
    for _ in range(3):
        updates, new = step(grads, state, params)
        jax.lax.cond(True, lambda: state, lambda: new)  # noqa: B023 (same structure and dtypes)
        state = new
    assert _dtypes(state) == before and step._cache_size() == 1
    assert updates["w"].dtype == jnp.bfloat16 and updates["b"].dtype == jnp.float32
    assert int(state.inner_state[1][0].count) == 3
    assert (state.key is None) == (rounding == "nearest")


def test_unknown_field_lists_the_fields_the_state_has():
    opt = fmp.optax.state_dtypes(optax.chain(optax.trace(0.9), optax.scale_by_rms()), mu="bfloat16")
    with pytest.raises(ValueError, match=r"no field named mu .* has the fields nu, trace"):
        opt.init(jnp.zeros(3))
    with pytest.raises(TypeError, match="nu= must be a floating dtype"):
        fmp.optax.state_dtypes(optax.sgd(0.1), nu="int8")
    with pytest.raises(ValueError, match="rounding must be 'nearest' or 'stochastic'"):
        fmp.optax.state_dtypes(optax.sgd(0.1), rounding="up")


def test_stochastic_state_rounding_lets_a_slow_average_decay():
    # nu <- 0.999 nu + 0.001 g**2 with g = 0: each step changes nu by 0.1%, under half of bfloat16's spacing
    def run(rounding):
        opt = fmp.optax.state_dtypes(optax.scale_by_rms(decay=0.999), nu="bfloat16", rounding=rounding)
        params = jnp.zeros(2000)
        state = opt.init(params)
        state = state._replace(inner_state=state.inner_state._replace(nu=jnp.ones(2000, jnp.bfloat16)))

        def body(s, _):
            return opt.update(jnp.zeros(2000), s, params)[1], None

        state, _ = jax.jit(lambda s: jax.lax.scan(body, s, None, length=300))(state)
        return np.asarray(state.inner_state.nu, np.float32).mean()

    assert run("nearest") == 1.0  # never decays
    assert run("stochastic") == pytest.approx(0.999**300, rel=0.01)


def _trained_state():
    params = {"w": jnp.full(8, 1.5, jnp.bfloat16), "b": jnp.ones(2)}
    opt = optax.chain(
        fmp.optax.state_dtypes(optax.adam(1e-3), mu="bfloat16", rounding="stochastic"),
        fmp.optax.kahan(),
        fmp.optax.stochastic_round(seed=5),
    )
    state = opt.init(params)
    step = jax.jit(opt.update)
    for _ in range(2):
        updates, state = step(jax.tree.map(lambda p: jnp.full(p.shape, 0.3, p.dtype), params), state, params)
        params = optax.apply_updates(params, updates)
    return opt.init(params), state


@optax_not_strict
def test_low_precision_states_round_trip_through_flax_serialization():
    serialization = pytest.importorskip("flax.serialization")
    template, state = _trained_state()
    restored = serialization.from_bytes(template, serialization.to_bytes(state))
    assert bits(restored) == bits(state) and _dtypes(restored) == _dtypes(state)


@pytest.mark.gallery  # importing orbax and its first save take ~15 s here; CI runs the galleries
@optax_not_strict
def test_low_precision_states_round_trip_through_orbax(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    template, state = _trained_state()
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "state", state)
        ckpt.wait_until_finished()
        back = ckpt.restore(tmp_path / "state", template)
    assert bits(back) == bits(state) and _dtypes(back) == _dtypes(state)
