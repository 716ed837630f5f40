"""The README's two set-up commands are the contract; .ci/run must run the test one."""

from __future__ import annotations

import re

import pytest
from _helpers.common import ROOT

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


def test_readme_says_which_torch_build_the_test_command_installs():
    # the same command gets a CPU build on CI's machine (a local wheel) and the CUDA build from the public index
    assert "CPU build first" not in README
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in README
    assert "CUDA build" in README


def test_ci_runs_the_readme_test_command():
    cmd = next(b for b in _bash_blocks() if "pytest" in b)
    install, _, run = cmd.rpartition(" && ")
    assert install in CI, "the install part of the README test command is not in .ci/run"
    assert run in CI, "the test runner of the README test command is not in .ci/run"
    assert "ruff check" in CI


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, re.S)


def test_readme_links_getting_started():
    links = re.findall(r"\]\(([^)]+)\)", README)
    assert "docs/getting-started.md" in links, "README does not link the getting-started page"
    for link in links:
        if not link.startswith(("http://", "https://", "#")):
            assert (ROOT / link.split("#")[0]).exists(), f"README links {link}, which does not exist"


def _run_snippet(block: str) -> dict:
    """Runs a README snippet exactly as written, in a fresh namespace (nothing defined beforehand)."""
    ns: dict = {"__name__": "__main__"}
    exec(compile(block, "README.md", "exec"), ns)  # noqa: S102
    return ns


def test_readme_python_snippets_run_as_written(capsys):
    import jax
    import numpy as np

    import fmp

    blocks = _python_blocks()
    # the three usage snippets, then the debugger's (run by tests/docs/test_first_page.py, saved as model.py)
    assert len(blocks) == 4 and "fmp.explain(" in blocks[3], f"expected four snippets, found {len(blocks)}"
    # the snippets are what users write, under JAX's default (standard) promotion; optax.adamw is not
    # clean under the suite's strict promotion
    with jax.numpy_dtype_promotion("standard"):
        ns = _run_snippet(blocks[0])
        assert ns["params"]["w"].dtype == np.float32
        # the target is exactly linear, so float16 matmuls with loss scaling still fit it closely
        assert float(ns["loss"]) < 1e-3, float(ns["loss"])
        assert isinstance(ns["scaler"], fmp.GradScaler) and float(ns["scaler"].loss_scale) <= 2.0**16
        assert "loss scale" in capsys.readouterr().out

        ns = _run_snippet(blocks[1])
        start = float(ns["loss_fn"]({"w": np.zeros((8, 1), np.float32)}, ns["x"], ns["y"]))
        final = float(ns["loss_fn"](ns["params"], ns["x"], ns["y"]))
        assert final < 0.1 * start, (start, final)
        import fmp.optax

        state = ns["opt_state"]
        skipped = int(state.skipped_steps)
        assert skipped <= 2 and int(fmp.optax.current_scaler(state).growth_tracker) == 100 - skipped
        assert "loss" in capsys.readouterr().out


def test_readme_torch_snippet_matches_torch_amp_bit_for_bit():
    """Snippet 3 as written, and with torch.amp in place of fmp.torch: the same losses and weights."""
    pytest.importorskip("torch")
    import torch

    block = _python_blocks()[2]
    ours = _run_snippet(block)
    swapped = block.replace("import fmp.torch as amp", "import torch.amp as amp")
    assert swapped != block
    theirs = _run_snippet(swapped)
    assert ours["loss"].dtype == torch.float32 and ours["scaler"].get_scale() == theirs["scaler"].get_scale()
    assert torch.equal(ours["loss"], theirs["loss"])
    assert torch.equal(ours["model"].weight, theirs["model"].weight)
    assert ours["loss"].item() < float(torch.nn.functional.mse_loss(torch.zeros(32, 1), ours["y"]))


def test_getting_started_snippet_runs_as_written():
    """The first JAX step of docs/getting-started.md, where the README sends newcomers, runs as written."""
    import jax

    import fmp

    page = (ROOT / "docs" / "getting-started.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    assert blocks, "getting-started has no python snippet"
    with jax.numpy_dtype_promotion("standard"):
        for block in blocks:
            ns = _run_snippet(block)
    assert isinstance(ns["scaler"], fmp.GradScaler)
    start = float(ns["loss_fn"]({"w": jax.numpy.zeros((8, 1))}, ns["x"], ns["y"]))
    assert float(ns["loss_fn"](ns["params"], ns["x"], ns["y"])) < start, "ten steps did not lower the loss"
