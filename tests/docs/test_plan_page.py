"""The precision plan's guide page: its example runs, keeps the planted head out of float8, and the page
shows the example's plan section."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from _helpers.common import ROOT

PAGE = (ROOT / "docs" / "guides" / "plan.md").read_text()


@pytest.mark.gallery  # plans and trains four runs: about a minute on 2 cores
def test_the_example_keeps_the_planted_head_out_of_float8():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}  # as tests/docs/test_examples.py runs
    script = str(ROOT / "examples" / "plan_lm.py")
    proc = subprocess.run([sys.executable, script, "--fast"], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^(embed|attn|mlp|head)\s+(\w+)", out, re.M)}
    assert rows == {"embed": "float8", "attn": "float8", "mlp": "float8", "head": "bfloat16"}
    assert re.search(r"^plan +final held-out loss", out, re.M)


def test_the_page_shows_a_plan_with_the_head_in_bfloat16():
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^(embed|attn|mlp|head)\s+(\w+)", PAGE, re.M)}
    assert rows == {"embed": "float8", "attn": "float8", "mlp": "float8", "head": "bfloat16"}
    assert "![The four loss curves](../assets/plan_lm.png)" in PAGE
    assert (ROOT / "docs" / "assets" / "plan_lm.png").exists()
