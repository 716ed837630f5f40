"""Which frame of a call stack is the user's: one rule for the source column of ``explain`` and ``explain_fx``.

A file is the user's unless it belongs to

- fmp or a framework (JAX, torch, NumPy) or the standard library: ``"framework"``;
- a model library (flax, equinox, haiku, keras, transformers, lightning), wherever it is installed, or any
  installed package: a file under a ``site-packages``/``dist-packages`` folder (a base interpreter's, a virtual
  environment's, conda's, the user site) or inside the project of an editable install of another package:
  ``"library"``.

An editable install whose project holds the working directory, or lies inside it, is the user's own. Packages
named in the ``FMP_USER_PACKAGES`` environment variable (comma-separated import names, e.g.
``FMP_USER_PACKAGES=mymodels,mylib``) are the user's wherever they are installed. Pseudo-files are the user's
(``<stdin>``, ``<string>``, a doctest), except the interpreter's frozen modules (``<frozen ...>``).

Framework-neutral: callers hand in file names (JAX: a traceback's code objects; torch: a node's stack trace).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import os
import site
import sys
import sysconfig
import urllib.parse
import urllib.request
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")

ENV = "FMP_USER_PACKAGES"
FRAMEWORKS = ("fmp", "jax", "jaxlib", "torch", "torchao", "numpy")
LIBRARIES = ("flax", "equinox", "haiku", "keras", "transformers", "lightning", "pytorch_lightning", "optax")
_SITE_FOLDERS = ("site-packages", "dist-packages")
_MSG_NOT_FOUND = (
    "FMP_USER_PACKAGES names {names}, which cannot be imported here, so none of its frames is taken for yours: "
    "give import names (mymodels for `import mymodels.layers`) that this interpreter finds on sys.path."
)
_FMP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _prefix(path: str) -> str:
    return os.path.join(os.path.normcase(os.path.abspath(path)), "")


def _inside(path: str, prefixes: Iterable[str]) -> bool:
    return any(path.startswith(p) for p in prefixes)


def _module_places(name: str) -> tuple[str, ...]:
    """The folders (a package) or file (a module) of an importable name, without importing a loaded-less
    top-level one; ``()`` when it is not found."""
    module = sys.modules.get(name)
    if module is not None:
        paths = list(getattr(module, "__path__", None) or ())
        origin = getattr(module, "__file__", None)
    else:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return ()
        if spec is None:
            return ()
        paths, origin = list(spec.submodule_search_locations or ()), spec.origin
    if paths:
        return tuple(_prefix(p) for p in paths)
    if origin and os.path.isabs(origin):
        return (os.path.normcase(os.path.abspath(origin)),)
    return ()


def _loaded_places(names: Sequence[str]) -> tuple[str, ...]:
    return tuple(p for n in names if n in sys.modules for p in _module_places(n))


@functools.cache
def _site_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = [paths["purelib"], paths["platlib"], *getattr(site, "getsitepackages", list)()]
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return tuple(_prefix(d) for d in dirs)


@functools.cache
def _stdlib_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple(_prefix(d) for d in {paths["stdlib"], paths["platstdlib"], os.path.dirname(os.__file__)})


@functools.cache
def editable_projects() -> tuple[str, ...]:
    """The project folders of the running environment's editable installs (PEP 610 ``direct_url.json``)."""
    found = []
    for dist in importlib.metadata.distributions():
        try:
            info = json.loads(dist.read_text("direct_url.json") or "{}")
        except (OSError, ValueError):
            continue
        url = info.get("url", "")
        if info.get("dir_info", {}).get("editable") and url.startswith("file:"):
            found.append(urllib.request.url2pathname(urllib.parse.urlparse(url).path))
    return tuple(_prefix(p) for p in found)


class Rule:
    """Tells the kind of a file; built by ``rule()`` for the working directory and the user's packages."""

    def __init__(self, cwd: str, user_packages: Sequence[str], editable: Sequence[str]) -> None:
        here = _prefix(cwd)
        self.user = tuple(p for n in user_packages for p in _module_places(n))
        missing = [n for n in user_packages if not _module_places(n)]
        if missing:
            warnings.warn(_MSG_NOT_FOUND.format(names=", ".join(missing)), stacklevel=2)
        self.framework = (_prefix(_FMP), *_loaded_places(FRAMEWORKS[1:]))
        self.library = _loaded_places(LIBRARIES)
        # another package's editable project is a library; the user's own holds the working directory or is in it
        self.editable = tuple(p for p in editable if not (here.startswith(p) or p.startswith(here)))
        self._kinds: dict[str, str] = {}

    def kind(self, filename: str) -> str:
        """``"user"``, ``"library"`` (an installed package, a model library) or ``"framework"`` (fmp, JAX,
        torch, NumPy, the standard library)."""
        known = self._kinds.get(filename)
        if known is None:
            known = self._kinds[filename] = self._kind(filename)
        return known

    def _kind(self, filename: str) -> str:
        if filename.startswith("<"):
            return "framework" if filename.startswith("<frozen ") else "user"
        path = os.path.normcase(os.path.abspath(filename))
        if _inside(path, self.user):
            return "user"
        if _inside(path, self.framework):
            return "framework"
        parts = path.split(os.sep)
        if _inside(path, self.library) or _inside(path, _site_dirs()) or any(f in parts for f in _SITE_FOLDERS):
            return "library"
        if _inside(path, _stdlib_dirs()):
            return "framework"
        return "library" if _inside(path, self.editable) else "user"


def user_packages() -> tuple[str, ...]:
    """The import names in ``FMP_USER_PACKAGES`` (comma-separated)."""
    return tuple(n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip())


def rule() -> Rule:
    """The rule for now: the working directory, ``FMP_USER_PACKAGES`` and the frameworks and libraries loaded."""
    loaded = tuple(n in sys.modules for n in (*FRAMEWORKS, *LIBRARIES))
    return _rule(os.getcwd(), user_packages(), loaded)


@functools.lru_cache(maxsize=8)
def _rule(cwd: str, names: tuple[str, ...], loaded: tuple[bool, ...]) -> Rule:
    del loaded  # part of the key only: a library imported later gets a new rule
    return Rule(cwd, names, editable_projects())


def user_frame(frames: Iterable[T], filename: Callable[[T], str], rule_: Rule | None = None) -> T | None:
    """The first of ``frames`` (innermost first) whose file is the user's, or ``None`` when none is."""
    rule_ = rule_ or rule()
    return next((f for f in frames if rule_.kind(filename(f)) == "user"), None)
