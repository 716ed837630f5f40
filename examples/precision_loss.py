"""Finding where precision is lost: ``fmp.explain(..., compare=True)`` on a flax linen transformer with rotary
embeddings, a planted mistake in the rule table, the fix the report suggests, and the plot.

docs/guides/precision-loss.md shows this file's sections and the report and figure it writes (tests check both):

    python examples/precision_loss.py [--out docs/assets]
"""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

# --8<-- [start:model]
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import fmp

DIM, HEADS, LENGTH, VOCAB = 64, 4, 256, 128


def rotary(length, head_dim):
    """cos and sin of the rotary angles (position x frequency)."""
    inv_freq = 1.0 / 10000.0 ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.outer(jnp.arange(length, dtype=jnp.float32), inv_freq)  # up to 255 radians
    return jnp.cos(angles), jnp.sin(angles)


def rotate(x, cos, sin):  # x: (length, heads, head_dim)
    x1, x2 = jnp.split(x, 2, axis=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attend(q, k, v, cos, sin):  # causal self-attention with rotary embeddings
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    scores = jnp.einsum("qhd,khd->hqk", q, k) / jnp.sqrt(float(q.shape[-1]))
    causal = jnp.tril(jnp.ones((q.shape[0], q.shape[0]), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    return jnp.einsum("hqk,khd->qhd", weights, v)


class Rotary(nn.Module):  # a module of its own: its ops get its scope, LM/Rotary_0
    head_dim: int

    def __call__(self, length):
        return rotary(length, self.head_dim)


class Attention(nn.Module):
    @nn.compact
    def __call__(self, x, cos, sin):
        heads = (HEADS, DIM // HEADS)
        q, k, v = (nn.DenseGeneral(heads, name=n)(x) for n in ("query", "key", "value"))
        return nn.DenseGeneral(DIM, axis=(-2, -1), name="out")(attend(q, k, v, cos, sin))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, cos, sin):
        x = x + Attention()(nn.RMSNorm()(x), cos, sin)
        return x + nn.Dense(DIM)(nn.gelu(nn.Dense(4 * DIM)(nn.RMSNorm()(x))))


class LM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        cos, sin = Rotary(DIM // HEADS)(tokens.shape[0])
        x = nn.Embed(VOCAB, DIM)(tokens)
        for _ in range(2):
            x = Block()(x, cos, sin)
        return nn.Dense(VOCAB)(nn.RMSNorm()(x))


model = LM()
tokens = jax.random.randint(jax.random.key(1), (LENGTH,), 0, VOCAB)
params = model.init(jax.random.key(0), tokens)


def loss_fn(params, tokens):  # next-token cross-entropy
    logp = jax.nn.log_softmax(model.apply(params, tokens)[:-1])
    return -jnp.take_along_axis(logp, tokens[1:, None], axis=-1).mean()


# --8<-- [end:model]


# --8<-- [start:nnx_model]
class NnxRotary(nnx.Module):
    def __init__(self, head_dim):
        self.head_dim = head_dim

    def __call__(self, length):
        return rotary(length, self.head_dim)


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.norm1, self.norm2 = nnx.RMSNorm(DIM, rngs=rngs), nnx.RMSNorm(DIM, rngs=rngs)
        self.qkv = nnx.Linear(DIM, 3 * DIM, rngs=rngs)
        self.out = nnx.Linear(DIM, DIM, rngs=rngs)
        self.up = nnx.Linear(DIM, 4 * DIM, rngs=rngs)
        self.down = nnx.Linear(4 * DIM, DIM, rngs=rngs)

    def __call__(self, x, cos, sin):
        qkv = self.qkv(self.norm1(x)).reshape(x.shape[0], 3 * HEADS, -1)
        q, k, v = jnp.split(qkv, 3, axis=1)
        x = x + self.out(attend(q, k, v, cos, sin).reshape(x.shape))
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class NnxLM(nnx.Module):
    def __init__(self, rngs):
        self.rotary = NnxRotary(DIM // HEADS)
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.blocks = nnx.List([NnxBlock(rngs) for _ in range(2)])
        self.norm, self.head = nnx.RMSNorm(DIM, rngs=rngs), nnx.Linear(DIM, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        cos, sin = self.rotary(tokens.shape[0])
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


def nnx_loss_fn(model, tokens):  # the module is an argument: its submodules' paths are scopes
    logp = jax.nn.log_softmax(model(tokens)[:-1])
    return -jnp.take_along_axis(logp, tokens[1:, None], axis=-1).mean()


# --8<-- [end:nnx_model]


def head(report, ops: int = 10, width: int = 100) -> str:
    """The head of ``str(report)``: its first ``ops`` worst ops, before the full table; lines wrapped to ``width``."""
    worst = str(report).split("\n\nfmp precision report", 1)[0]
    blocks = ("\n" + worst).split("\n#")
    text = "\n#".join(blocks[: ops + 1]).lstrip("\n")
    return "\n".join(textwrap.fill(line, width, subsequent_indent=" " * 8) for line in text.splitlines())


def run(out: Path | None = None) -> dict:
    """Runs the page's steps; returns what the page claims (and writes the report heads and figure to ``out``)."""
    # --8<-- [start:explain]
    # the planted mistake: a rule table that moves sin and cos to bfloat16 (cheap elementwise ops...)
    rules = fmp.DEFAULT_RULES.derive(lower_precision=["sin", "cos"])
    report = fmp.explain(loss_fn, "mixed_bfloat16", rules=rules, compare=True)(params, tokens)
    print(report)  # the worst ops first: op, errors, scope, source line and the fix; then every op
    worst = report.worst(1)[0]
    # --8<-- [end:explain]
    # --8<-- [start:fix]
    assert worst.suggestion == 'overrides={"LM/Rotary_0": "float32"}'
    fix = {"LM/Rotary_0": "float32"}  # the suggestion, pasted
    with_fix = fmp.explain(loss_fn, "mixed_bfloat16", rules=rules, overrides=fix, compare=True)
    fixed = with_fix(params, tokens)
    print(fixed.worst(1)[0].suggestion)  # None: no op's own error is far above bfloat16's rounding
    exact, errors = loss_fn(params, tokens), {}
    for name, overrides in (("planted", None), ("fixed", fix)):
        step = fmp.autocast(loss_fn, "mixed_bfloat16", rules=rules, overrides=overrides)
        loss = jax.jit(step)(params, tokens)
        errors[name] = float(abs(loss - exact) / exact)
        print(f"{name}: loss {loss:.5f}, float32 {exact:.5f}, relative error {errors[name]:.1e}")
    fig = report.plot(k=8)  # errors along the program, and the worst ops
    # --8<-- [end:fix]
    # --8<-- [start:nnx]
    nnx_model = NnxLM(nnx.Rngs(0))
    nnx_explain = fmp.explain(nnx_loss_fn, "mixed_bfloat16", rules=rules, compare=True)
    nnx_report = nnx_explain(nnx_model, tokens)
    print([(r.op, r.scope, r.suggestion) for r in nnx_report.worst(2)])
    nnx_fix = {"rotary": "float32"}  # the suggestion, pasted
    with_fix = fmp.explain(nnx_loss_fn, "mixed_bfloat16", rules=rules, overrides=nnx_fix, compare=True)
    nnx_fixed = with_fix(nnx_model, tokens)
    # --8<-- [end:nnx]
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "precision_loss_planted.txt").write_text(head(report) + "\n")
        losses = "".join(f"{name}: loss relative error {e:.1e}\n" for name, e in errors.items())
        (out / "precision_loss_fixed.txt").write_text(f"{losses}\n{head(fixed, ops=3)}\n")
        (out / "precision_loss_nnx.txt").write_text(head(nnx_report, ops=2) + "\n")
        fig.savefig(out / "precision_loss.png", dpi=80)
    return {
        "report": report, "fixed": fixed, "fix": fix, "loss_errors": errors, "figure": fig,
        "nnx_report": nnx_report, "nnx_fixed": nnx_fixed, "nnx_fix": nnx_fix,
    }  # fmt: skip


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="write the report heads and the figure here")
    run(p.parse_args(argv).out)


if __name__ == "__main__":
    main()
