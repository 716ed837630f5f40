"""docs/guides/low-precision-training.md: its code is the example's, and (gallery) the example's run gives the
page's table: repaired bfloat16 variants within 2% of float32, round-to-nearest behind, torchao alongside."""

from __future__ import annotations

import re
import runpy

import pytest
from _helpers.common import ROOT

PAGE = ROOT / "docs" / "guides" / "low-precision-training.md"
EXAMPLE = ROOT / "examples" / "low_precision_training.py"


def _block(text: str, name: str) -> str:
    start = text.index(f"# --8<-- [start:{name}]\n") + len(f"# --8<-- [start:{name}]\n")
    return text[start : text.index(f"# --8<-- [end:{name}]")]


def _rows(page: str, header: str) -> dict[str, list[str]]:
    table = page[page.index(header) :].split("\n\n", 1)[0].splitlines()[2:]
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in row.strip("|").split("|")] for row in table)}


def test_guide_shows_the_example_code():
    page = PAGE.read_text()
    assert _block(EXAMPLE.read_text(), "variants").strip() in page
    # every variant of the example has its row in the table
    rows = _rows(page, "| variant |")
    names = re.findall(r'^        "([^"]+)": ', _block(EXAMPLE.read_text(), "variants"), re.M)
    assert len(names) == 7 and {n if n != "bfloat16" else "bfloat16 (round-to-nearest)" for n in names} == set(rows)


@pytest.mark.gallery  # 7 runs of 300 steps: about 57 s of CPU
def test_example_reproduces_the_guide_table(tmp_path):
    pytest.importorskip("optax")
    module = runpy.run_path(str(EXAMPLE))
    results = module["run_all"](300)
    ref = results["float32"]["final"]
    page_rows = _rows(PAGE.read_text(), "| variant |")
    for name, r in results.items():
        row = page_rows[name if name != "bfloat16" else "bfloat16 (round-to-nearest)"]
        assert abs(float(row[0]) - r["final"]) < 2e-3, (name, row, r["final"])
        assert [float(x) for x in row[2:]] == [round(v) for v in r["bytes"].values()] + [
            round(sum(r["bytes"].values()))
        ]
        if name != "bfloat16":
            assert r["final"] / ref < 1.02, (name, r["final"], ref)
    assert results["bfloat16"]["final"] / ref > 1.015
    assert results["bfloat16"]["final"] > max(r["final"] for n, r in results.items() if n != "bfloat16") + 0.03
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    module["plot"](results, str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").stat().st_size > 10_000


# about 2 minutes of CPU (torchao compiles its step for each parameter shape): a gallery, which CI runs
@pytest.mark.gallery
# inductor, compiling torchao's step on CPU, touches torch.jit.script_method: torch's own noise, not ours
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_torch_and_torchao_on_the_same_problem():
    pytest.importorskip("torch")
    pytest.importorskip("torchao")
    module = runpy.run_path(str(EXAMPLE))
    torch_rows = _rows(PAGE.read_text(), "| torch run |")
    t = module["run_torch"](300)
    for (label, row), final in zip(torch_rows.items(), t.values(), strict=True):
        assert abs(float(row[0]) - final) < 0.01, (label, row, final)
    # torchao's stochastic rounding repairs bfloat16 params as fmp's does: within 2% of float32, where plain
    # bfloat16 AdamW falls behind
    assert t["torchao stochastic rounding"] / t["float32"] < 1.02 < t["bfloat16"] / t["float32"] + 0.005
