"""The README's two set-up commands are the contract; .ci/run must run the test one."""

from __future__ import annotations

import re

from tests.helpers import ROOT

README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()


def _bash_blocks() -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", README, re.S)]


def test_readme_has_main_and_test_commands():
    blocks = _bash_blocks()
    assert any("examples/main.py" in b for b in blocks), "README lacks the main-job command"
    test_cmds = [b for b in blocks if "pytest" in b]
    assert len(test_cmds) == 1, "README must have exactly one test command"
    # torch's CPU build is installed before anything that could pull the CUDA wheels
    cmd = test_cmds[0]
    assert cmd.index("torch==2.13.0") < cmd.index('-e ".[all,dev]"')


def test_ci_runs_the_readme_test_command():
    cmd = next(b for b in _bash_blocks() if "pytest" in b)
    install, _, run = cmd.rpartition(" && ")
    assert install in CI, "the install part of the README test command is not in .ci/run"
    assert run in CI, "the test runner of the README test command is not in .ci/run"
    assert "ruff check" in CI


# The prelude each README snippet runs after (documented under the snippets in the README).
_JAX_PRELUDE = """
import jax, jax.numpy as jnp
params = {"w": jnp.zeros((8, 1), jnp.float32)}
x = 0.1 * jax.random.normal(jax.random.key(0), (32, 8), jnp.float32)
y = x @ jnp.arange(8.0, dtype=jnp.float32).reshape(8, 1) / 8
"""
_TORCH_PRELUDE = """
import torch
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loss_fn = torch.nn.functional.mse_loss
x, y = torch.randn(32, 8), torch.randn(32, 1)
"""


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, re.S)


def test_readme_python_snippets_run():
    import jax
    import numpy as np

    blocks = _python_blocks()
    assert len(blocks) == 3, f"expected the three usage snippets, found {len(blocks)}"
    ns: dict = {}
    # the snippets are what users write, under JAX's default (standard) promotion; optax.adamw is not
    # clean under the suite's strict promotion
    with jax.numpy_dtype_promotion("standard"):
        exec(_JAX_PRELUDE, ns)  # noqa: S102
        exec(blocks[0], ns)  # noqa: S102
        assert ns["params"]["w"].dtype == np.float32
        assert float(ns["loss"]) > 0 and bool(jnp_all_finite(ns["params"]))
        assert float(ns["scaler"].loss_scale) == 2.0**16, "the first step overflowed (skipped)"
        assert np.any(np.asarray(ns["params"]["w"]) != 0), "the step did not move params"
        w_before = np.asarray(ns["params"]["w"])
        exec(blocks[1], ns)  # noqa: S102
        assert not np.array_equal(np.asarray(ns["params"]["w"]), w_before), "the optax step did not move params"
        import fmp.optax

        assert int(fmp.optax.current_scaler(ns["opt_state"]).growth_tracker) == 1
    exec(_TORCH_PRELUDE, ns)  # noqa: S102
    w0 = ns["model"].weight.detach().clone()
    exec(blocks[2], ns)  # noqa: S102
    assert not bool((ns["model"].weight.detach() == w0).all()), "the torch step did not update the model"
    assert ns["scaler"].get_scale() == 2.0**16


def jnp_all_finite(tree) -> bool:
    import fmp

    return bool(fmp.all_finite(tree))
