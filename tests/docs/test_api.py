"""Every name in a public ``__all__`` has a docstring and a ``::: `` entry in the docs."""

from __future__ import annotations

import importlib
import re

import pytest
from _helpers.common import ROOT

MODULES = [
    "fmp",
    "fmp.testing",
    "fmp.optax",
    "fmp.torch",
    "fmp.torch.cuda",
    "fmp.torch.cuda.amp",
    "fmp.torch.fp16_utils",
]
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


# A Sphinx role (":func:`x`") renders as literal text under mkdocstrings; the docs use autorefs links.
_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|mod|data|exc|obj|const|ref|doc|term):`")


def test_no_sphinx_roles_in_docstrings_or_pages():
    sources = [*(ROOT / "fmp").rglob("*.py"), *(ROOT / "docs").rglob("*.md"), ROOT / "README.md"]
    found = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in sources
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if _ROLE.search(line)
    ]
    assert not found, "Sphinx roles left (write a plain `fmp.name` instead):\n" + "\n".join(found)


# ``[`fmp.autocast`][fmp.autocast]`` is what help() would show; the site links plain `fmp.autocast` itself
_AUTOREFS = re.compile(r"\[`[^`\]]+`\]\[[\w.]+\]")


def test_no_autorefs_markup_in_docstrings():
    found = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in (ROOT / "fmp").rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if _AUTOREFS.search(line)
    ]
    assert not found, "autorefs markup in a docstring (write a plain `fmp.name`):\n" + "\n".join(found)


def _load_hook(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "hooks" / f"{name}.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return hook


def test_help_reads_plain_names_and_the_site_links_them():
    """help() shows `fmp.autocast`; the griffe extension mkdocs.yml loads turns it into a link to its entry."""
    griffe = pytest.importorskip("griffe")
    import fmp

    assert "As for `fmp.autocast`." in fmp.explain.__doc__
    assert "docs/hooks/backtick_refs.py:BacktickRefs" in (ROOT / "mkdocs.yml").read_text()
    refs = _load_hook("backtick_refs")
    pkg = griffe.load("fmp", search_paths=[str(ROOT)], resolve_aliases=True, resolve_external=False)
    refs.BacktickRefs().on_package(pkg=pkg)
    assert "As for [`fmp.autocast`][fmp.autocast]." in pkg["explain"].docstring.value
    exists = refs.lookup(pkg)
    # short names resolve in the public packages; private, unknown and double-backticked names stay code
    assert refs.link("`loss_scaled`, `GradScaler.state_dict`", exists) == (
        "[`loss_scaled`][fmp.optax.loss_scaled], [`GradScaler.state_dict`][fmp.GradScaler.state_dict]"
    )
    assert (
        refs.link("`fmp._scaling._scaler`, `nope`, ``GradScaler``", exists)
        == "`fmp._scaling._scaler`, `nope`, ``GradScaler``"
    )


def test_docs_build_warns_on_a_raw_role(caplog):
    """The mkdocs hook that makes `mkdocs build --strict` fail on a role that reaches a page."""
    pytest.importorskip("mkdocs")
    import logging
    import types

    assert "docs/hooks/sphinx_roles.py" in (ROOT / "mkdocs.yml").read_text(), "the hook is not in mkdocs.yml"
    hook = _load_hook("sphinx_roles")
    page = types.SimpleNamespace(file=types.SimpleNamespace(src_path="api.md"))
    linked = '<p>See <a class="autorefs" href="#fmp.grad"><code>fmp.grad</code></a>.</p>'
    with caplog.at_level(logging.WARNING):
        assert hook.on_page_content(linked, page, None, None) == linked
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        hook.on_page_content("<p>See :func:<code>fmp.grad</code> and :meth:`x`.</p>", page, None, None)
    assert len(caplog.records) == 2 and "api.md: raw Sphinx role" in caplog.records[0].getMessage()


@pytest.mark.parametrize("modname", MODULES)
def test_every_public_name_has_an_example(modname):
    """Every public docstring shows a ``>>>`` example; tests/docs/test_doctests.py runs them.

    doctest does not see attribute docstrings (``DEFAULT_RULES``), so those examples run here.
    """
    import doctest

    import jax
    import jax.numpy as jnp
    import numpy as np

    import fmp

    griffe = pytest.importorskip("griffe")
    names = _public(modname)
    pkg = griffe.load(modname, search_paths=[str(ROOT)], resolve_aliases=True, resolve_external=False)
    docs = {n: pkg[n].docstring.value if pkg[n].docstring else "" for n in names}
    missing = [n for n in names if ">>>" not in docs[n]]
    assert not missing, f"{modname}: no '>>>' example in the docstring of {missing}"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for n in names:
        if pkg[n].is_attribute:
            globs = {"fmp": fmp, "jax": jax, "jnp": jnp, "np": np}
            runner.run(doctest.DocTestParser().get_doctest(docs[n], globs, f"{modname}.{n}", None, 0))
    assert runner.summarize(verbose=False).failed == 0
