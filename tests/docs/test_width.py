"""Code in the docs fits the page: no line over 100 characters, copies of examples and diffs counted."""

from __future__ import annotations

import importlib.util

import pytest
from _helpers.common import ROOT

PAGES = sorted([*(ROOT / "docs").rglob("*.md"), ROOT / "README.md"])


def _hook(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hooks():
    pytest.importorskip("mkdocs")
    assert "docs/hooks/code_width.py" in (ROOT / "mkdocs.yml").read_text()
    return _hook("diffs"), _hook("code_width")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_lines_fit_the_page(page, hooks):
    _, width = hooks
    long = width.long_lines(page.read_text(), ROOT)  # diffs and copies of examples are written into the page
    assert not long, f"{page.relative_to(ROOT)}: code lines over {width.MAX} characters:\n" + "\n".join(long)


def test_width_check_sees_blocks_includes_and_sections(hooks, tmp_path):
    _, width = hooks
    (tmp_path / "ex.py").write_text(
        "x = 1\n    # --8<-- [start:s]\n    y = '" + "y" * 100 + "'\n    # --8<-- [end:s]\n"
    )
    wide = "z" * 101
    page = f"text {wide}\n\n```python\nok\n{wide}\n```\n\n    ```text\n    {wide}\n    ```\n"
    assert [w.split(" (")[0] for w in width.long_lines(page, tmp_path)] == ["line 5", "line 9"]
    # the whole file as written; a section dedented (dedent_subsections)
    assert [w.split(": ")[0] for w in width.long_lines('```python\n--8<-- "ex.py"\n```\n', tmp_path)] == [
        "ex.py:3 (110 chars)"
    ]
    found = width.long_lines('```python\n--8<-- "ex.py:s"\n```\n', tmp_path)
    assert [w.split(": ")[0] for w in found] == ["ex.py:s:1 (106 chars)"]


def test_width_check_counts_the_indentation_of_blocks_in_lists_and_admonitions(hooks, tmp_path):
    """A block inside a collapsed ``???`` or a list is as wide in the raw page as its indentation plus its
    text: 97 characters indented by 4 are 101 there, too wide; 96 fit."""
    _, width = hooks
    (tmp_path / "ex.py").write_text("a" * 97 + "\n" + "b" * 96 + "\n")
    page = '??? "Full file"\n\n    ```python\n    ' + "x" * 97 + "\n    " + "y" * 96 + "\n    ```\n"
    assert [w.split(": ")[0] for w in width.long_lines(page, tmp_path)] == ["line 4 (101 chars)"]
    listed = '- item\n\n    ```python\n    --8<-- "ex.py"\n    ```\n'
    assert [w.split(": ")[0] for w in width.long_lines(listed, tmp_path)] == ["ex.py:1 (101 chars)"]


MIGRATIONS = {"torch-amp": "torch_amp", "jmp": "jmp", "flax": "flax", "apex": "apex", "torchao": "torchao"}


@pytest.mark.parametrize("page", MIGRATIONS)
def test_migration_page_shows_the_change_as_a_diff_of_the_examples(page, hooks):
    """The page holds the diff of the example files (tests/docs/test_synced.py keeps it current); the full
    files sit in collapsed blocks."""
    import difflib

    diffs, _ = hooks
    text = (ROOT / "docs" / "migration" / f"{page}.md").read_text()
    before, after = (f"examples/migration/{MIGRATIONS[page]}_{part}.py" for part in ("before", "after"))
    assert f"<!-- diff: {before} {after} -->" in text
    for path in (before, after):
        assert f'??? "Full file: `{path}`"\n\n    <!-- from: {path} -->\n    ```python\n' in text
        assert text.count(f"<!-- from: {path} -->") == 1  # not also shown open
    shown = text.split("```diff\n", 1)[1].split("\n```", 1)[0].splitlines()
    assert shown[:2] == [f"--- {before}", f"+++ {after}"]
    (a, _), (b, _) = diffs._code(ROOT / before), diffs._code(ROOT / after)
    changed = [line for line in difflib.ndiff(a, b) if line[:2] in ("- ", "+ ")]
    for sign in "-+":  # every removed and every added line, in order
        assert [x[1:] for x in shown[2:] if x[0] == sign] == [x[2:] for x in changed if x[0] == sign]
    # hunk headers carry the files' own line numbers
    for header in (line for line in shown if line.startswith("@@")):
        old = int(header.split()[1].split(",")[0][1:])
        new = int(header.split()[2].split(",")[0][1:])
        first = shown[shown.index(header) + 1]
        line = (ROOT / (before if first.startswith(("-", " ")) else after)).read_text().splitlines()
        assert line[(old if first.startswith(("-", " ")) else new) - 1] == first[1:], header
