"""Every name in a public ``__all__`` has a docstring and a ``::: `` entry in the docs."""

from __future__ import annotations

import importlib
import re

import pytest

from tests.helpers import ROOT

MODULES = ["fmp", "fmp.optax", "fmp.torch", "fmp.torch.cuda", "fmp.torch.cuda.amp", "fmp.torch.fp16_utils"]
DOCS = "\n".join(p.read_text() for p in (ROOT / "docs").rglob("*.md"))
ENTRIES = set(re.findall(r"^::: ([\w.]+)", DOCS, re.M))


def _public(modname: str) -> list[str]:
    if modname.startswith("fmp.torch"):
        pytest.importorskip("torch")
    if modname.startswith("fmp.optax"):
        pytest.importorskip("optax")
    return list(importlib.import_module(modname).__all__)


@pytest.mark.parametrize("modname", MODULES)
def test_every_public_name_has_a_docs_entry(modname):
    missing = [n for n in _public(modname) if f"{modname}.{n}" not in ENTRIES]
    assert not missing, f"{modname}: no '::: {modname}.<name>' entry in docs/ for {missing}"


@pytest.mark.parametrize("modname", MODULES)
def test_every_public_name_has_a_docstring(modname):
    # griffe is what mkdocstrings renders from: it sees attribute docstrings (DEFAULT_RULES) that
    # __doc__ does not, and would render an inherited or missing one as an empty entry
    griffe = pytest.importorskip("griffe")
    names = _public(modname)
    pkg = griffe.load(modname, search_paths=[str(ROOT)], resolve_aliases=True, resolve_external=False)
    missing = [n for n in names if pkg[n].docstring is None or not pkg[n].docstring.value.strip()]
    assert not missing, f"{modname}: no docstring for {missing}"


def test_every_docs_entry_is_public():
    public = {f"{m}.{n}" for m in MODULES for n in _public(m)} | set(MODULES)
    stale = sorted(e for e in ENTRIES if e not in public)
    assert not stale, f"docs document names that are not public (renamed or removed?): {stale}"
