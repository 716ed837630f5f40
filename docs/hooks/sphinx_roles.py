"""mkdocs hook: a Sphinx role left in a docstring or page (``:func:`x```) is a build warning.

mkdocstrings renders Google-style docstrings, whose cross-references are plain backticked names
(`` `fmp.GradScaler` ``, linked by backtick_refs.py); a Sphinx role renders as literal text. ``strict: true`` in
mkdocs.yml turns the warning into a failed build.
"""

from __future__ import annotations

import re

from mkdocs.plugins import get_plugin_logger

log = get_plugin_logger("sphinx_roles")

# a role followed by its rendered target: `:func:<code>x</code>` in the HTML, or a backtick if the markdown
# left it alone
ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|mod|data|exc|obj|const|ref|doc|term):(?:<code>|`)")


def raw_roles(html: str) -> list[str]:
    """The raw Sphinx roles in rendered ``html``, each with a little context."""
    return [html[max(0, m.start() - 40) : m.end() + 40] for m in ROLE.finditer(html)]


def on_page_content(html, page, config, files):  # noqa: ARG001 (mkdocs' hook signature)
    found = raw_roles(html)
    for context in found:
        log.warning(
            "%s: raw Sphinx role (write a plain backticked name, e.g. `fmp.GradScaler`): ...%s...",
            page.file.src_path,
            context,
        )
    return html
