"""A small model with alike layers and three planted sensitive sites, as NumPy weights for JAX and torch.

``mlp0``..``mlp3``: alike residual layers. Beside them, on the inputs: ``attn``, a query projection with large
activations feeding a softmax (its logits reach tens), and ``router``, which picks one of ``E`` expert gains
per token by argmax from near ties, so rounding its logits flips the choice. ``head`` reads their sum with one
channel 10^6 times the rest (and its weight row for that channel 10^6 times smaller): one scale for the tensor
flushes the other channels to zero in float8.
"""

from __future__ import annotations

import numpy as np

D, T, E = 32, 16, 8
ALIKE = ("mlp0", "mlp1", "mlp2", "mlp3")
PLANTED = ("attn", "router", "head")
# a device on which float8 pays for any GEMM: only the measured errors decide
IDEAL = {"peak": {"float32": 67e12, "bfloat16": 989e12, "float8": 1979e12}, "bandwidth": 1e18, "size_rule": False}
GAINS = np.linspace(0.25, 4.0, E).astype(np.float32)
OUTLIER = np.ones(D, np.float32)
OUTLIER[0] = 1e6


def weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    p = {k: (rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32) for k in ALIKE}
    p["attn"] = (rng.standard_normal((D, D)) * 2.0).astype(np.float32)
    base = rng.standard_normal((D, 1)) / np.sqrt(D)
    p["router"] = (base + 0.01 * rng.standard_normal((D, E)) / np.sqrt(D)).astype(np.float32)
    head = (rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32)
    head[0] /= OUTLIER[0]
    p["head"] = head
    return p


def batch(seed: int) -> np.ndarray:
    return np.random.default_rng(1000 + seed).standard_normal((T, D)).astype(np.float32)


def jax_loss(p, x):
    import jax
    import jax.numpy as jnp

    h = x
    for k in ALIKE:
        with jax.named_scope(k):
            h = h + jnp.tanh(h @ p[k])
    with jax.named_scope("attn"):
        q = x @ p["attn"]
        a = jax.nn.softmax(q @ x.T / np.float32(np.sqrt(D)), axis=-1) @ x
    with jax.named_scope("router"):
        logits = x @ p["router"]
    gain = jnp.asarray(GAINS)[jnp.argmax(logits, axis=-1)]
    z = h + a * gain[:, None]
    with jax.named_scope("head"):
        y = (z * jnp.asarray(OUTLIER)) @ p["head"]
    return jnp.mean(y**2)


def torch_loss(p):
    """The same model as a torch module whose forward takes ``x`` and returns the loss; each site is a
    submodule holding its weight (``x @ w``, as in JAX)."""
    import torch

    class Matmul(torch.nn.Module):
        def __init__(self, w):
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor(w))

        def forward(self, x):
            return x @ self.w

    class Attn(Matmul):
        def forward(self, x):
            q = x @ self.w
            return torch.softmax(q @ x.T / float(np.sqrt(D)), dim=-1) @ x

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for k in ALIKE:
                setattr(self, k, Matmul(p[k]))
            self.attn, self.router, self.head = Attn(p["attn"]), Matmul(p["router"]), Matmul(p["head"])
            self.register_buffer("gains", torch.tensor(GAINS))
            self.register_buffer("outlier", torch.tensor(OUTLIER))

        def forward(self, x):
            h = x
            for k in ALIKE:
                h = h + torch.tanh(getattr(self, k)(h))
            a = self.attn(x)
            gain = self.gains[torch.argmax(self.router(x), dim=-1)]
            z = h + a * gain[:, None]
            y = self.head(z * self.outlier)
            return torch.mean(y**2)

    return Model()
