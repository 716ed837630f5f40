"""The docs hold the code and outputs they show, so the raw markdown reads whole; each copy equals its file
(an example's section, a written output, a diff of two examples). ``python docs/hooks/synced.py``
rewrites stale copies."""

from __future__ import annotations

import importlib.util
import re

import pytest
from _helpers.common import ROOT


def _synced():
    spec = importlib.util.spec_from_file_location("synced", ROOT / "docs" / "hooks" / "synced.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SYNCED = _synced()
PAGES = SYNCED.pages()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_copy_equals_its_file(page):
    text = page.read_text()
    assert SYNCED.synced(text) == text, (
        f"{page.relative_to(ROOT)} shows a stale copy of an example or output: run python docs/hooks/synced.py"
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_hides_code_behind_an_include(page):
    # a snippet include shows nothing in the raw file; only the changelog page includes CHANGELOG.md whole
    includes = re.findall(r'^\s*--8<-- "([^"]+)"', page.read_text(), re.M)
    assert includes == (["CHANGELOG.md"] if page.name == "changelog.md" else []), includes


def test_the_guides_hold_copies():
    found = {p.relative_to(ROOT).as_posix(): len(SYNCED.COPY.findall(p.read_text())) for p in PAGES}
    assert found["docs/guides/precision-loss.md"] == 8 and found["docs/migration/flax.md"] == 3


def test_a_stale_copy_is_rewritten_and_a_missing_section_is_an_error(tmp_path):
    (tmp_path / "ex.py").write_text("import x\n    # --8<-- [start:s]\n    y = 2\n    # --8<-- [end:s]\n")
    page = "text\n\n    <!-- from: ex.py:s -->\n    ```python\n    y = 1\n    ```\n"
    assert SYNCED.synced(page, tmp_path) == "text\n\n    <!-- from: ex.py:s -->\n    ```python\n    y = 2\n    ```\n"
    with pytest.raises(ValueError, match="no section 't'"):
        SYNCED.synced("<!-- from: ex.py:t -->\n```python\n```\n", tmp_path)
