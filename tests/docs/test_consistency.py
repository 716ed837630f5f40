"""Figures quoted on several pages agree with the table they come from, and what the docs say fmp does with
float16 subnormals is what it does. Nothing here is a measured number: each check reads the source table
from the docs and compares the other pages with it."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from _helpers.common import ROOT

import fmp

DOCS = ROOT / "docs"


def _text(path) -> str:
    """A page with its line breaks and runs of spaces folded to single spaces."""
    return re.sub(r"\s+", " ", path.read_text())


def _section(page: str, heading: str) -> str:
    """The text of ``page`` from ``heading`` to the next heading of the same or a higher level."""
    text = (DOCS / page).read_text()
    level = len(heading) - len(heading.lstrip("#"))
    start = text.index(heading + "\n")
    nxt = re.search(rf"^#{{1,{level}}} ", text[start + len(heading) :], re.M)
    return text[start : start + len(heading) + (nxt.start() if nxt else len(text))]


def _rows(markdown: str) -> dict[str, list[str]]:
    """Table rows of ``markdown``: first cell -> the other cells, stripped (header and rule rows included)."""
    rows = {}
    for line in markdown.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows.setdefault(cells[0], cells[1:])
    return rows


def test_float8_gpu_ratios_agree_with_the_h200_table():
    """Every page that quotes the float8 GEMM throughput or the GPT-2-small slowdown quotes the H200 tables."""
    gpu = _section("benchmarks.md", "## On a GPU")
    rows = _rows(gpu)
    tensorwise = rows["float8 tensorwise (`Float8Recipe()`)"][1]
    rowwise = rows['float8 rowwise (`Float8Recipe("rowwise")`)'][1]
    step = {name: float(cells[0]) for name, cells in rows.items() if re.fullmatch(r"[0-9.]+", cells[0] or "")}
    bf16 = step["`fmp.autocast` bfloat16"]
    slower_t = round(100 * (step["`fmp.autocast` float8 tensorwise"] / bf16 - 1))
    slower_r = round(100 * (step["`fmp.autocast` float8 rowwise"] / bf16 - 1))
    assert f"float8 is {slower_t}% (tensorwise) and {slower_r}% (rowwise) slower" in _text(DOCS / "benchmarks.md")

    quoted = 0
    for path in sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"]:
        text = _text(path)
        for t, r in re.findall(r"(\d\.\d+)x \(tensorwise\) and (\d\.\d+)x \(rowwise\)", text):
            assert (t, r) == (tensorwise, rowwise), (
                f"{path.name} quotes {t}x/{r}x, the H200 table {tensorwise}/{rowwise}"
            )
            quoted += 1
        for t, r in re.findall(r"(\d+)% (?:\(tensorwise\) )?and (\d+)% (?:\(rowwise\) )?slower", text):
            assert (int(t), int(r)) == (slower_t, slower_r), f"{path.name} quotes {t}%/{r}% slower"
            quoted += 1
    assert quoted >= 6  # the float8 guide, the recipe page and the float8 benchmark page quote both
    recipes = _text(DOCS / "guides" / "float8-recipes.md")
    assert f"{slower_t}% (tensorwise) and {slower_r}% (rowwise) slower" in recipes


def _results_tables(markdown: str) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """The main job's two tables in ``markdown``: the one whose header starts ``run | test loss`` and the one
    whose header starts ``run | steps/s``; run -> cells."""
    tables: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in markdown.splitlines():
        if not line.startswith("|"):
            current = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if current is None:
            current = tables.setdefault(cells[1], {})
        elif not set(cells[0]) <= set("-: "):
            current[cells[0]] = cells[1:]
    return tables["test loss"], next(t for k, t in tables.items() if k.startswith("steps/s"))


def test_main_job_tables_agree_across_pages():
    """The benchmarks summary quotes the main-job page's tables cell for cell, with its date and machine."""
    page = (DOCS / "benchmarks" / "main.md").read_text()
    summary = _section("benchmarks.md", "## Main job")
    learned, costs = _results_tables(page)
    learned_s, costs_s = _results_tables(summary)
    assert set(learned) == {"float32", "bfloat16", "float16+scaling", "float16"}
    assert learned_s == learned
    assert {k: v[1:] for k, v in costs_s.items()} == {k: v[1:] for k, v in costs.items()}  # bytes: exact
    date = re.search(r"Date: (\d{4}-\d\d-\d\d)", page).group(1)
    assert date in summary
    cpu = re.search(r"\*\*Machine and versions\.\*\* A shared 2-core ([^,(]+)", page).group(1).strip()
    assert cpu in _text(DOCS / "benchmarks.md"), cpu


def test_float16_subnormals_are_kept_as_the_docs_say():
    """fmp keeps float16 subnormals (2**-24 to 2**-14) through autocast's casts, forward and backward, and
    rounds only what is below half of 2**-24 to zero; no page or docstring says fmp flushes them."""
    w, x = jnp.full((4, 1), 2.0**-12, jnp.float32), jnp.full((1, 4), 2.0**-12, jnp.float32)
    forward = jax.jit(fmp.autocast(lambda x, w: jnp.sum(x @ w), "mixed_float16"))(x, w)
    assert float(forward) == 4 * 2.0**-24  # a float16 subnormal result, cast up unchanged

    def grad(scale):
        fn = fmp.autocast(lambda w, x: scale * jnp.sum(x @ w), "mixed_float16")
        return np.asarray(jax.jit(jax.grad(fn))(jnp.ones((4, 1)), jnp.ones((1, 4))))

    assert np.all(grad(2.0**-20) == 2.0**-20)  # a subnormal cotangent of the float16 matmul: kept
    assert np.all(grad(2.0**-26) == 0)  # below half the smallest subnormal: rounds to zero

    files = sorted(DOCS.rglob("*.md")) + sorted((ROOT / "fmp").rglob("*.py")) + [ROOT / "README.md"]
    for path in files:
        for sentence in re.split(r"(?<=[.;])\s", _text(path)):
            if "subnormal" in sentence:
                claim = re.search(r"\bfmp\b[^.;]*\bflush(?:es)?\b", sentence)
                assert not claim, f"{path.relative_to(ROOT)} says fmp flushes float16 subnormals: {sentence!r}"
