"""Fault injection for the JAX ways to train: seeded inf/NaN in gradient leaves, the loss and aux.

Every path is driven twice with the same data:

* the **system under test** (SUT): the jitted, donating train step, with the scheduled faults injected;
* the **reference**: the *same* jitted step function, called with clean inputs on the steps that were not
  injected, and not called at all on injected steps; there it only does what a skip must do (leave params
  and optimizer state alone, back the scale off once, count the skip). Same program, same inputs on the
  taken steps, so the comparison is bitwise.

After every step the harness checks, bit for bit: a step the SUT skipped left params and optimizer state
unchanged; params, optimizer state and scale equal the reference's. Each failed check counts as a
corruption (the tests assert there are none; the report prints the counts).

Faults go in through the program's inputs, so one compiled step serves clean and faulty steps:

* ``grad``: a custom-VJP identity on each param leaf replaces the chosen element of its (scaled) cotangent
  by inf or NaN;
* ``loss``: the loss is multiplied by inf or NaN (every gradient becomes non-finite, as from a real
  overflow in the forward pass);
* ``aux``: a NaN is added to the auxiliary output, which must *not* skip the step.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fmp
import fmp.optax

JAX_PATHS = ("value_and_grad", "loss_scaled", "skip_nonfinite", "accumulate", "master_weights")
KINDS = ("grad_inf", "grad_nan", "loss_inf", "loss_nan", "aux_nan")
SKIPPING_KINDS = frozenset(KINDS) - {"aux_nan"}
ACCUMULATE_K = 4


@dataclasses.dataclass
class Counts:
    path: str
    steps: int = 0
    injected: int = 0
    injected_by_kind: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    skipped: int = 0  # optimizer steps the SUT skipped (effective batches for accumulation)
    expected_skips: int = 0  # of those, the ones an injection caused (the rest: real overflow)
    checks: int = 0
    corruptions: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)

    def fail(self, step: int, what: str) -> None:
        self.corruptions += 1
        if len(self.notes) < 10:
            self.notes.append(f"step {step}: {what}")


def _bits(tree: Any) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@jax.custom_vjp
def _poke(x, mask, value):
    return x


def _poke_fwd(x, mask, value):
    return x, (mask, value)


def _poke_bwd(res, g):
    mask, value = res
    return jnp.where(mask, value.astype(g.dtype), g), None, None


_poke.defvjp(_poke_fwd, _poke_bwd)


def _params(dtype) -> dict[str, jax.Array]:
    k = jax.random.split(jax.random.key(42), 2)
    p = {
        "w1": jax.random.normal(k[0], (8, 16)) * 0.4,
        "b1": jnp.full((16,), 0.01),
        "w2": jax.random.normal(k[1], (16, 4)) * 0.3,
        "b2": jnp.zeros(4),
    }
    return jax.tree.map(lambda x: x.astype(dtype), p)


def _loss(params, x, y, inj):
    params = jax.tree.map(lambda p, m: _poke(p, m, inj["grad_value"]), params, inj["masks"])
    h = jnp.tanh(x.astype(params["w1"].dtype) @ params["w1"] + params["b1"])
    pred = (h @ params["w2"] + params["b2"]).astype(jnp.float32)
    loss = jnp.mean((pred - y) ** 2) * inj["loss_factor"]
    return loss, jnp.mean(pred) + inj["aux_value"]


def _clean(params) -> dict[str, Any]:
    return {
        "masks": jax.tree.map(lambda p: jnp.zeros(p.shape, bool), params),
        "grad_value": jnp.float32(0.0),
        "loss_factor": jnp.float32(1.0),
        "aux_value": jnp.float32(0.0),
    }


def _fault(params, kind: str, rng: np.random.Generator) -> dict[str, Any]:
    inj = _clean(params)
    bad = jnp.float32(np.inf if kind.endswith("inf") else np.nan)
    if kind.startswith("grad"):
        names = sorted(params)
        name = names[rng.integers(len(names))]
        idx = np.unravel_index(rng.integers(params[name].size), params[name].shape)
        masks = dict(inj["masks"])
        masks[name] = masks[name].at[idx].set(True)
        inj["masks"], inj["grad_value"] = masks, bad * (1 if rng.random() < 0.5 else -1)
    elif kind.startswith("loss"):
        inj["loss_factor"] = bad
    else:
        inj["aux_value"] = bad
    return inj


def _ls_skip(s: fmp.optax.LossScaledState) -> fmp.optax.LossScaledState:
    """What a skipped step must do to a loss_scaled state (written out here as the reference)."""
    return s._replace(
        scaler=s.scaler.update(jnp.array(False)),
        skipped_steps=optax.safe_increment(s.skipped_steps),
        consecutive_skipped=optax.safe_increment(s.consecutive_skipped),
    )


def _scaler_hp() -> fmp.GradScaler:
    return fmp.GradScaler(init_scale=2.0**12, growth_interval=8)


class _Path:
    """One way to train: init, the step, how a skip looks, what must stay bit-identical when it is skipped."""

    def __init__(self, name: str):
        self.name = name
        self.k = ACCUMULATE_K if name in ("accumulate", "multisteps") else 1
        self.params0 = _params(jnp.float16 if name == "master_weights" else jnp.float32)
        adam = optax.adam(1e-2)
        if name == "value_and_grad":
            self.opt = adam
        elif name == "loss_scaled":
            self.opt = fmp.optax.loss_scaled(optax.chain(optax.clip_by_global_norm(1.0), adam), _scaler_hp())
        elif name == "skip_nonfinite":
            self.opt = fmp.optax.skip_nonfinite(adam)
        elif name == "accumulate":
            self.opt = fmp.optax.accumulate(fmp.optax.loss_scaled(adam, _scaler_hp()), ACCUMULATE_K)
        elif name == "master_weights":
            self.opt = fmp.optax.master_weights(fmp.optax.loss_scaled(adam, _scaler_hp()))
        elif name == "multisteps":  # the broken composition, to show the harness catches it
            self.opt = optax.MultiSteps(fmp.optax.loss_scaled(adam, _scaler_hp()), ACCUMULATE_K)
        else:
            raise ValueError(name)

    def init(self) -> tuple[Any, Any, Any]:
        scaler = _scaler_hp() if self.name == "value_and_grad" else None
        params = jax.tree.map(jnp.copy, self.params0)  # fresh buffers: the SUT donates its own
        return params, jax.tree.map(jnp.copy, self.opt.init(params)), scaler

    def step_fn(self):
        name, opt = self.name, self.opt

        def step(params, opt_state, scaler, x, y, inj):
            if name == "value_and_grad":
                (_, aux), grads, finite, scaler = fmp.value_and_grad(_loss, scaler, has_aux=True)(params, x, y, inj)
                updates, new_opt = opt.update(grads, opt_state, params)
                new_params = optax.apply_updates(params, updates)
                params = fmp.select_tree(finite, new_params, params)
                opt_state = fmp.select_tree(finite, new_opt, opt_state)
                return params, opt_state, scaler, aux
            if name == "skip_nonfinite":
                grads, aux = jax.grad(_loss, has_aux=True)(params, x, y, inj)
            else:
                sc = fmp.optax.current_scaler(opt_state)

                def scaled(p):
                    loss, aux = _loss(p, x, y, inj)
                    return sc.scale(loss), aux

                grads, aux = jax.grad(scaled, has_aux=True)(params)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, scaler, aux

        return step

    # -- what a skip does, and what it must not touch --------------------------------------------------------------
    def skip(self, opt_state, scaler):
        """The reference's skip of one optimizer step."""
        n = self.name
        if n == "value_and_grad":
            return opt_state, scaler.update(jnp.array(False))
        if n == "loss_scaled":
            return _ls_skip(opt_state), scaler
        if n == "skip_nonfinite":
            return opt_state._replace(
                skipped_steps=optax.safe_increment(opt_state.skipped_steps),
                consecutive_skipped=optax.safe_increment(opt_state.consecutive_skipped),
            ), scaler
        if n == "accumulate":
            return opt_state._replace(inner_state=_ls_skip(opt_state.inner_state)), scaler
        if n == "multisteps":
            return opt_state._replace(inner_opt_state=_ls_skip(opt_state.inner_opt_state)), scaler
        return opt_state._replace(inner_state=_ls_skip(opt_state.inner_state)), scaler

    def protected(self, opt_state) -> Any:
        """The optimizer state a skipped step must leave bit-identical (everything but scale and counters)."""
        n = self.name
        if n == "value_and_grad":
            return opt_state
        if n in ("loss_scaled", "skip_nonfinite"):
            return opt_state.inner_state
        if n == "accumulate":
            return opt_state.inner_state.inner_state
        if n == "multisteps":
            return opt_state.inner_opt_state.inner_state
        return (opt_state.master, opt_state.inner_state.inner_state)

    def skipped_count(self, opt_state, scaler_skips: int) -> int:
        n = self.name
        if n == "value_and_grad":
            return scaler_skips
        if n in ("loss_scaled", "skip_nonfinite"):
            return int(opt_state.skipped_steps)
        if n == "multisteps":
            return int(opt_state.inner_opt_state.skipped_steps)
        return int(opt_state.inner_state.skipped_steps)

    def scale(self, opt_state, scaler) -> float:
        if self.name == "value_and_grad":
            return float(scaler.loss_scale)
        if self.name == "skip_nonfinite":
            return 1.0
        return float(fmp.optax.current_scaler(opt_state).loss_scale)


@functools.cache
def get_path(name: str) -> tuple[_Path, Any]:
    """The path and its jitted, donating step, built once per process (tests share the compiled program)."""
    path = _Path(name)
    return path, jax.jit(path.step_fn(), donate_argnums=(0, 1))


def run_path(name: str, steps: int, seed: int, p_fault: float = 0.1) -> Counts:
    """Runs ``steps`` micro-steps of ``name`` with seeded faults; returns the counts."""
    with jax.numpy_dtype_promotion("standard"):  # optax 0.2.8's adam mixes int32 and float32
        return _run(name, steps, seed, p_fault)


def _run(name: str, steps: int, seed: int, p_fault: float) -> Counts:
    path, step = get_path(name)
    k = path.k
    steps -= steps % k
    rng = np.random.default_rng(seed)
    x_all = rng.standard_normal((steps, 16, 8)).astype(np.float32)
    y_all = np.tanh(x_all @ rng.standard_normal((8, 4))).astype(np.float32)
    # one compiled program for both runs (each donates its own buffers): the reference is the same program
    sut = ref = step
    counts = Counts(name)
    params, opt_state, scaler = path.init()
    r_params, r_opt, r_scaler = path.init()
    clean = _clean(params)
    window_bad, window_start = False, None
    sut_scaler_skips = 0
    for i in range(steps):
        micro = i % k
        if micro == 0:
            window_bad = False
            window_start = (_bits(params), _bits(path.protected(opt_state)))
        kind = KINDS[rng.integers(len(KINDS))] if rng.random() < p_fault else None
        inj = clean if kind is None else _fault(params, kind, rng)
        if kind is not None:
            counts.injected += 1
            counts.injected_by_kind[kind] += 1
            window_bad |= kind in SKIPPING_KINDS
        x, y = jnp.asarray(x_all[i]), jnp.asarray(y_all[i])
        before = (_bits(params), _bits(path.protected(opt_state)))
        skipped_before = path.skipped_count(opt_state, sut_scaler_skips)
        scale_before = path.scale(opt_state, scaler)
        params, opt_state, new_scaler, aux = sut(params, opt_state, scaler, x, y, inj)
        if name == "value_and_grad":
            sut_scaler_skips += int(float(new_scaler.loss_scale) < scale_before)
        scaler = new_scaler
        counts.steps += 1
        skipped_now = path.skipped_count(opt_state, sut_scaler_skips) > skipped_before
        if kind == "aux_nan" and not bool(jnp.isnan(aux)):
            counts.fail(i, "aux NaN did not reach the aux output")
        # reference: the clean step on steps (windows) without a skipping fault, a bare skip otherwise
        if micro == k - 1:
            if window_bad:
                r_opt, r_scaler = path.skip(r_opt, r_scaler)
            else:
                for j in range(i - k + 1, i + 1):
                    r_params, r_opt, r_scaler, _ = ref(
                        r_params, r_opt, r_scaler, jnp.asarray(x_all[j]), jnp.asarray(y_all[j]), clean
                    )
        # checks
        counts.checks += 1
        if micro < k - 1:  # inside an accumulation window nothing may move
            if (_bits(params), _bits(path.protected(opt_state))) != before:
                counts.fail(i, "a micro-step changed params or optimizer state")
            continue
        if skipped_now:
            counts.skipped += 1
            counts.expected_skips += int(window_bad)
            if (_bits(params), _bits(path.protected(opt_state))) != window_start:
                counts.fail(i, "a skipped step changed params or optimizer state")
        elif window_bad:
            counts.fail(i, f"an injected {kind} fault was not skipped")
        if _bits(params) != _bits(r_params):
            counts.fail(i, "params differ from the reference")
        if _bits(path.protected(opt_state)) != _bits(path.protected(r_opt)):
            counts.fail(i, "optimizer state differs from the reference")
        if path.scale(opt_state, scaler) != path.scale(r_opt, r_scaler):
            counts.fail(i, "scale differs from the reference")
        if not bool(fmp.all_finite(params)):
            counts.fail(i, "non-finite params")
    return counts
