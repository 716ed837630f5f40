"""The diff a migration page shows under ``<!-- diff: before.py after.py -->`` (written by ``synced.py``).

The migration pages show what changes between a "before" and an "after" example as a unified diff of the
two files, checked against them by the test suite, so it cannot drift from the examples the suite runs.
The module docstrings (which only say which listing is which) are left out; the full files stay one click
away in collapsed ``??? "Full file"`` blocks.
"""

from __future__ import annotations

import ast
import difflib
import re
from pathlib import Path

DIRECTIVE = re.compile(r"^<!-- diff: (\S+) (\S+) -->$", re.M)


def _code(path: Path) -> tuple[list[str], int]:
    """The file's lines after its module docstring, and the line number of the first of them."""
    text = path.read_text()
    tree = ast.parse(text)
    start = 0
    if tree.body and isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant):
        start = tree.body[0].end_lineno or 0
    lines = text.splitlines()[start:]
    while lines and not lines[0].strip():  # the blank lines after the docstring
        lines, start = lines[1:], start + 1
    return lines, start + 1


def diff(root: Path, before: str, after: str, context: int = 2) -> str:
    """A unified diff of the code of ``root/before`` and ``root/after`` (line numbers as in the files)."""
    (a, a0), (b, b0) = _code(root / before), _code(root / after)
    out = []
    for line in difflib.unified_diff(a, b, before, after, n=context, lineterm=""):
        hunk = re.fullmatch(r"@@ -(\d+)(,\d+)? \+(\d+)(,\d+)? @@", line)
        if hunk:  # renumber: the diff starts after the docstrings
            old, new = int(hunk[1]) + a0 - 1, int(hunk[3]) + b0 - 1
            line = f"@@ -{old}{hunk[2] or ''} +{new}{hunk[4] or ''} @@"
        out.append(line)
    return "\n".join(out)
