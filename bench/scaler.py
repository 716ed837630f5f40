"""Times the post-gradient step of loss scaling: fmp against its peers, in one process.

The step: take the *scaled* gradients, check them for inf/NaN, unscale, apply SGD only if finite,
update the scale. Trees are shaped like GPT-2-small parameters (fewer layers / a smaller vocabulary
for ~25M and ~100M elements). Columns: float32 grads with float32 params, and bfloat16 grads with
float32 params. Every time is reported in units of one read+write pass over the same gradients
(``x * c`` jitted with donation): the bandwidth unit. The byte floor of the step is 1.5 units for
float32 grads (read grads, read params, write params); a separate finite check reads the grads once
more (2.0 units).

Peers: jmp (its DynamicLossScale / all_finite / select_tree), flax's DynamicScale logic (the lines
of ``flax.training.dynamic_scale.DynamicScale.value_and_grad`` after the gradient, plus the
``jnp.where`` selection its ImageNet example does), ``optax.apply_if_finite(optax.sgd)`` (after a
division by the scale, no scale update: optax has none), a hand-written JAX step, and
``torch.amp.GradScaler('cpu')`` + ``torch.optim.SGD`` (float32 only: torch grads have the param dtype).

Run: ``python bench/scaler.py`` (``--sizes 25`` for the small tree only, ``--blocks N``, ``--budget-s S``).
Each method is timed against the unit in alternating blocks of 6 calls each (the first call of a block
dropped: after a torch call, torch's OpenMP workers keep spinning for a while and slow the next JAX call
by ~25% on 2 cores); the cell is the median over the block pairs of median(method) / median(unit) (the
unit row shows the median unit).
The scale is 1 + 2**-10 for everyone: not 1, so torch's kernel really multiplies, and close to 1,
so torch's in-place unscale cannot drift its gradients into denormals while it is being timed (torch's
scaler never grows it: ``growth_interval=10**9``).
"""

from __future__ import annotations

import argparse
import functools
import platform
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's fmp, not an installed one
import fmp  # noqa: E402
import fmp.optax  # noqa: E402

LR = 1e-3
SCALE = 1.0 + 2.0**-10


def gpt2_like_shapes(n_layer: int, vocab: int, d: int = 768, ctx: int = 1024) -> dict[str, tuple[int, ...]]:
    shapes = {"wte": (vocab, d), "wpe": (ctx, d), "ln_f.g": (d,), "ln_f.b": (d,)}
    for i in range(n_layer):
        p = f"h{i}."
        shapes |= {
            p + "ln_1.g": (d,),
            p + "ln_1.b": (d,),
            p + "attn.c_attn.w": (d, 3 * d),
            p + "attn.c_attn.b": (3 * d,),
            p + "attn.c_proj.w": (d, d),
            p + "attn.c_proj.b": (d,),
            p + "ln_2.g": (d,),
            p + "ln_2.b": (d,),
            p + "mlp.c_fc.w": (d, 4 * d),
            p + "mlp.c_fc.b": (4 * d,),
            p + "mlp.c_proj.w": (4 * d, d),
            p + "mlp.c_proj.b": (d,),
        }
    return shapes


SIZES = {25: gpt2_like_shapes(3, 5000), 100: gpt2_like_shapes(12, 20000)}


def make_tree(shapes, dtype, seed):
    key = jax.random.key(seed)
    out = {}
    for i, (name, shape) in enumerate(shapes.items()):
        out[name] = jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32).astype(dtype)
    return out


def paired_ratios(unit, fn, blocks, budget_s, unit_times=None, block=6, fn_times=None):
    """Per-block ratios median time(fn) / median time(unit) over alternating blocks of ``block`` calls of
    each (which one goes first alternates too; the first call of a block is dropped: it can be slowed by
    the other side's threads winding down, e.g. torch's OpenMP workers spinning after a torch call), for
    ``blocks`` pairs of blocks or until ``budget_s`` seconds have passed (at least 10). Unit and method
    times are appended to ``unit_times`` and ``fn_times`` when given."""
    unit()
    fn()
    out = []
    start = time.perf_counter()
    for i in range(blocks):
        t: dict[str, list[float]] = {"u": [], "f": []}
        for which, f in (("u", unit), ("f", fn)) if i % 2 == 0 else (("f", fn), ("u", unit)):
            for j in range(block):
                t0 = time.perf_counter()
                f()
                if j:
                    t[which].append(time.perf_counter() - t0)
        out.append(float(np.median(t["f"]) / np.median(t["u"])))
        if unit_times is not None:
            unit_times.extend(t["u"])
        if fn_times is not None:
            fn_times.extend(t["f"])
        if i >= 9 and time.perf_counter() - start > budget_s:
            break
    return out


class Runner:
    """Keeps a method's state between calls and donates it, like a training loop."""

    def __init__(self, step, params, state, grads):
        self.step, self.params, self.state, self.grads = step, params, state, grads

    def __call__(self):
        self.params, self.state = self.step(self.params, self.state, self.grads)
        jax.block_until_ready((self.params, self.state))


# --- the methods ----------------------------------------------------------------------------------------------------
def fmp_step(params, scaler, grads):
    finite = fmp.all_finite(grads)
    grads = scaler.unscale(grads)
    new = jax.tree.map(lambda p, g: p - LR * g.astype(p.dtype), params, grads)
    return fmp.select_tree(finite, new, params), scaler.update(finite)


def fmp_optax_step(opt):
    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def jmp_step(params, state, grads):
    import jmp

    # jmp's pytree cannot be rebuilt from .lower()'s placeholders, so its two arrays are carried as a
    # tuple and the DynamicLossScale is built inside the step (the same ops: compiled code is identical)
    ls = jmp.DynamicLossScale(*state)
    grads = ls.unscale(grads)
    finite = jmp.all_finite(grads)
    ls = ls.adjust(finite)
    new = jax.tree.map(lambda p, g: p - LR * g.astype(p.dtype), params, grads)
    return jmp.select_tree(finite, new, params), (ls.loss_scale, ls.counter)


def flax_step(params, ds, grads):
    # flax.training.dynamic_scale.DynamicScale.value_and_grad, from the gradient on (flax 0.12)
    scale, fin_steps = ds
    grads = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32) / scale, grads)
    finite = jnp.array(True)
    for g in jax.tree.leaves(grads):
        finite &= jnp.all(jax.lax.is_finite(g))
    grow = fin_steps == 2000
    fin_scale = jnp.where(grow & finite, jnp.minimum(scale * 2.0, jnp.finfo(jnp.float32).max), scale)
    inf_scale = jnp.maximum(scale * 0.5, jnp.finfo(jnp.float32).tiny)
    new_scale = jnp.where(finite, fin_scale, inf_scale)
    new_fin_steps = jnp.where(grow | (~finite), 0, fin_steps + 1)
    # the ImageNet example: apply the gradients, then keep the old params where not finite
    new = jax.tree.map(lambda p, g: p - LR * g, params, grads)
    new = jax.tree.map(functools.partial(jnp.where, finite), new, params)
    return new, (new_scale, new_fin_steps)


def apply_if_finite_step(opt):
    def step(params, state, grads):
        grads = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32) / SCALE, grads)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def handwritten_step(params, scale, grads):
    grads = jax.tree.map(lambda g: g.astype(jnp.float32) / scale, grads)
    finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    new = jax.tree.map(lambda p, g: jnp.where(finite, p - LR * g, p), params, grads)
    return new, scale


def unit_step(grads, c):
    return jax.tree.map(lambda g: g * c.astype(g.dtype), grads)


def torch_runner(shapes, grads_np, foreach_or_fused):
    import torch

    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes.values()]
    for p, g in zip(params, grads_np, strict=True):
        p.grad = torch.from_numpy(g).clone()
    kw = {"fused": True} if foreach_or_fused == "fused" else {"foreach": True}
    opt = torch.optim.SGD(params, lr=LR, **kw)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=10**9)
    scaler.scale(torch.ones(()))  # creates the scale tensor (torch does it on the first scale())

    def run():
        scaler.step(opt)
        scaler.update()

    return run


# --- driver ---------------------------------------------------------------------------------------------------------
def jit_runner(step, params, state, grads):
    return Runner(jax.jit(step, donate_argnums=(0, 1)), params, state, grads)


def compiled_traffic(step, params, state, grads):
    """Deterministic cost of the compiled step (donating params and state, like the timed runs).

    Returns ``(bytes_units, temp_bytes, kernels)``: the bytes the kernels of a finite step access
    (``taken_path_bytes``: XLA's ``cost_analysis`` would also count the untaken branch of a cond) divided
    by the bytes of one bandwidth unit (read + write of the gradient tree, ``2 * grad bytes``), so it
    reads on the same scale as the times (fmp's two passes are 2.0 for float32 grads, the floor 1.5);
    ``memory_analysis().temp_size_in_bytes``; and the number of kernels (fusions, copies and other
    non-trivial instructions) in the entry computation of the optimized HLO.
    """
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads).compile()
    unit_bytes = 2 * sum(x.nbytes for x in jax.tree.leaves(grads))
    return (
        taken_path_bytes(compiled) / unit_bytes,
        compiled.memory_analysis().temp_size_in_bytes,
        kernel_count(compiled),
    )


_TRIVIAL = ("parameter", "constant", "tuple", "get-tuple-element", "bitcast")
# `%name = SHAPE opcode(`: SHAPE is one array shape or a (possibly once-nested) tuple of them
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%\S+ = (?:\((?:[^()]|\([^()]*\))*\)|\S+) ([a-z][\w-]*)\(")


def kernel_count(compiled) -> int:
    """Instructions of the optimized HLO's entry computation that run a kernel (not parameters,
    constants, tuples or bitcasts)."""
    text = compiled.as_text()
    entry = text[text.index("\nENTRY ") :]
    entry = entry[: entry.index("\n}")]
    ops = [m.group(1) for m in map(_INSTR.match, entry.splitlines()[1:]) if m]
    return sum(op not in _TRIVIAL for op in ops)


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
_DTYPE_BYTES |= {"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_LINE = re.compile(r"^\s*(?:ROOT\s+)?(%\S+) = ((?:\((?:[^()]|\([^()]*\))*\)|\S+)) ([a-z][\w-]*)\((.*)$")


def _shape_bytes(shape: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _DTYPE_BYTES.get(dtype, 4)
    return total


def taken_path_bytes(compiled, branch: int = -1) -> int:
    """Bytes read and written by the kernels of the optimized HLO, counting for every ``conditional``
    only the kernels of one branch (``branch``: -1, the last, is the taken branch of a ``lax.cond`` on a
    True predicate, i.e. a finite step). XLA's ``cost_analysis`` counts both branches of a conditional,
    so it overstates a step that skips its work in a cond; without conditionals the two agree to a
    fraction of a percent. Each kernel counts its output plus every operand once (a scalar or a
    broadcast operand counts its own size), as the cost analysis does."""
    text = compiled.as_text()
    comps, name = {}, None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            name = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
            comps[name] = []
        elif name is not None and line.strip() and line.strip() != "}":
            comps[name].append(line)
    entry = next(n for n in comps if text.find("ENTRY " + n) >= 0)

    def cost(comp: str) -> int:
        shapes, total = {}, 0
        for line in comps[comp]:
            m = _LINE.match(line)
            if not m:
                continue
            var, shape, op, rest = m.groups()
            shapes[var] = shape
            if op == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", rest).group(1).split(", ")
                total += cost(branches[branch].strip())
            elif op not in _TRIVIAL:
                operands = re.findall(r"%[\w.\-]+", rest.split(")", 1)[0])
                total += _shape_bytes(shape) + sum(_shape_bytes(shapes.get(o, "")) for o in operands)
        return total

    return cost(entry)


def column(size, grad_dtype, blocks, budget_s, with_torch):
    """Times every method of one column against the unit, block by block (``paired_ratios``): blocks
    of unit calls and of method calls alternate for up to ``blocks`` pairs or ``budget_s`` seconds per
    method, and the cell is the median of the per-block ratios, so a slow spell of the machine hits a
    method and its unit together instead of skewing one side."""
    shapes = SIZES[size]
    n = sum(int(np.prod(s)) for s in shapes.values())
    grads = make_tree(shapes, grad_dtype, 1)

    c = jnp.float32(1.0)
    unit_fn = jax.jit(unit_step, donate_argnums=0)
    box = {"g": jax.tree.map(jnp.copy, grads)}

    def unit():
        box["g"] = unit_fn(box["g"], c)
        jax.block_until_ready(box["g"])

    def fresh_params():
        return make_tree(shapes, jnp.float32, 0)

    sgd = optax.sgd(LR)
    opt_fmp = fmp.optax.loss_scaled(sgd, fmp.GradScaler(init_scale=SCALE))
    opt_aif = optax.apply_if_finite(sgd, max_consecutive_errors=10**9)
    methods = {
        "fmp (GradScaler + select_tree)": (fmp_step, lambda p: fmp.GradScaler(init_scale=SCALE)),
        "fmp.optax.loss_scaled(sgd)": (fmp_optax_step(opt_fmp), opt_fmp.init),
        "jmp DynamicLossScale": (jmp_step, lambda p: (jnp.float32(SCALE), jnp.int32(0))),
        "flax DynamicScale logic": (flax_step, lambda p: (jnp.float32(SCALE), jnp.int32(0))),
        "optax.apply_if_finite(sgd)": (apply_if_finite_step(opt_aif), opt_aif.init),
        "hand-written JAX": (handwritten_step, lambda p: jnp.float32(SCALE)),
    }
    temps, runners = {}, {}
    for name, (step, init) in methods.items():
        params = fresh_params()
        state = init(params)
        temps[name] = compiled_traffic(step, params, state, grads)
        runners[name] = jit_runner(step, params, state, grads)
        del params, state
    if with_torch and grad_dtype == jnp.float32:
        grads_np = [np.array(g) for g in grads.values()]
        for kind in ("foreach", "fused"):
            runners[f"torch GradScaler + SGD({kind})"] = torch_runner(shapes, grads_np, kind)
        del grads_np
    ratios: dict[str, list[float]] = {}
    best: dict[str, float] = {}
    units: list[float] = []
    for name, runner in runners.items():
        mine: list[float] = []
        its_units: list[float] = []
        ratios[name] = paired_ratios(unit, runner, blocks, budget_s, its_units, fn_times=mine)
        best[name] = min(mine) / min(its_units)  # both over the same blocks
        units += its_units
    # (median of the per-block ratios, best call of the method / best call of the unit in its blocks)
    rows = {name: (float(np.median(r)), best[name]) for name, r in ratios.items()}
    return n, float(np.median(units)), rows, temps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[25, 100])
    ap.add_argument("--blocks", type=int, default=40, help="pairs of unit/method blocks per method (at most)")
    ap.add_argument("--budget-s", type=float, default=8.0, help="seconds of blocks per method (at least 10 pairs)")
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args()
    try:
        import torch

        torch_v = torch.__version__
    except ImportError:
        torch_v, args.no_torch = "absent", True
    import flax
    import jmp  # noqa: F401

    print(
        f"# machine: {platform.processor() or platform.machine()}, {jax.device_count()} JAX CPU device(s); "
        f"python {platform.python_version()}, jax {jax.__version__}, optax {optax.__version__}, "
        f"flax {flax.__version__}, torch {torch_v}"
    )
    cols, units, table, temps_all, sizes_n, itemsize = [], {}, {}, {}, {}, {}
    for size in args.sizes:
        for dt in (jnp.float32, jnp.bfloat16):
            name = f"{size}M {jnp.dtype(dt).name} grads"
            n, unit_t, rows, temps = column(size, dt, args.blocks, args.budget_s, not args.no_torch)
            cols.append(name)
            units[name], sizes_n[name], temps_all[name] = unit_t, n, temps
            itemsize[name] = jnp.dtype(dt).itemsize
            for k, v in rows.items():
                table.setdefault(k, {})[name] = v
    # grads read once, params read and written once, over one unit (grads read and written)
    floor = {c: (itemsize[c] + 8) / (2 * itemsize[c]) for c in cols}
    print(
        "\nTime of the post-gradient step in bandwidth units (lower is better): the median of the per-block "
        "ratios, in square brackets the method's best call over the unit's best call in the same blocks; in round brackets, the "
        "bytes the compiled step accesses on a finite step in the same units (deterministic)\n"
    )
    print("| method | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    print("| unit (ms) | " + " | ".join(f"{units[c] * 1e3:.1f}" for c in cols) + " |")
    print("| elements | " + " | ".join(f"{sizes_n[c] / 1e6:.1f}M" for c in cols) + " |")
    print("| byte floor (read grads + params, write params) | " + " | ".join(f"{floor[c]:.2f}" for c in cols) + " |")
    for k, row in table.items():
        cells = []
        for c in cols:
            b = temps_all[c].get(k, (None,))[0]
            t = "n/a" if c not in row else f"{row[c][0]:.2f} [{row[c][1]:.2f}]"
            cells.append(t if b is None else f"{t} ({b:.2f})")
        print(f"| {k} | " + " | ".join(cells) + " |")
    print(
        "\nDeterministic: bytes accessed by the compiled step on a finite step in bandwidth units, "
        "temporary buffers (memory_analysis) in MiB, kernels in the optimized HLO\n"
    )
    print("| method | " + " | ".join(f"{c}: bytes / temp / kernels" for c in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for k in temps_all[cols[0]]:
        cells = []
        for c in cols:
            b, t, n = temps_all[c][k]
            cells.append(f"{b:.2f} / {t / 2**20:.2f} / {n}")
        print(f"| {k} | " + " | ".join(cells) + " |")
    print("\n(float32 tree: " + ", ".join(f"{c.split()[0]} {sizes_n[c] * 4 / 2**20:.0f} MiB" for c in cols[::2]) + ")")


if __name__ == "__main__":
    main()
