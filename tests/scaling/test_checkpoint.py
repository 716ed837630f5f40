"""Scaler checkpoints: torch's five-key state dict both ways, flax.serialization, orbax, pickle."""

from __future__ import annotations

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers.common import run_python

import fmp

HP = {"init_scale": 3.3, "growth_factor": 1.1, "backoff_factor": 0.3, "growth_interval": 2}
FLAGS = np.random.default_rng(0).random(40) < 0.3  # True: this step overflowed


def _torch_scaler(torch, **kw):
    return torch.amp.GradScaler("cpu", **kw)


def _torch_steps(torch, ts, flags):
    """Runs real GradScaler iterations on CPU, overflowing where flags is True."""
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.0)
    for f in flags:
        opt.zero_grad()
        ts.scale(p.sum()).backward()
        if f:
            p.grad[0] = float("inf")
        ts.step(opt)
        ts.update()


def _fmp_steps(s, flags):
    update = jax.jit(fmp.GradScaler.update)
    for f in flags:
        s = update(s, jnp.array(not f))
    return s


def test_state_dict_has_torchs_keys_and_types():
    torch = pytest.importorskip("torch")
    ts = _torch_scaler(torch, **HP)
    _torch_steps(torch, ts, FLAGS[:5])
    ours = _fmp_steps(fmp.GradScaler(**HP), FLAGS[:5]).state_dict()
    theirs = ts.state_dict()
    assert list(ours) == list(theirs)
    assert {k: type(v) for k, v in ours.items()} == {k: type(v) for k, v in theirs.items()}
    assert ours == theirs
    assert fmp.GradScaler(enabled=False).state_dict() == {} == _torch_scaler(torch, enabled=False).state_dict()


def test_torch_checkpoint_continues_the_same_trajectory_in_fmp_and_back():
    torch = pytest.importorskip("torch")
    ts = _torch_scaler(torch, **HP)
    _torch_steps(torch, ts, FLAGS[:20])
    s = fmp.GradScaler.from_state_dict(ts.state_dict())
    assert (s.growth_factor, s.backoff_factor, s.growth_interval) == (1.1, 0.3, 2)
    _torch_steps(torch, ts, FLAGS[20:])
    s = _fmp_steps(s, FLAGS[20:])
    assert s.state_dict() == ts.state_dict()
    # and an fmp checkpoint loads into torch and continues there
    ts2 = _torch_scaler(torch)
    ts2.load_state_dict(s.state_dict())
    _torch_steps(torch, ts2, FLAGS[:10])
    assert _fmp_steps(s, FLAGS[:10]).state_dict() == ts2.state_dict()


def test_load_state_dict_returns_a_new_scaler_and_keeps_local_options():
    d = {"scale": 512.0, "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 3, "_growth_tracker": 2}
    base = fmp.GradScaler(min_scale=1.0)
    s = base.load_state_dict(d)
    assert s is not base and float(base.loss_scale) == 65536.0
    assert (float(s.loss_scale), int(s.growth_tracker), s.growth_factor, s.min_scale) == (512.0, 2, 4.0, 1.0)
    assert float(s.update(jnp.array(True)).loss_scale) == 2048.0  # tracker 2 -> 3 == interval: grow
    disabled = fmp.GradScaler(enabled=False)
    assert disabled.load_state_dict(d) is disabled
    with pytest.raises(ValueError, match="disabled instance"):
        fmp.GradScaler.from_state_dict({})
    with pytest.raises(ValueError, match="lacks keys"):
        fmp.GradScaler.from_state_dict({"scale": 1.0})
    o = fmp.GradScaler.from_state_dict(d, dynamic=False, growth_interval=10)
    assert not o.dynamic and o.growth_interval == 10


def test_flax_serialization_round_trip():
    serialization = pytest.importorskip("flax.serialization")
    optax = pytest.importorskip("optax")
    import fmp.optax

    s = _fmp_steps(fmp.GradScaler(**HP), FLAGS[:7])
    restored = serialization.from_bytes(fmp.GradScaler(**HP), serialization.to_bytes(s))
    assert restored.state_dict() == s.state_dict() and restored.growth_interval == 2
    # inside an optax state
    opt = fmp.optax.loss_scaled(optax.sgd(0.1), fmp.GradScaler(**HP))
    state = opt.init(jnp.zeros(2))
    state = state._replace(scaler=s)
    back = serialization.from_bytes(opt.init(jnp.zeros(2)), serialization.to_bytes(state))
    assert fmp.optax.current_scaler(back).state_dict() == s.state_dict()


def test_flax_registration_happens_on_import_when_flax_came_first():
    out = run_python(
        """
        import flax.serialization as ser
        import jax.numpy as jnp
        import fmp
        s = fmp.GradScaler(init_scale=8.0).update(jnp.array(False))
        print(float(ser.from_bytes(fmp.GradScaler(), ser.to_bytes(s)).loss_scale))
        """
    )
    assert out.strip() == "4.0"


def test_flax_and_orbax_need_no_registration_call_when_fmp_comes_first(tmp_path):
    # a fresh process: fmp is imported before flax (the order a user's script usually has), and nobody calls
    # GradScaler.register_flax_serialization()
    out = run_python(
        f"""
        import sys
        import jax, jax.numpy as jnp
        import fmp
        assert "flax" not in sys.modules
        import flax.serialization as ser
        import orbax.checkpoint as ocp
        s = fmp.GradScaler(init_scale=8.0).update(jnp.array(False)).update(jnp.array(False))
        d = ser.to_state_dict({{"scaler": s, "step": jnp.int32(3)}})
        print(sorted(d["scaler"]), type(d["scaler"]).__name__)
        back = ser.from_bytes({{"scaler": fmp.GradScaler(), "step": jnp.int32(0)}}, ser.to_bytes({{"scaler": s, "step": 3}}))
        print(float(back["scaler"].loss_scale), int(back["scaler"].consecutive_overflows), int(back["step"]))
        state = {{"params": {{"w": jnp.arange(3.0)}}, "scaler": s}}
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save({str(tmp_path / "ckpt")!r}, state)
            ckpt.wait_until_finished()
            got = ckpt.restore({str(tmp_path / "ckpt")!r}, jax.eval_shape(lambda: state))
        print(type(got["scaler"]).__name__, float(got["scaler"].loss_scale), int(got["scaler"].consecutive_overflows),
              got["params"]["w"].tolist())
        """
    )
    assert out.split("\n")[:3] == [
        "['consecutive_overflows', 'growth_tracker', 'loss_scale'] dict",
        "2.0 2 3",
        "GradScaler 2.0 2 [0.0, 1.0, 2.0]",
    ]


@pytest.mark.parametrize("first", ["flax", "fmp"])
def test_flax_serialization_of_every_fmp_state_needs_no_call_in_either_import_order(first):
    # GradScaler and Float8State both: before, Float8State was registered only when flax came first
    imports = ["import flax.serialization as ser", "import fmp"]
    out = run_python(
        "\n".join(imports if first == "flax" else imports[::-1])
        + """
import dataclasses
import jax.numpy as jnp
s = fmp.GradScaler(init_scale=8.0).update(jnp.array(False))
print(sorted(ser.to_state_dict(s)), float(ser.from_bytes(fmp.GradScaler(), ser.to_bytes(s)).loss_scale))
blank = fmp.Float8State.zeros(["a"], fmp.Float8Recipe("delayed", history_len=2))
st = dataclasses.replace(blank, amax_history=blank.amax_history + 3.0)
print(sorted(ser.to_state_dict(st)), ser.from_bytes(blank, ser.to_bytes(st)).amax_history.tolist())
"""
    )
    assert out.strip().split("\n") == [
        "['consecutive_overflows', 'growth_tracker', 'loss_scale'] 4.0",
        "['amax_history'] [[[3.0, 3.0], [3.0, 3.0], [3.0, 3.0]]]",
    ]


def test_orbax_round_trip(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    s = _fmp_steps(fmp.GradScaler(**HP), FLAGS[:7])
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "scaler", s)
        ckpt.wait_until_finished()
        restored = ckpt.restore(tmp_path / "scaler", jax.eval_shape(lambda: fmp.GradScaler(**HP)))
    assert isinstance(restored, fmp.GradScaler)
    assert restored.state_dict() == s.state_dict()
    assert restored.loss_scale.dtype == jnp.float32 and restored.growth_tracker.dtype == jnp.int32


def test_pickle_round_trip():
    s = _fmp_steps(fmp.GradScaler(**HP), FLAGS[:7])
    back = pickle.loads(pickle.dumps(s))
    assert back.state_dict() == s.state_dict() and back.backoff_factor == 0.3
