"""docs/guides/float8.md, "Keeping layers out of float8": the example names the planted head, the fix takes it
out of needs_fix, the report text the page shows is what the example writes today, and the page states the
rules the code applies."""

from __future__ import annotations

import math
import os
import re
import runpy

import pytest
from _helpers.common import ROOT

from fmp._report._float8_choice import SMALL_BOXES, STANDS_OUT

PAGE = ROOT / "docs" / "guides" / "float8.md"
ASSETS = ROOT / "docs" / "assets"
FIX = {"overrides": {"LM/Dense_0": "mixed_bfloat16"}}
# the example compares the small LM twice under float8 (about 30 s of CPU): CI runs it with the galleries
GALLERY = pytest.mark.gallery
pytestmark = pytest.mark.xdist_group("float8_choice_page")  # its module fixtures once (tests/conftest.py)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    pytest.importorskip("flax")
    out = tmp_path_factory.mktemp("float8_choice")
    cwd = os.getcwd()
    os.chdir(ROOT)  # the report's source lines are relative to the working directory, as on the page
    try:
        result = runpy.run_path(str(ROOT / "examples" / "float8_choice.py"))["run"](out)
    finally:
        os.chdir(cwd)
    return result, out


@GALLERY
def test_the_head_stands_out_and_its_fix_clears_it(page):
    result, _ = page
    report, fixed = result["report"], result["fixed"]
    (head,) = report.needs_fix
    assert head.scope == "LM/Dense_0" and head.category == "float8"
    assert 2**-4 < head.added_error < 4 * 2**-4 and head.added_vs_float8_median > STANDS_OUT
    others = [r for r in report.records if r.category == "float8" and r is not head]
    assert len(others) == 12 and all(r.added_vs_float8_median < 1.5 for r in others)
    assert report.suggested() == FIX
    assert fixed.needs_fix == [] and sum(r.category == "float8" for r in fixed.records) == 12
    errors = result["loss_errors"]
    assert errors["float8, head in bfloat16"] < errors["float8"]  # the loss moves closer to float32's
    assert len(result["speed"]["overrides"]) == 13  # every matmul of this model is small for a GPU


def _numbers(text: str) -> tuple[str, list[float]]:
    number = r"-?\d+\.\d+(?:e[-+]\d+)?"
    text = re.sub(r"\n {2,8}", " ", text.strip())
    return re.sub(number, "N", text), [float(x) for x in re.findall(number, text)]


@GALLERY
@pytest.mark.parametrize("name", ["float8_choice_report.txt", "float8_choice_fixed.txt"])
def test_the_page_shows_what_the_example_writes(page, name):
    """Regenerate with ``python examples/float8_choice.py --out docs/assets`` when this fails."""
    _, out = page
    assert f"<!-- from: docs/assets/{name} -->" in PAGE.read_text()
    (shown, shown_numbers), (now, now_numbers) = (
        _numbers((ASSETS / name).read_text()),
        _numbers((out / name).read_text()),
    )
    assert shown == now
    assert all(math.isclose(x, y, rel_tol=0.05, abs_tol=1e-4) for x, y in zip(shown_numbers, now_numbers, strict=True))


def test_the_page_states_the_rules_the_report_applies():
    text = " ".join(PAGE.read_text().split())
    assert f"**{STANDS_OUT:g}x the median**" in text
    assert "| tensorwise (fmp: `tensorwise`, `delayed`) | `K <= 4096` and `N <= 1024` |" in text
    assert SMALL_BOXES["tensorwise"] == ((4096, 1024),)
    assert (
        "| rowwise (fmp: `rowwise`, `blockwise`, `mxfp8`, `mxfp4`, `nvfp4`) | `N <= 2048`, or `K <= 1024`, or "
        "`K <= 2048` and"
    ) in text
    assert SMALL_BOXES["rowwise"] == ((math.inf, 2048), (1024, math.inf), (2048, 4096))
    report = (ASSETS / "float8_choice_report.txt").read_text()
    assert report.startswith("1 op needs a fix") and 'fix: overrides={"LM/Dense_0": "mixed_bfloat16"}' in report
    fixed = (ASSETS / "float8_choice_fixed.txt").read_text()
    assert "no op needs a fix" in fixed and "LM/Dense_0" not in fixed
