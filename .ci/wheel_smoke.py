"""Smoke test of the built wheel, run by .ci/run in a fresh venv that holds only the wheel and its
dependencies (jax, jaxlib, numpy from PyPI), from a folder outside the repository."""

import sys
from importlib import metadata
from pathlib import Path

import jax
import jax.numpy as jnp

import fmp

where = Path(fmp.__file__).resolve()
assert "site-packages" in where.parts, f"fmp imported from {where}, not from the installed wheel"
assert metadata.version("jax-fmp") == fmp.__version__, (metadata.version("jax-fmp"), fmp.__version__)
meta = metadata.metadata("jax-fmp")
assert meta["Name"] == "jax-fmp" and meta["License-Expression"] == "Apache-2.0", (meta["Name"], meta["License-Expression"])
licenses = [f for f in metadata.files("jax-fmp") if f.name == "LICENSE"]
assert licenses and "Apache License" in licenses[0].read_text(), "the LICENSE file is not in the wheel"
assert (where.parent / "py.typed").exists(), "py.typed is not in the wheel"
for sub in ("_core", "_autocast", "optax", "torch", "torch/fp16_utils", "torch/cuda"):
    assert (where.parent / sub / "__init__.py").exists(), f"fmp/{sub} is not in the wheel"

# a mixed_float16 train step with loss scaling, jitted, on a least-squares problem
key_w, key_x = jax.random.split(jax.random.key(0))
x = jax.random.normal(key_x, (64, 8))
y = x @ jnp.arange(8.0)


def loss_fn(w, x, y):
    return jnp.mean((x @ w - y) ** 2)


@jax.jit
def step(w, scaler):
    loss, g, finite, scaler = fmp.value_and_grad(fmp.autocast(loss_fn, "mixed_float16"), scaler)(w, x, y)
    return fmp.select_tree(finite, w - 0.05 * g, w), scaler, loss


w, scaler = jnp.zeros(8), fmp.GradScaler()
losses = []
for _ in range(200):
    w, scaler, loss = step(w, scaler)
    losses.append(float(loss))
assert losses[-1] < 1e-2 * losses[0], losses[::20]

# the optional dependencies are absent here: the error says how to install them
for module, dep in (("fmp.torch", "torch"), ("fmp.optax", "optax")):
    try:
        __import__(module)
    except ModuleNotFoundError as e:
        assert str(e).startswith(f"{module} needs {dep}, which is not installed: "), e
    else:
        raise AssertionError(f"{dep} is installed in the smoke venv: it should hold only the wheel's dependencies")
assert not {"torch", "optax", "flax"} & set(sys.modules)
print(f"wheel smoke OK: fmp {fmp.__version__} from {where.parent}, jax {jax.__version__}, "
      f"loss {losses[0]:.3g} -> {losses[-1]:.3g}")  # fmt: skip
