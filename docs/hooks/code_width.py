"""mkdocs hook: a code line wider than the page is a build warning (``strict: true`` makes it an error).

At 1280 px the page shows about 110 characters of a code block (the table of contents sits in the left
sidebar, ``toc.integrate``); a longer line hides its end behind a scroll bar. Fenced blocks are checked
as written and with their ``--8<--`` includes (pymdownx.snippets) expanded, so an example a page includes
is held to the same width. A block indented inside a list or an admonition counts its indentation: the raw
page is read too, and there its lines take that much more room. Run after diffs.py, which turns its
directives into fenced blocks.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

from mkdocs.plugins import get_plugin_logger

log = get_plugin_logger("code_width")

MAX = 100
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)")
INCLUDE = re.compile(r'^\s*--8<-- "(?P<path>[^"]+)"\s*$')


def _included(path: str, root: Path) -> list[str]:
    """The lines a ``--8<-- "file"`` or ``--8<-- "file:section"`` include inserts (dedented, as configured)."""
    name, _, section = path.partition(":")
    lines = (root / name).read_text().splitlines()
    if not section:
        return lines
    marks = [i for i, line in enumerate(lines) if re.search(rf"--8<-- \[(start|end):{section}\]", line)]
    return textwrap.dedent("\n".join(lines[marks[0] + 1 : marks[1]])).splitlines()  # dedent_subsections


def long_lines(markdown: str, root: Path, limit: int = MAX) -> list[str]:
    """``where: line`` for every code line longer than ``limit``, in fenced blocks and their includes."""
    found, fence, indent = [], None, 0
    for no, line in enumerate(markdown.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None:
            if m:
                fence, indent = m["fence"], len(m["indent"])
            continue
        if m and m["fence"].startswith(fence) and not line.strip().strip(fence[0]):
            fence = None
            continue
        inc = INCLUDE.match(line)
        code = [(f"line {no}", line)]  # a block in a list or an admonition: counted with its indentation
        if inc:
            pad = " " * indent
            code = [(f"{inc['path']}:{i}", pad + text) for i, text in enumerate(_included(inc["path"], root), 1)]
        found += [f"{where} ({len(text)} chars): {text.strip()[:60]}..." for where, text in code if len(text) > limit]
    return found


def on_page_markdown(markdown, page, config, files):  # noqa: ARG001 (mkdocs' hook signature)
    for line in long_lines(markdown, Path(config["config_file_path"]).parent):
        log.warning("%s: code line over %d characters (hidden at 1280 px): %s", page.file.src_path, MAX, line)
    return markdown
