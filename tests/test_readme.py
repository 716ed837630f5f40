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
