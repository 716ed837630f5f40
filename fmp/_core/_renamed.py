"""Names renamed to one spelling (``float8``): the old ones keep working for one release and warn."""

from __future__ import annotations

import warnings
from typing import Any

_MSG_RENAMED = "{old} is deprecated and will be removed in the next release: use {new} (the same meaning)."

NOT_GIVEN: Any = type("NotGiven", (), {"__repr__": lambda self: "NOT_GIVEN"})()  # an argument left out


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warns that ``old`` is the deprecated name of ``new`` (a DeprecationWarning naming both)."""
    warnings.warn(_MSG_RENAMED.format(old=old, new=new), DeprecationWarning, stacklevel=stacklevel)


def renamed_argument(new_value: Any, old_value: Any, old: str, new: str, *, stacklevel: int = 4) -> Any:
    """The value of an argument passed by its new name or, with a warning, by its old one (``old_value`` is
    ``NOT_GIVEN`` when the old name was left out). ``old``/``new`` say how each is spelled in a call
    (``"fmp.autocast(fp8_state=...)"``); both given is a TypeError. ``stacklevel`` 4 points the warning at the
    caller of the function that calls this."""
    if old_value is NOT_GIVEN:
        return new_value
    if new_value is not None:
        raise TypeError(f"{new} and {old} (its deprecated name) are both given: pass {new} only")
    warn_renamed(old, new, stacklevel=stacklevel)
    return old_value
