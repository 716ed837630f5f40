"""Gradient accumulation with loss scaling that recovers from bad micro-batches.

Trains a small MLP on a synthetic regression task with float16 compute (``fmp.autocast``), float32 params,
``fmp.optax.accumulate(fmp.optax.loss_scaled(adam), k)``, and injects an inf or NaN into the loss of a few
micro-batches. Each bad micro-batch skips exactly its effective batch (the scale backs off once) and the next
effective batch trains normally. The same run through ``optax.MultiSteps`` is shown for contrast: after its
first bad micro-batch it never takes another step.

    python examples/accumulation.py          # 200 effective batches of 4 micro-batches
    python examples/accumulation.py --fast   # 30 effective batches (a smoke test)
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fmp
import fmp.optax


def _data(n_micro: int, batch: int, seed: int) -> tuple[jax.Array, jax.Array]:
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (n_micro, batch, 16))
    w_true = jax.random.normal(kw, (16, 4))
    return x, jnp.tanh(x @ w_true)


def _init(seed: int) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(jax.random.key(seed + 1))
    return {
        "w1": jax.random.normal(k1, (16, 32)) * 0.25,
        "b1": jnp.zeros(32),
        "w2": jax.random.normal(k2, (32, 4)) * 0.18,
        "b2": jnp.zeros(4),
    }


@fmp.autocast(policy="mixed_float16")
def _loss(params, x, y, poison):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    pred = h @ params["w2"] + params["b2"]
    return jnp.mean((pred - y) ** 2) * poison  # poison: 1.0, or inf/NaN for an injected bad micro-batch


def train(opt: optax.GradientTransformation, params, x, y, poison):
    state = opt.init(params)

    @jax.jit
    def micro_step(params, state, x, y, poison):
        scaler = fmp.optax.current_scaler(state)
        grads = jax.grad(lambda p: scaler.scale(_loss(p, x, y, poison)))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    eval_loss = jax.jit(lambda p, x, y: _loss(p, x, y, jnp.float32(1.0)))
    losses = []
    for i in range(x.shape[0]):
        params, state = micro_step(params, state, x[i], y[i], poison[i])
        losses.append(eval_loss(params, x[i], y[i]))
    return params, state, np.array(jax.device_get(losses))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fast", action="store_true", help="a short run (smoke test)")
    parser.add_argument("--k", type=int, default=4, help="micro-batches per effective batch")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    k = args.k
    n_eff = 30 if args.fast else 200
    x, y = _data(n_eff * k, 32, args.seed)
    rng = np.random.default_rng(args.seed)
    poison = np.ones(n_eff * k, np.float32)
    bad = sorted(rng.choice(np.arange(k, n_eff * k), size=max(2, n_eff // 10), replace=False))
    poison[bad] = [np.inf if i % 2 else np.nan for i in range(len(bad))]
    bad_batches = sorted({int(i) // k for i in bad})
    params = _init(args.seed)
    scaler = fmp.GradScaler(init_scale=2.0**10, growth_interval=20)

    opt = fmp.optax.accumulate(fmp.optax.loss_scaled(optax.adam(3e-3), scaler), k)
    _, state, losses = train(opt, params, x, y, jnp.asarray(poison))
    skipped = int(state.inner_state.skipped_steps)
    scale = float(fmp.optax.current_scaler(state).loss_scale)
    print(f"injected {len(bad)} bad micro-batches into effective batches {bad_batches}")
    print(
        f"accumulate(loss_scaled(adam), {k}): skipped {skipped} of {n_eff} effective batches, "
        f"final scale {scale:g}, loss {losses[0]:.4f} -> {losses[-1]:.4f}"
    )

    ms = optax.MultiSteps(fmp.optax.loss_scaled(optax.adam(3e-3), scaler), k)
    _, ms_state, ms_losses = train(ms, params, x, y, jnp.asarray(poison))
    ms_skipped = int(ms_state.inner_opt_state.skipped_steps)
    ms_scale = float(fmp.optax.current_scaler(ms_state).loss_scale)
    print(
        f"optax.MultiSteps(loss_scaled(adam), {k}): skipped {ms_skipped} of {n_eff}, final scale {ms_scale:g}, "
        f"loss {ms_losses[0]:.4f} -> {ms_losses[-1]:.4f}"
    )

    ok = skipped == len(bad_batches) and losses[-1] < 0.5 * losses[0] and ms_skipped > skipped
    print(
        f"summary: accumulate skipped exactly the {len(bad_batches)} bad effective batches and trained "
        f"(loss x{losses[-1] / losses[0]:.3f}); MultiSteps skipped {ms_skipped}: {'OK' if ok else 'FAILED'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
