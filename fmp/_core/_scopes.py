"""How an ``overrides`` key selects scopes and module paths (JAX name scopes, torch module paths).

A key matches where it occurs in the path, except inside a number: a key that ends in a digit must not be
followed by another digit, and one that starts with a digit must not follow one. So ``"blocks/1"`` selects
``blocks/1`` and ``blocks/1/attn`` but not ``blocks/10``, ``"Dense_1"`` not ``Dense_12``, while
``"LayerNorm"`` still selects every ``LayerNorm_0``, ``LayerNorm_1``, ... and ``"attn"`` ``self_attn``.
"""

from __future__ import annotations


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
