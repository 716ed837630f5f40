"""docs/guides/precision-loss.md: its example runs, finds the planted mistake first, the fix works, and the
report text and figure the page shows are what the example writes today."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import runpy

import pytest
from _helpers.common import ROOT

PAGE = ROOT / "docs" / "guides" / "precision-loss.md"
ASSETS = ROOT / "docs" / "assets"
FIX = 'overrides={"LM/Rotary_0": "float32"}'
# the example's run takes about 25 s of CPU, most of it compiling each op once for the eager comparison: CI runs
# it with the galleries; the caveat at the end of the page is checked in the default suite
GALLERY = pytest.mark.gallery
pytestmark = pytest.mark.xdist_group("precision_loss_page")  # its module fixtures once (tests/conftest.py)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    pytest.importorskip("flax")
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = tmp_path_factory.mktemp("precision_loss")
    cwd = os.getcwd()
    os.chdir(ROOT)  # the report's source lines are relative to the working directory, as on the page
    try:
        module = runpy.run_path(str(ROOT / "examples" / "precision_loss.py"))
        result = module["run"](out)
    finally:
        os.chdir(cwd)
    yield {**result, "head": module["head"]}, out
    plt.close(result["figure"])


@GALLERY
def test_the_planted_ops_rank_first_with_the_fix(page):
    result, _ = page
    report = result["report"]
    first = report.worst(2)
    assert sorted(r.op for r in first) == ["cos", "sin"]
    assert all(r.scope == "LM/Rotary_0" and r.suggestion == FIX and r.added_error > 4 * 2**-8 for r in first)
    # nothing else asks for a fix: the other ops' own errors are bfloat16's rounding of their outputs
    assert [r for r in report.records if r.suggestion] == sorted(first, key=lambda r: r.index)
    rest = report.worst(10)[2:]
    assert all(r.op == "dot_general" and 0 < r.added_error < 2**-8 for r in rest)


@GALLERY
def test_the_suggestion_fixes_it(page):
    result, _ = page
    fixed = result["fixed"]
    trig = [r for r in fixed.records if r.op in ("sin", "cos")]
    assert len(trig) == 2 and all(r.out_after == ("float32",) and r.added_error == 0.0 for r in trig)
    assert not any(r.suggestion for r in fixed.records)
    errors = result["loss_errors"]
    assert errors["fixed"] * 3 < errors["planted"]  # the loss moves closer to float32's


def _blocks(text: str) -> list[tuple[str, list[float]]]:
    """The report head's blocks (one per op) with their numbers taken out, and the numbers."""
    text = re.sub(r"\n {8}", " ", text.strip())  # the page's wrapped lines, joined
    number = r"-?\d+\.\d+(?:e[-+]\d+)?"
    return [(re.sub(number, "N", b), [float(x) for x in re.findall(number, b)]) for b in text.split("\n#")]


@GALLERY
@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("precision_loss_planted.txt", "report"),
        ("precision_loss_fixed.txt", "fixed"),
        ("precision_loss_nnx.txt", "nnx_report"),
    ],
)
def test_the_page_shows_what_the_example_writes(page, name, key):
    """Regenerate with ``python examples/precision_loss.py --out docs/assets`` when this fails."""
    result, out = page
    assert f"<!-- from: docs/assets/{name} -->" in PAGE.read_text()
    shown, now = _blocks((ASSETS / name).read_text()), _blocks((out / name).read_text())
    assert len(shown) == len(now) and shown[0][0] == now[0][0]  # the head's title (and the loss errors)
    assert all(math.isclose(x, y, rel_tol=0.5) for x, y in zip(shown[0][1], now[0][1], strict=True))
    report = result[key]
    if key != "fixed":  # the planted ops first, as the example finds them today
        assert {text.split(" ", 1)[0] for text, _ in shown[1:3]} == {str(r.index) for r in report.worst(2)}
    # every op shown, as the example prints it today: the same op, dtypes, scope and source line, the errors
    # up to another CPU's last bits (ops of equal error may swap places there, so each is checked by its index)
    for text, numbers in shown[1:]:
        row = report.records[int(text.split(" ", 1)[0])]
        (_, (want, want_numbers)) = _blocks(result["head"](dataclasses.replace(report, records=(row,)), ops=1))
        assert text == want
        assert all(math.isclose(x, y, rel_tol=0.05, abs_tol=0.2) for x, y in zip(numbers, want_numbers, strict=True))


@GALLERY
def test_nnx_finds_the_same_ops_and_names_the_attribute_path(page):
    result, _ = page
    first = result["nnx_report"].worst(2)
    assert sorted(r.op for r in first) == ["cos", "sin"]
    assert all(r.scope == "rotary" and r.suggestion == 'overrides={"rotary": "float32"}' for r in first)
    assert [r for r in result["nnx_report"].records if r.suggestion] == sorted(first, key=lambda r: r.index)
    assert result["nnx_fix"] == {"rotary": "float32"}
    assert not any(r.suggestion for r in result["nnx_fixed"].records)
    trig = [r for r in result["nnx_fixed"].records if r.op in ("sin", "cos")]
    assert len(trig) == 2 and all(r.added_error == 0.0 for r in trig)


@GALLERY
def test_the_page_shows_the_figure(page):
    _, out = page
    assert "![" in PAGE.read_text() and "../assets/precision_loss.png" in PAGE.read_text()
    assert (out / "precision_loss.png").stat().st_size > 20_000
    assert (ASSETS / "precision_loss.png").stat().st_size < 120_000  # small in the repository


@GALLERY
def test_masked_scores_show_almost_no_error(page):
    """The page: the blue line dips at the masked attention scores, whose -1e9 fill dominates their norm."""
    result, _ = page
    masked = [r for r in result["report"].records if r.op == "select_n" and "Attention" in r.scope and r.error]
    assert len(masked) == 2 and all(r.error < 1e-6 for r in masked)


def test_an_amplified_rounding_shows_in_error_not_added_error():
    """The page's caveat: angles rounded by a bfloat16 matmul, then a cosine of them (2048 positions)."""
    import jax.numpy as jnp

    import fmp

    inv_freq = 1.0 / 10000.0 ** (jnp.arange(0, 64, 2, dtype=jnp.float32) / 64)
    rules = fmp.DEFAULT_RULES.derive(uncontracted=[])  # outer products run in bfloat16 like any matmul

    def cos(pos, inv_freq):
        return jnp.cos(jnp.einsum("i,j->ij", pos, inv_freq))

    rep = fmp.explain(cos, rules=rules, compare=True)(jnp.arange(2048, dtype=jnp.float32), inv_freq)
    (angles,) = rep.filter(op="dot_general").records
    (cosine,) = rep.filter(op="cos").records
    assert angles.added_error < 2**-8 and angles.suggestion is None  # a relative rounding of the angles
    assert cosine.error > 100 * max(angles.error, cosine.added_error)  # the jump: in error only
