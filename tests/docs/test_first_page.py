"""The first page shows the precision debugger: README.md, DESCRIPTION.md (the index page) and docs/index.md
hold the same snippet, and the output they print under it is what the snippet prints."""

from __future__ import annotations

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers.common import ROOT

pytest.importorskip("flax")

PAGES = ("README.md", "DESCRIPTION.md", "docs/index.md")


def _section(page: str) -> tuple[str, str]:
    """The debugger's snippet on ``page`` and the output block that follows it."""
    text = (ROOT / page).read_text()
    m = re.search(
        r"```python\n(?P<code>[^`]*fmp\.explain\([^`]*)```\n\nIt prints:\n\n```text\n(?P<out>.*?)```", text, re.S
    )
    assert m is not None, f"{page} does not show the precision debugger with its output"
    return m["code"], m["out"]


def test_every_first_page_shows_the_same_snippet():
    sections = {page: _section(page) for page in PAGES}
    assert len(set(sections.values())) == 1, "the first pages' debugger snippets or outputs differ"
    code, _ = sections["README.md"]
    assert "mixed_float8" in code and "report.suggested()" in code


def test_the_snippet_prints_what_the_pages_say():
    code, out = _section("README.md")
    ns: dict = {"__name__": "__main__"}
    buf = io.StringIO()
    with jax.numpy_dtype_promotion("standard"), contextlib.redirect_stdout(buf):
        exec(compile(code, "model.py", "exec"), ns)  # noqa: S102 (saved as model.py, as the pages say)
    assert buf.getvalue() == out
    # the fix, in training, brings the output to float32's; the float8 wrapper runs
    model, params, x = ns["model"], ns["params"], ns["x"]
    want = np.asarray(model.apply(params, x), np.float64)

    def err(y):
        return float(np.linalg.norm(np.asarray(y, np.float64) - want) / np.linalg.norm(want))

    with jax.numpy_dtype_promotion("standard"):
        plain = err(ns["fmp"].autocast(model.apply, "mixed_bfloat16")(params, x))
        fixed = err(ns["train_apply"](params, x))
        fp8 = ns["float8_apply"](params, x)
    assert fixed < plain / 4, (fixed, plain)
    assert fp8.shape == x.shape and bool(jnp.all(jnp.isfinite(fp8)))
