"""Code and outputs a page shows from a file are written into the page, so the raw markdown reads whole.

A copy is a fenced block right after a marker line, both at the same indentation (inside a collapsed
``???`` block too):

- ``<!-- from: examples/precision_loss.py:model -->``: the section of the file between its
  ``--8<-- [start:model]`` and ``--8<-- [end:model]`` lines, dedented;
- ``<!-- from: docs/assets/precision_loss_fixed.txt -->``: the whole file;
- ``<!-- diff: before.py after.py -->``: a unified diff of the two files' code (``diffs.diff``).

The test suite checks every copy against its file (``tests/docs/test_synced.py``); after changing an
example or regenerating an output, ``python docs/hooks/synced.py`` rewrites the copies (``--check`` only
lists the stale ones). Not an mkdocs hook: the pages are built as they are.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COPY = re.compile(
    r"^(?P<indent> *)<!-- (?:from: (?P<src>\S+)|diff: (?P<a>\S+) (?P<b>\S+)) -->\n"
    r"(?P=indent)(?P<fence>```+)(?P<lang>[\w-]*)\n(?P<body>.*?)(?:\n)?(?P=indent)(?P=fence)$",
    re.M | re.S,
)


def _diffs():
    spec = importlib.util.spec_from_file_location("diffs", Path(__file__).with_name("diffs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def source(spec: str, root: Path = ROOT) -> str:
    """The text ``<!-- from: spec -->`` copies: a whole file, or a ``file:section`` dedented."""
    name, _, section = spec.partition(":")
    text = (root / name).read_text()
    if not section:
        return text.rstrip("\n")
    lines = text.splitlines()
    marks = [i for i, line in enumerate(lines) if re.search(rf"--8<-- \[(start|end):{section}\]", line)]
    if len(marks) != 2:
        raise ValueError(f"{name} has no section {section!r} (--8<-- [start:{section}] ... [end:{section}])")
    return textwrap.dedent("\n".join(lines[marks[0] + 1 : marks[1]])).strip("\n")


def expected(m: re.Match[str], root: Path = ROOT) -> str:
    return source(m["src"], root) if m["src"] else _diffs().diff(root, m["a"], m["b"])


def synced(markdown: str, root: Path = ROOT) -> str:
    """``markdown`` with every copy rewritten from its file."""

    def sub(m: re.Match[str]) -> str:
        ind = m["indent"]
        body = "\n".join(ind + line if line else line for line in expected(m, root).splitlines())
        marker = m.group(0).split("\n", 1)[0]
        return f"{marker}\n{ind}{m['fence']}{m['lang']}\n{body}\n{ind}{m['fence']}"

    return COPY.sub(sub, markdown)


def pages(root: Path = ROOT) -> list[Path]:
    return sorted([*(root / "docs").rglob("*.md"), root / "README.md"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="list stale pages, change nothing")
    opts = parser.parse_args()
    stale = []
    for page in pages():
        text = page.read_text()
        new = synced(text)
        if new != text:
            stale.append(str(page.relative_to(ROOT)))
            if not opts.check:
                page.write_text(new)
    print(("stale: " if opts.check else "rewritten: ") + (", ".join(stale) or "none"))
    return 1 if opts.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
