"""GradScaler and Float8State in ``flax.serialization``, registered without a call and without importing flax.

``import fmp`` must not import flax (it is optional and slow to import), yet
``flax.serialization.to_state_dict(scaler)`` (or of a ``Float8State``) has to work whichever of the two a
program imports first. So: if ``flax.serialization`` is already imported, both are registered now; otherwise a finder on
``sys.meta_path`` waits for it and registers both right after flax has executed that module. The
finder only ever answers for ``flax.serialization``, loads it with the finder Python would have used, and
removes itself once it has fired.

orbax needs nothing: it saves any pytree, and both are ones (``jax.tree_util.register_dataclass``).
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import sys
import warnings
from types import ModuleType
from typing import Any

import jax.numpy as jnp

from fmp._fp8._state import Float8State
from fmp._scaler import GradScaler

_TARGET = "flax.serialization"

_MSG_FAILED = (
    "fmp could not register GradScaler and Float8State with flax.serialization ({err}); "
    "flax.serialization.to_state_dict will return them as they are. Save GradScaler.state_dict() and "
    "Float8State.amax_history instead, or report this flax version."
)


def _to_state_dict(s: GradScaler) -> dict[str, Any]:
    return {
        "loss_scale": s.loss_scale,
        "growth_tracker": s.growth_tracker,
        "consecutive_overflows": s.consecutive_overflows,
    }


def _from_state_dict(target: GradScaler, state: dict[str, Any]) -> GradScaler:
    return dataclasses.replace(
        target,
        loss_scale=jnp.asarray(state["loss_scale"], jnp.float32),
        growth_tracker=jnp.asarray(state["growth_tracker"], jnp.int32),
        # absent from checkpoints written before the field existed
        consecutive_overflows=jnp.asarray(state.get("consecutive_overflows", 0), jnp.int32),
    )


def _fp8_to_state_dict(s: Float8State) -> dict[str, Any]:
    return {"amax_history": s.amax_history}


def _fp8_from_state_dict(target: Float8State, state: dict[str, Any]) -> Float8State:
    return dataclasses.replace(target, amax_history=jnp.asarray(state["amax_history"], jnp.float32))


def register(serialization: ModuleType) -> None:
    """Registers GradScaler and Float8State with the given ``flax.serialization`` module (idempotent)."""
    serialization.register_serialization_state(GradScaler, _to_state_dict, _from_state_dict, override=True)
    serialization.register_serialization_state(Float8State, _fp8_to_state_dict, _fp8_from_state_dict, override=True)


class _RegisteringLoader(importlib.abc.Loader):
    """Wraps the real loader of ``flax.serialization``: executes the module, then registers fmp's classes."""

    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        try:
            register(module)
        except Exception as err:  # a flax API change must not break importing flax
            warnings.warn(_MSG_FAILED.format(err=f"{type(err).__name__}: {err}"), RuntimeWarning, stacklevel=2)

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


def install() -> None:
    """Registers now if ``flax.serialization`` is imported, else when it is."""
    if _TARGET in sys.modules:
        register(sys.modules[_TARGET])
    elif _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


install()
