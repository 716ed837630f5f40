"""A tiny T5-style encoder in flax and in torch: gated-GELU feed-forward, RMS norms, and the ``wo`` kernels
of the last two blocks scaled so that float16 overflows there (the model family's known float16 failure)."""

from __future__ import annotations

import numpy as np

VOCAB, DIM, FF, HEADS, BLOCKS, TOKENS = 32, 16, 32, 2, 3, 8
WO_SCALE = 6e4  # the last two blocks' ``wo`` outputs reach ~1e5: past float16's 65504


def weights(seed: int = 0) -> dict[str, np.ndarray]:
    """The model's float32 weights by name (shared by both frameworks, ``x @ w`` layout)."""
    rng = np.random.default_rng(seed)

    def dense(n_in: int, n_out: int) -> np.ndarray:
        return (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)

    out = {"embed": rng.standard_normal((VOCAB, DIM)).astype(np.float32)}
    for b in range(BLOCKS):
        for name, shape in (("q", (DIM, DIM)), ("k", (DIM, DIM)), ("v", (DIM, DIM)), ("o", (DIM, DIM))):
            out[f"{b}.{name}"] = dense(*shape)
        out[f"{b}.wi_0"], out[f"{b}.wi_1"] = dense(DIM, FF), dense(DIM, FF)
        out[f"{b}.wo"] = dense(FF, DIM) * (WO_SCALE if b >= BLOCKS - 2 else 1.0)
    return out


def tokens() -> np.ndarray:
    return (np.arange(2 * TOKENS, dtype=np.int32).reshape(2, TOKENS) * 7) % VOCAB


def flax_model():
    """``(apply, params, ids)``: a flax linen T5-style encoder returning its last hidden states."""
    import flax.linen as nn
    import jax.numpy as jnp

    class RMSNorm(nn.Module):
        @nn.compact
        def __call__(self, x):
            var = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
            return x * jnp.asarray(1.0, x.dtype) / jnp.sqrt(var + 1e-6).astype(x.dtype)

    class Attention(nn.Module):
        @nn.compact
        def __call__(self, x):
            b, t, _ = x.shape
            q, k, v = (nn.Dense(DIM, use_bias=False, name=n)(x).reshape(b, t, HEADS, -1) for n in "qkv")
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
            p = jax_softmax(s)
            o = jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, t, DIM)
            return nn.Dense(DIM, use_bias=False, name="o")(o)

    class FeedForward(nn.Module):
        @nn.compact
        def __call__(self, x):
            gate = nn.gelu(nn.Dense(FF, use_bias=False, name="wi_0")(x), approximate=True)
            h = gate * nn.Dense(FF, use_bias=False, name="wi_1")(x)
            return nn.Dense(DIM, use_bias=False, name="wo")(h)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = x + Attention(name="attn")(RMSNorm(name="norm_1")(x))
            return x + FeedForward(name="ff")(RMSNorm(name="norm_2")(x))

    class Encoder(nn.Module):
        @nn.compact
        def __call__(self, ids):
            x = nn.Embed(VOCAB, DIM, name="embed")(ids)
            for b in range(BLOCKS):
                x = Block(name=f"block_{b}")(x)
            return RMSNorm(name="norm_f")(x)

    def jax_softmax(s):
        import jax

        return jax.nn.softmax(s, axis=-1)

    w = {k: jnp.asarray(v) for k, v in weights().items()}
    params = {"embed": {"embedding": w["embed"]}}
    for b in range(BLOCKS):
        attn = {n: {"kernel": w[f"{b}.{n}"]} for n in "qkvo"}
        ff = {n: {"kernel": w[f"{b}.{n}"]} for n in ("wi_0", "wi_1", "wo")}
        params[f"block_{b}"] = {"attn": attn, "ff": ff}
    model = Encoder()
    return model.apply, {"params": params}, jnp.asarray(tokens())


def torch_model():
    """``(module, ids)``: the same encoder as a torch module (eval mode), returning its last hidden states."""
    import torch

    class RMSNorm(torch.nn.Module):
        def forward(self, x):
            var = x.float().pow(2).mean(-1, keepdim=True)
            return x * torch.rsqrt(var + 1e-6).to(x.dtype)

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (torch.nn.Linear(DIM, DIM, bias=False) for _ in range(4))

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = (f(x).view(b, t, HEADS, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
            p = (q @ k.transpose(-1, -2)).softmax(-1)
            return self.o((p @ v).transpose(1, 2).reshape(b, t, DIM))

    class FeedForward(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wi_0 = torch.nn.Linear(DIM, FF, bias=False)
            self.wi_1 = torch.nn.Linear(DIM, FF, bias=False)
            self.wo = torch.nn.Linear(FF, DIM, bias=False)

        def forward(self, x):
            gate = torch.nn.functional.gelu(self.wi_0(x), approximate="tanh")
            h = gate * self.wi_1(x)
            return self.wo(h)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm_1, self.attn, self.norm_2, self.ff = RMSNorm(), Attention(), RMSNorm(), FeedForward()

        def forward(self, x):
            x = x + self.attn(self.norm_1(x))
            return x + self.ff(self.norm_2(x))

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, DIM)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
            self.norm_f = RMSNorm()

        def forward(self, ids):
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x)
            return self.norm_f(x)

    model = Encoder().eval()
    w = weights()
    with torch.no_grad():
        model.embed.weight.copy_(torch.from_numpy(w["embed"]))
        for b, block in enumerate(model.blocks):
            for n in "qkvo":
                getattr(block.attn, n).weight.copy_(torch.from_numpy(w[f"{b}.{n}"].T.copy()))
            for n in ("wi_0", "wi_1", "wo"):
                getattr(block.ff, n).weight.copy_(torch.from_numpy(w[f"{b}.{n}"].T.copy()))
    return model, torch.from_numpy(tokens()).long()


def low_share_of_rows(report) -> float:
    """The low-precision FLOP share computed from the rows: what ran in float16 or bfloat16."""
    total = sum(r.flops for r in report.records)
    return sum(r.flops for r in report.records if set(r.out_after) & {"bfloat16", "float16"}) / total
