"""Gallery: float8 training against bfloat16 (the main job's MLP and a 2-block pre-LN transformer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT


def _run(*args: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / "float8_training.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.gallery
def test_every_recipe_trains_like_bfloat16():
    proc = _run("--json", "--no-plot", timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = json.loads(proc.stdout.strip().splitlines()[-1])
    for model, rows in table.items():
        assert [r["recipe"] for r in rows] == ["bfloat16", "tensorwise", "rowwise", "blockwise", "delayed"]
        print(model, [(r["recipe"], round(r["final_rel_diff"], 4), round(r["step_rel_diff_mean"], 4)) for r in rows])
    for row in table["transformer"]:
        assert row["final_rel_diff"] < 0.02, row  # the 2% target
        assert row["step_rel_diff_mean"] < 0.01, row
    # The MLP memorises digits: by step 150 its held-out loss is 0.02-0.04 and any change of rounding moves it
    # by percents either way (float8 runs landed 0.5-16% from bfloat16 across seeds and versions of the
    # transform, above and below). The 2% target does not hold for it (the float8 guide says so); this checks
    # that every recipe learned and stays within half of bfloat16's loss, far outside the spread seen.
    for row in table["mlp"]:
        assert row["final_rel_diff"] < 0.5 and row["final_loss"] < 0.05, row


def test_final_losses_over_seeds_are_printed_per_policy():
    proc = _run("--models", "mlp", "--recipes", "tensorwise", "--mlp-steps", "2", "--seeds", "0,1", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines() if line.split()[:1]}
    assert "mlp: final loss over seeds [0, 1]" in proc.stdout
    assert rows["bfloat16"][1] == "0.00%" and float(rows["tensorwise"][0]) > 0, proc.stdout
