"""griffe extension: a single-backticked public name in a docstring links to its API entry on the site.

Docstrings stay plain text, so ``help(fmp.explain)`` reads ``As for `fmp.autocast`.``; when mkdocstrings
loads ``fmp`` this extension turns `` `fmp.autocast` `` into the autorefs link ``[`fmp.autocast`][fmp.autocast]``.
A name resolves as written (``fmp.optax.loss_scaled``) or inside one of the public packages (``GradScaler``,
``GradScaler.state_dict``, ``loss_scaled``, ``FP16_Optimizer.step``), first match in ``PACKAGES`` order;
double backticks (``float32``) and names that resolve to nothing stay code.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import griffe

PACKAGES = ("fmp", "fmp.optax", "fmp.torch", "fmp.torch.fp16_utils", "fmp.torch.cuda.amp")
# one backtick on each side (not two), around a dotted Python name
NAME = re.compile(r"(?<![`\w\]])`([A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*)`(?![`\w\[])")


def resolve(name: str, exists: Callable[[str], bool]) -> str | None:
    """The public path ``name`` refers to, or None; ``exists(path)`` says whether a public path exists."""
    if any(part.startswith("_") and not part.endswith("_") for part in name.split(".")):
        return None
    candidates = [name] if name.split(".")[0] == "fmp" else [f"{pkg}.{name}" for pkg in PACKAGES]
    return next((c for c in candidates if exists(c)), None)


def link(text: str, exists: Callable[[str], bool]) -> str:
    """``text`` with every resolvable single-backticked name made an autorefs link."""

    def sub(m: re.Match[str]) -> str:
        target = resolve(m.group(1), exists)
        return m.group(0) if target is None else f"[`{m.group(1)}`][{target}]"

    return NAME.sub(sub, text)


def lookup(pkg: griffe.Module) -> Callable[[str], bool]:
    """``exists(path)`` over a loaded griffe package (its re-exports resolved on the way)."""

    def exists(path: str) -> bool:
        try:
            pkg[path.removeprefix(pkg.path + ".")]
        except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            return False
        return True

    return exists


def _objects(obj: Any, seen: set[str]) -> Iterator[Any]:
    if obj.is_alias or obj.path in seen:
        return
    seen.add(obj.path)
    yield obj
    for member in obj.members.values():
        yield from _objects(member, seen)


class BacktickRefs(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:  # noqa: ARG002 (griffe's hook signature)
        if pkg.name != "fmp":
            return
        exists = lookup(pkg)
        for obj in _objects(pkg, set()):
            if obj.docstring is not None:
                obj.docstring.value = link(obj.docstring.value, exists)
