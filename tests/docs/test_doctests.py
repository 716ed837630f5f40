"""Runs the ``>>>`` examples in every public docstring of fmp."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fmp


def _modules():
    names = ["fmp"]
    for info in pkgutil.walk_packages(fmp.__path__, prefix="fmp."):
        names.append(info.name)
    return sorted(names)


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name):
    if name.startswith("fmp.torch"):
        pytest.importorskip("torch")
    if name.startswith("fmp.optax"):
        pytest.importorskip("optax")
    module = importlib.import_module(name)
    globs = {"fmp": fmp, "jax": jax, "jnp": jnp, "np": np}
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, name, globs=globs):
        if test.name.split(".")[0] != "fmp":
            continue
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} doctest(s) failed in {name}"
