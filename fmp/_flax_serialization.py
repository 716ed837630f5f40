"""fmp's pytree classes in ``flax.serialization``, registered without a call and without importing flax.

``import fmp`` must not import flax (it is optional and slow to import), yet
``flax.serialization.to_state_dict(scaler)`` has to work whichever of the two a program imports first. So a
class hands its two functions to ``register_type`` when it is defined:
if ``flax.serialization`` is already imported, it is registered now; otherwise a finder on ``sys.meta_path``
waits for that module and registers every handed class right after flax has executed it. The finder only
ever answers for ``flax.serialization``, loads it with the finder Python would have used, and removes itself
once it has fired.

This module imports nothing from fmp: the classes import it (``GradScaler``, ``Float8State``), never the
other way round. orbax needs nothing: it saves any pytree.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

_TARGET = "flax.serialization"

_MSG_FAILED = (
    "fmp could not register {cls} with flax.serialization ({err}); flax.serialization.to_state_dict "
    "will return the object itself. {fix}"
)

# class -> (to_state_dict, from_state_dict, what to save instead if flax refuses the registration)
_TYPES: dict[type, tuple[Callable[[Any], dict[str, Any]], Callable[[Any, dict[str, Any]], Any], str]] = {}


def register_type(
    cls: type,
    to_state_dict: Callable[[Any], dict[str, Any]],
    from_state_dict: Callable[[Any, dict[str, Any]], Any],
    fix: str,
) -> None:
    """Registers ``cls`` with ``flax.serialization`` now if it is imported, else as soon as it is.

    ``fix`` ends the warning given if flax refuses the registration (what to save instead).
    """
    _TYPES[cls] = (to_state_dict, from_state_dict, fix)
    if _TARGET in sys.modules:
        _register(sys.modules[_TARGET], cls)
    elif _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def register_now(cls: type) -> None:
    """Registers ``cls`` with ``flax.serialization``, importing flax.

    ``cls`` or a base class of it must have been handed to ``register_type``; a subclass gets its base's
    functions (flax looks classes up by exact type).
    """
    _register(importlib.import_module(_TARGET), cls)


def _register(serialization: ModuleType, cls: type) -> None:
    base = next(c for c in cls.__mro__ if c in _TYPES)
    to_state_dict, from_state_dict, _ = _TYPES[base]
    serialization.register_serialization_state(cls, to_state_dict, from_state_dict, override=True)


class _RegisteringLoader(importlib.abc.Loader):
    """Wraps the real loader of ``flax.serialization``: executes the module, then registers the classes."""

    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        for cls, (_, _, fix) in list(_TYPES.items()):
            try:
                _register(module, cls)
            except Exception as err:  # a flax API change must not break importing flax
                err_text = f"{type(err).__name__}: {err}"
                warnings.warn(_MSG_FAILED.format(cls=cls.__name__, err=err_text, fix=fix), RuntimeWarning, stacklevel=2)

    def __getattr__(self, name: str) -> Any:  # get_data, get_resource_reader, ... of the real loader
        return getattr(self._loader, name)


class _FlaxSerializationFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        uninstall()
        spec = None
        for finder in list(sys.meta_path):  # the finders Python would have asked, in its order
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _RegisteringLoader(spec.loader)
        return spec


_finder = _FlaxSerializationFinder()


def uninstall() -> None:
    while _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
