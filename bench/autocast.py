"""Benchmark: fmp.autocast vs float32 vs hand-cast bfloat16 on a small pre-LN transformer.

Run ``python bench/autocast.py`` from the repository root; it prints one table:
step runtime (median), compiled temp/argument bytes (``memory_analysis``),
bytes saved for the backward pass (the vjp residuals), convert ops after XLA
optimisation, and trace+lower and compile times. Model: 2 pre-LN blocks,
B=8, T=128, D=256, 4 heads, MLP 4x (the issue's configuration).
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fmp  # noqa: E402

F32 = jnp.float32


def init_params(key: jax.Array, d: int = 256, layers: int = 2) -> dict:
    blocks = []
    for k in jax.random.split(key, layers):
        k1, k2, k3, k4 = jax.random.split(k, 4)
        blocks.append(
            {
                "ln1": (jnp.ones(d), jnp.zeros(d)),
                "wqkv": jax.random.normal(k1, (d, 3 * d)) / math.sqrt(d),
                "wo": jax.random.normal(k2, (d, d)) / math.sqrt(d),
                "ln2": (jnp.ones(d), jnp.zeros(d)),
                "w1": jax.random.normal(k3, (d, 4 * d)) / math.sqrt(d),
                "b1": jnp.zeros(4 * d),
                "w2": jax.random.normal(k4, (4 * d, d)) / math.sqrt(4 * d),
                "b2": jnp.zeros(d),
            }
        )
    return {"blocks": blocks}


def _identity(z: jax.Array) -> jax.Array:
    return z


def _to_bf16(z: jax.Array) -> jax.Array:
    return z.astype(jnp.bfloat16)


def _to_f32(z: jax.Array) -> jax.Array:
    return z.astype(F32)


def layer_norm(x: jax.Array, scale_bias: tuple[jax.Array, jax.Array]) -> jax.Array:
    g, b = scale_bias
    m = x.mean(-1, keepdims=True)
    v = jnp.square(x - m).mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-5) * g + b


def block(p: dict, x: jax.Array, hand: bool = False, gelu_f32: bool = False, heads: int = 4) -> jax.Array:
    """One pre-LN block; ``hand=True`` casts the matmuls and their bias adds to bfloat16 by hand.

    The hand-cast version is what a person writes for bfloat16 Dense layers:
    a matmul's inputs and its bias go to bfloat16, so ``h @ w + b`` is
    bfloat16, and ``gelu`` runs on that bfloat16 value; a matmul's bfloat16
    result stays bfloat16 through reshapes and the attention scale, and
    returns to float32 where it meets a float32 value (the softmax, the
    residual stream). ``gelu_f32=True`` runs ``gelu`` on float32 input
    instead, which is what ``fmp.autocast`` does when ``integer_pow`` (the
    cube inside ``gelu``) is moved to the ``float32`` category.
    """
    lo, hi = (_to_bf16, _to_f32) if hand else (_identity, _identity)

    def mm(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.einsum(spec, lo(a), lo(b))

    def dense(a: jax.Array, w: jax.Array, bias: jax.Array) -> jax.Array:
        return mm("btd,de->bte", a, w) + lo(bias)

    b, t, d = x.shape
    h = layer_norm(x, p["ln1"])
    q, k, v = jnp.split(mm("btd,de->bte", h, p["wqkv"]), 3, axis=-1)
    q, k, v = (z.reshape(b, t, heads, d // heads) for z in (q, k, v))
    s = mm("bthd,bshd->bhts", q, k) * (1.0 / math.sqrt(d // heads))
    mask = jnp.tril(jnp.ones((t, t), bool))
    a = jax.nn.softmax(jnp.where(mask, hi(s), -1e9), axis=-1)
    o = mm("bhts,bshd->bthd", a, v).reshape(b, t, d)
    x = x + hi(mm("btd,de->bte", o, p["wo"]))
    h = layer_norm(x, p["ln2"])
    h = dense(h, p["w1"], p["b1"])
    h = jax.nn.gelu(hi(h) if gelu_f32 else h)
    return x + hi(dense(h, p["w2"], p["b2"]))


def transformer(params: dict, x: jax.Array, hand: bool = False, gelu_f32: bool = False) -> jax.Array:
    for p in params["blocks"]:
        x = block(p, x, hand, gelu_f32)
    return x


def loss(params: dict, x: jax.Array, hand: bool = False, gelu_f32: bool = False) -> jax.Array:
    return jnp.mean(jnp.square(transformer(params, x, hand, gelu_f32) - x))


# integer_pow (x**3 inside gelu) moved into the float32 category: gelu then runs on float32 input
F32_POW_RULES = fmp.DEFAULT_RULES.derive(float32=["integer_pow"])


def variants() -> dict[str, Callable]:
    return {
        "float32": loss,
        "hand-cast bf16": lambda p, x: loss(p, x, hand=True),
        "fmp.autocast bf16": fmp.autocast(loss),
        "hand-cast bf16, float32 gelu": lambda p, x: loss(p, x, hand=True, gelu_f32=True),
        "fmp.autocast bf16, integer_pow float32": fmp.autocast(loss, rules=F32_POW_RULES),
        "fmp.autocast bf16, no epilogue": fmp.autocast(loss, rules=fmp.DEFAULT_RULES.derive(epilogue=[])),
    }


def linen_encoder(hand: bool, layers: int = 4, d: int = 128, heads: int = 4) -> tuple[Callable, Callable]:
    """A flax linen pre-LN encoder: ``(init, loss)``; ``hand=True`` sets ``dtype=bfloat16`` on its layers."""
    import flax.linen as nn

    dt = jnp.bfloat16 if hand else None

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            h = nn.LayerNorm(dtype=dt)(x)
            x = x + nn.SelfAttention(num_heads=heads, dtype=dt)(h)
            h = nn.Dense(4 * d, dtype=dt)(nn.LayerNorm(dtype=dt)(x))
            return x + nn.Dense(d, dtype=dt)(nn.gelu(h))

    class Encoder(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            for _ in range(layers):
                x = Block()(x)
            return x.astype(F32)

    model = Encoder()

    def enc_loss(params: Any, x: jax.Array) -> jax.Array:
        return jnp.mean(jnp.square(model.apply(params, x) - x))

    return model.init, enc_loss


def trace_ratios(rounds: int) -> dict[str, float]:
    """trace+lower of ``jit(value_and_grad(loss))``, autocast / hand-cast, min over interleaved rounds.

    Each round builds a fresh ``fmp.autocast`` wrapper and a fresh ``value_and_grad``, so nothing fmp or the
    outer ``jit`` traced before is reused; JAX's own caches (jnp's jitted helpers) serve both variants alike.
    """
    params = init_params(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (8, 128, 256))
    init, enc_loss = linen_encoder(hand=False)
    _, enc_hand = linen_encoder(hand=True)
    xe = jax.random.normal(jax.random.key(2), (8, 64, 128))
    enc_params = init(jax.random.key(3), xe)
    cases = {
        "transformer": (lambda: fmp.autocast(loss), lambda: lambda p, x: loss(p, x, hand=True), params, x),
        "linen encoder": (lambda: fmp.autocast(enc_loss), lambda: enc_hand, enc_params, xe),
    }
    out = {}
    with jax.numpy_dtype_promotion("standard"):
        for name, (make_auto, make_hand, p, xs) in cases.items():
            times: dict[str, list[float]] = {"auto": [], "hand": []}
            for _ in range(rounds):
                for kind, make in (("auto", make_auto), ("hand", make_hand)):
                    times[kind].append(compile_once(make(), p, xs, compile=False)[0])
            out[name] = min(times["auto"]) / min(times["hand"])
            out[name + " (auto ms)"] = 1e3 * min(times["auto"])
            out[name + " (hand ms)"] = 1e3 * min(times["hand"])
    return out


def _warm_up() -> None:
    """JAX's own first-use costs (backend start, lowering machinery), paid by a hand-cast trace at other
    shapes (D=64, one block) before any timed first trace."""
    small = init_params(jax.random.key(0), d=64, layers=1)
    compile_once(lambda p, x: loss(p, x, hand=True), small, jnp.ones((2, 16, 64)), compile=False)


def _timed_first(kind: str, params: dict, x: jax.Array) -> tuple[float, float]:
    """Wall and CPU seconds of one trace+lower of ``jit(value_and_grad(loss))`` (``auto``/``hand``)."""
    fn = fmp.autocast(loss) if kind == "auto" else (lambda p, x: loss(p, x, hand=True))
    gc.collect()  # the trace starts from an empty young generation: which collections it triggers is its own
    wall, cpu = time.perf_counter(), time.process_time()
    compile_once(fn, params, x, compile=False)
    return time.perf_counter() - wall, time.process_time() - cpu


def first_trace(kind: str) -> tuple[float, float]:
    """Wall and CPU seconds of the first trace+lower of ``jit(value_and_grad(loss))`` in this process
    (``auto``/``hand``), after ``_warm_up``, in both processes alike: what remains is the variant's cold cost.
    """
    with jax.numpy_dtype_promotion("standard"):
        _warm_up()
        return _timed_first(kind, init_params(jax.random.key(0)), jax.random.normal(jax.random.key(1), (8, 128, 256)))


def first_pair(order: str) -> list[float]:
    """The first trace+lower of both variants in one fresh process, at two sequence lengths so that neither
    reuses a trace of the other (128 for the first in ``order``, 120 for the second): wall and CPU seconds,
    autocast's then hand-cast's. One process's ratio is free of the speed this machine gives a whole
    process (it varies by a third from one process to the next here); alternating the order evens out what
    the first variant's run leaves warm for the second."""
    with jax.numpy_dtype_promotion("standard"):
        _warm_up()
        params = init_params(jax.random.key(0))
        out = {
            kind: _timed_first(kind, params, jax.random.normal(jax.random.key(1), (8, seq, 256)))
            for kind, seq in zip(order.split(","), (128, 120), strict=True)
        }
        return [*out["auto"], *out["hand"]]


def cold_pairs(runs: int) -> dict[str, float]:
    """Autocast / hand-cast first trace, both in each fresh process (``first_pair``), the order alternating:
    the median of each order's per-process ratios and their geometric mean, in wall and CPU time."""
    ratios: dict[str, dict[str, list[float]]] = {o: {"wall": [], "cpu": []} for o in ("auto,hand", "hand,auto")}
    for k in range(runs):
        order = ("auto,hand", "hand,auto")[k % 2]
        cmd = [sys.executable, __file__, "--first-pair", order]
        aw, ac, hw, hc = map(float, subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()[-4:])
        ratios[order]["wall"].append(aw / hw)
        ratios[order]["cpu"].append(ac / hc)
    out = {}
    for m in ("wall", "cpu"):
        meds = [statistics.median(ratios[o][m]) for o in ratios]
        out[m] = math.sqrt(meds[0] * meds[1])
        out[m + " (autocast first)"], out[m + " (hand-cast first)"] = meds
    return out


def cold_times(runs: int) -> dict[str, dict[str, float]]:
    """Median first trace (wall and CPU s) of autocast and of hand-cast, one fresh process per run,
    the two interleaved. On a shared machine wall time also counts the time other processes held the
    cores; the process's CPU time does not."""
    return fresh_medians(__file__, ("auto", "hand"), runs)


def fresh_medians(script: str, names: tuple[str, ...], runs: int) -> dict[str, dict[str, float]]:
    """Median wall and CPU seconds that ``python script --first-trace NAME`` prints (its last two words),
    one fresh process per run and name, the names interleaved."""
    times: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in names}
    for _ in range(runs):
        for kind, got in times.items():
            cmd = [sys.executable, script, "--first-trace", kind]
            wall, cpu = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()[-2:]
            got["wall"].append(float(wall))
            got["cpu"].append(float(cpu))
    return {k: {m: statistics.median(v) for m, v in got.items()} for k, got in times.items()}


def count_converts(hlo_text: str) -> int:
    return sum(1 for line in hlo_text.splitlines() if " convert(" in line)


def residual_bytes(fn: Callable, params: dict, x: jax.Array) -> int:
    """Bytes of the values ``jax.vjp`` keeps for the backward pass (traced, not run)."""
    res = jax.eval_shape(lambda p, x: jax.vjp(fn, p, x)[1], params, x)
    return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(res))


def compile_once(fn: Callable, params: dict, x: jax.Array, compile: bool = True) -> tuple[float, float, Any]:
    """Traces+lowers and compiles ``value_and_grad(fn)`` from scratch; returns (trace_s, compile_s, compiled)."""
    step = jax.value_and_grad(fn)  # a new function object: no tracing cache hit
    t0 = time.perf_counter()
    lowered = jax.jit(step).lower(params, x)
    t1 = time.perf_counter()
    if not compile:
        return t1 - t0, 0.0, None
    compiled = lowered.compile()
    return t1 - t0, time.perf_counter() - t1, compiled


def run_all(fns: dict[str, Callable], params: dict, x: jax.Array, rounds: int, repeats: int) -> dict:
    """Interleaves the variants round by round (a shared machine drifts); min trace/compile, median step."""
    rows: dict[str, dict] = {name: {"trace": [], "compile": [], "step": []} for name in fns}
    compiled: dict[str, Any] = {}
    for _ in range(rounds):
        for name, fn in fns.items():
            tr, co, compiled[name] = compile_once(fn, params, x)
            rows[name]["trace"].append(tr)
            rows[name]["compile"].append(co)
    for name in fns:
        jax.block_until_ready(compiled[name](params, x))
    for _ in range(repeats):
        for name in fns:
            s = time.perf_counter()
            jax.block_until_ready(compiled[name](params, x))
            rows[name]["step"].append(time.perf_counter() - s)
    out = {}
    for name, fn in fns.items():
        mem = compiled[name].memory_analysis()
        out[name] = {
            "step_ms": 1e3 * statistics.median(rows[name]["step"]),
            "temp_MB": mem.temp_size_in_bytes / 1e6,
            "residual_MB": residual_bytes(fn, params, x) / 1e6,
            "converts": count_converts(compiled[name].as_text()),
            "trace_lower_s": min(rows[name]["trace"]),
            "compile_s": min(rows[name]["compile"]),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3, help="trace+compile rounds per variant (min is reported)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--trace-only", action="store_true", help="only the trace+lower ratios (transformer, linen)")
    ap.add_argument("--cold", type=int, default=5, help="fresh processes per variant for the first trace")
    ap.add_argument("--first-trace", choices=("auto", "hand"), help=argparse.SUPPRESS)  # one cold process
    ap.add_argument("--first-pair", choices=("auto,hand", "hand,auto"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.first_trace:
        print("{:.6f} {:.6f}".format(*first_trace(args.first_trace)))
        return
    if args.first_pair:
        print(" ".join(f"{t:.6f}" for t in first_pair(args.first_pair)))
        return
    if args.trace_only:
        print(f"jax {jax.__version__}, trace+lower of jit(value_and_grad(loss)), min of {args.rounds} rounds")
        for name, val in trace_ratios(args.rounds).items():
            print(f"{name}: {val:.3f}")
        cold = cold_times(args.cold)
        for m in ("wall", "cpu"):
            auto, hand = cold["auto"][m], cold["hand"][m]
            print(
                f"transformer, first trace in a fresh process, {m} time (median of {args.cold}, interleaved): "
                f"{auto / hand:.3f} ({1e3 * auto:.1f} / {1e3 * hand:.1f} ms)"
            )
        pairs = cold_pairs(2 * args.cold)
        for m in ("wall", "cpu"):
            print(
                f"transformer, first traces of both in one fresh process, {m} time ({2 * args.cold} processes, "
                f"order alternating): {pairs[m]:.3f} (median ratio {pairs[m + ' (autocast first)']:.3f} "
                f"autocast first, {pairs[m + ' (hand-cast first)']:.3f} hand-cast first)"
            )
        return
    params = init_params(jax.random.key(0), args.dim)
    x = jax.random.normal(jax.random.key(1), (args.batch, args.seq, args.dim))
    rows = run_all(variants(), params, x, args.rounds, args.repeats)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, B={args.batch} T={args.seq} D={args.dim}")
    cols = list(next(iter(rows.values())))
    print("| variant | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, r in rows.items():
        print(f"| {name} | " + " | ".join(f"{r[c]:.3g}" for c in cols) + " |")
    f32 = rows["float32"]
    print()
    print(
        "residuals vs float32: "
        + ", ".join(f"{n} {r['residual_MB'] / f32['residual_MB']:.2f}x" for n, r in rows.items())
    )
    # each autocast variant against the hand-cast program it should equal
    for auto_name, hand_name in [
        ("fmp.autocast bf16", "hand-cast bf16"),
        ("fmp.autocast bf16, integer_pow float32", "hand-cast bf16, float32 gelu"),
    ]:
        auto, hand = rows[auto_name], rows[hand_name]
        total_hand = hand["trace_lower_s"] + hand["compile_s"]
        total_auto = auto["trace_lower_s"] + auto["compile_s"]
        print(
            f"{auto_name} / {hand_name}: runtime {auto['step_ms'] / hand['step_ms']:.3f}, "
            f"trace+compile {total_auto / total_hand:.3f}"
        )


if __name__ == "__main__":
    main()
