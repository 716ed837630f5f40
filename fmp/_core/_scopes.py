"""How an ``overrides`` key selects scopes and module paths (JAX name scopes, torch module paths).

A key matches where it occurs in the path, except inside a number: a key that ends in a digit must not be
followed by another digit, and one that starts with a digit must not follow one. So ``"blocks/1"`` selects
``blocks/1`` and ``blocks/1/attn`` but not ``blocks/10``, ``"Dense_1"`` not ``Dense_12``, while
``"LayerNorm"`` still selects every ``LayerNorm_0``, ``LayerNorm_1``, ... and ``"attn"`` ``self_attn``.

A key that names a source location (``"model.py:12:8"``, ``"src/model.py:12"``) selects the operations of
that line (and column) instead: what ``fmp.explain`` suggests for an op outside any named scope.
"""

from __future__ import annotations

import re


def find_key(path: str, key: str) -> int:
    """The position of the last match of ``key`` in ``path``, or -1.

    Examples:
      >>> from fmp._core._scopes import find_key
      >>> find_key("blocks/10/attn", "blocks/1"), find_key("blocks/1/attn", "blocks/1")
      (-1, 0)
      >>> find_key("model/LayerNorm_0", "LayerNorm")
      6
    """
    end = len(path)
    while True:
        pos = path.rfind(key, 0, end)
        if pos < 0:
            return -1
        after = pos + len(key)
        cut_after = key[-1].isdigit() and after < len(path) and path[after].isdigit()
        cut_before = key[0].isdigit() and pos > 0 and path[pos - 1].isdigit()
        if not (cut_after or cut_before):
            return pos
        end = pos + len(key) - 1  # look for an earlier occurrence


def matches(path: str, key: str) -> bool:
    """Whether ``key`` selects ``path`` (see the module docstring)."""
    return find_key(path, key) >= 0


# a source-location key: ``"model.py:12"`` or ``"src/model.py:12:8"`` (a file name with an extension that
# starts with a letter, so a module path ``"layers.1"`` is none, or code without a file such as ``"<stdin>"``;
# a line; a column)
_LOCATION = re.compile(r"(?P<path>[^\s:<>]+\.[A-Za-z]\w*|<[^<>]+>):(?P<line>\d+)(?::(?P<col>\d+))?")


def is_location(key: str) -> bool:
    """Whether an ``overrides`` key names a source location (``"model.py:12:8"``) rather than a scope or a
    module path.

    Examples:
      >>> from fmp._core._scopes import is_location
      >>> is_location("src/model.py:12:8"), is_location("model.py:12"), is_location("blocks/1")
      (True, True, False)
      >>> is_location("layers.1"), is_location("<stdin>:3")
      (False, True)
    """
    return _LOCATION.fullmatch(key) is not None


def matches_location(source: str, key: str) -> bool:
    """Whether the source line ``source`` (``"/abs/src/model.py:12:8 (forward)"``, as explain writes it)
    lies at the location ``key``: the same line (and column, when the key gives one) of a file whose path
    ends with the key's path at a folder boundary.

    Examples:
      >>> from fmp._core._scopes import matches_location
      >>> src = "/home/me/src/model.py:12:8 (forward)"
      >>> [matches_location(src, k) for k in ("src/model.py:12:8", "model.py:12", "del.py:12", "model.py:12:9")]
      [True, True, False, False]
    """
    key_m = _LOCATION.fullmatch(key)
    src_m = _LOCATION.match(source.split(" (", 1)[0])
    if key_m is None or src_m is None or key_m["line"] != src_m["line"]:
        return False
    if key_m["col"] is not None and key_m["col"] != src_m["col"]:
        return False
    path, tail = src_m["path"].replace("\\", "/"), key_m["path"].replace("\\", "/")
    return path == tail or path.endswith("/" + tail.lstrip("./"))
