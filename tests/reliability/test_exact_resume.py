"""Exact resume: checkpoint at a random step (inside an accumulation window too), restore, continue; the resumed
run is bitwise identical to the uninterrupted one. Faults are injected in both runs at the same steps, so the
checkpoint carries a scale that has backed off and grown, skip counters and (mid-window) a partial accumulator.

JAX state goes through ``flax.serialization`` and orbax; torch state through ``torch.save`` / ``torch.load`` with
torch's default ``weights_only=True`` (every state here is tensors and plain Python values).
"""

from __future__ import annotations

import io
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("optax")

import _reliability_jax as hj  # noqa: E402

import fmp  # noqa: E402

STEPS = 24


def _schedule(path: hj._Path, rng: np.random.Generator, steps: int, p_fault: float = 0.2):
    params = path.params0
    out = []
    for _ in range(steps):
        kind = hj.KINDS[rng.integers(len(hj.KINDS))] if rng.random() < p_fault else None
        out.append(hj._clean(params) if kind is None else hj._fault(params, kind, rng))
    return out


def _jax_run(path, step, schedule, data, start=0, state=None, stop=None):
    params, opt_state, scaler = path.init() if state is None else state
    x_all, y_all = data
    for i in range(start, len(schedule) if stop is None else stop):
        params, opt_state, scaler, _ = step(params, opt_state, scaler, x_all[i], y_all[i], schedule[i])
    return params, opt_state, scaler


def _flax_round_trip(state, target):
    serialization = pytest.importorskip("flax.serialization")
    return serialization.from_bytes(target, serialization.to_bytes(state))


def _orbax_round_trip(state, target, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", state)
        ckpt.wait_until_finished()
        return ckpt.restore(tmp_path / "ckpt", jax.eval_shape(lambda: target))


def _as_dict(state):
    params, opt_state, scaler = state
    return {"params": params, "opt_state": opt_state, **({} if scaler is None else {"scaler": scaler})}


def _from_dict(d):
    return d["params"], d["opt_state"], d.get("scaler")


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("value_and_grad", "flax"),
        ("loss_scaled", "orbax"),
        ("accumulate", "flax"),
        ("accumulate", "orbax"),
        ("master_weights", "orbax"),
    ],
)
def test_jax_resume_is_bitwise(name, fmt, tmp_path):
    with jax.numpy_dtype_promotion("standard"):  # optax 0.2.8's adam mixes int32 and float32
        path, step = hj.get_path(name)
        rng = np.random.default_rng(zlib.crc32(f"{name}-{fmt}".encode()))
        schedule = _schedule(path, rng, STEPS)
        schedule[2] = hj._fault(path.params0, "grad_nan", rng)  # at least one skip before any cut
        data = (
            jnp.asarray(rng.standard_normal((STEPS, 16, 8)), jnp.float32),
            jnp.asarray(rng.standard_normal((STEPS, 16, 4)), jnp.float32),
        )
        # a checkpoint inside an accumulation window (not at a multiple of k) for accumulate
        cut = int(rng.integers(1, STEPS - 1))
        if name == "accumulate" and cut % path.k == 0:
            cut += 1
        for j in range(cut, -(-cut // path.k) * path.k):  # the rest of the cut's window is clean, so the
            schedule[j] = hj._clean(path.params0)  # partial accumulator decides whether it is skipped
        full = _jax_run(path, step, schedule, data)
        partial = _jax_run(path, step, schedule, data, stop=cut)
        if name == "accumulate":
            assert int(partial[1].mini_step) == cut % path.k != 0
        saved = hj._bits(partial)
        target = _as_dict(path.init())
        if fmt == "flax":
            restored = _from_dict(_flax_round_trip(_as_dict(partial), target))
        else:
            restored = _from_dict(_orbax_round_trip(_as_dict(partial), target, tmp_path))
        assert jax.tree.structure(restored) == jax.tree.structure(partial)
        assert hj._bits(restored) == saved
        resumed = _jax_run(path, step, schedule, data, start=cut, state=jax.tree.map(jnp.copy, restored))
        assert hj._bits(resumed) == hj._bits(full)
        if name != "value_and_grad":
            assert path.skipped_count(full[1], 0) > 0
        if name == "accumulate":  # the control: dropping the partial accumulator breaks the resume
            params, opt_state, scaler = restored
            opt_state = opt_state._replace(acc=jax.tree.map(jnp.zeros_like, opt_state.acc))
            dropped = _jax_run(path, step, schedule, data, start=cut, state=(params, opt_state, scaler))
            assert hj._bits(dropped) != hj._bits(full)


# ---------------------------------------------------------------------------------------------------------- torch
def _torch_state(run) -> dict:
    if run.path == "fp16_optimizer":
        return {"model": run.model.state_dict(), "opt": run.opt.state_dict()}
    return {
        "model": run.model.state_dict(),
        "opt": run.opt.state_dict(),
        "scaler": run.scaler.state_dict(),
        # mid-window: the accumulated (scaled) gradients are part of the state; torch's state dicts omit them
        "grads": [p.grad for p in run.model.parameters()],
    }


def _torch_load(run, state: dict) -> None:
    run.model.load_state_dict(state["model"])
    run.opt.load_state_dict(state["opt"])
    if run.path == "fp16_optimizer":
        return
    run.scaler.load_state_dict(state["scaler"])
    for p, g in zip(run.model.parameters(), state["grads"], strict=True):
        p.grad = None if g is None else g.clone()


@pytest.mark.parametrize("name", ["torch_facade", "torch_accumulate", "fp16_optimizer"])
def test_torch_resume_is_bitwise_with_weights_only_load(name):
    torch = pytest.importorskip("torch")
    import _reliability_torch as ht

    steps = 24
    rng = np.random.default_rng(5)
    gen = torch.Generator().manual_seed(5)
    xs, ys = torch.randn(steps, 16, 8, generator=gen), torch.randn(steps, 16, 4, generator=gen)
    probe = ht._Run(name, fmp.torch)
    faults = []
    for _ in range(steps):
        kind = ht.TORCH_KINDS[rng.integers(len(ht.TORCH_KINDS))] if rng.random() < 0.2 else None
        faults.append(None if kind is None else ht._fault(probe, kind, rng))
    faults[2] = ht._fault(probe, "loss_nan", rng)  # at least one skip before any cut
    cut = int(rng.integers(1, steps - 1))
    if name == "torch_accumulate" and cut % ht.ACCUMULATE_K == 0:
        cut += 1
    for j in range(cut, -(-cut // ht.ACCUMULATE_K) * ht.ACCUMULATE_K):
        faults[j] = None  # the rest of the cut's window is clean: the saved grads decide its fate
    full = ht._Run(name, fmp.torch)
    for i in range(steps):
        full.step(i, xs[i], ys[i], faults[i])
    first = ht._Run(name, fmp.torch)
    for i in range(cut):
        first.step(i, xs[i], ys[i], faults[i])
    buf = io.BytesIO()
    torch.save(_torch_state(first), buf)
    buf.seek(0)
    state = torch.load(buf)  # torch's default: weights_only=True
    second = ht._Run(name, fmp.torch)
    _torch_load(second, state)
    for i in range(cut, steps):
        second.step(i, xs[i], ys[i], faults[i])
    assert second.protected() == full.protected()
    assert second.scale() == full.scale() and full.scale() != 2.0**12
    if name == "torch_accumulate":  # the control: without the saved .grad tensors the resume differs
        buf.seek(0)
        state = torch.load(buf)
        state["grads"] = [None for _ in state["grads"]]
        third = ht._Run(name, fmp.torch)
        _torch_load(third, state)
        for i in range(cut, steps):
            third.step(i, xs[i], ys[i], faults[i])
        assert third.protected() != full.protected()
