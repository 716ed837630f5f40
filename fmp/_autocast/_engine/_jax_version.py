"""The JAX releases fmp is tested with, and the one warning ``import fmp`` gives outside them."""

from __future__ import annotations

import re
import warnings

# The JAX releases CI tests (docs/installation.md has the table): the oldest release and the newest minor version.
# pyproject.toml allows exactly this range; a JAX outside it (installed by hand, or a release newer than the
# package) works as far as the internals ``_jax_internals`` uses still hold, and importing fmp says so once.
TESTED_JAX = ((0, 10, 2), (0, 12))

_MSG_UNTESTED = (
    "fmp is tested with jax {low} through {high}.x and this is jax {version}: fmp.autocast rewrites jaxprs through "
    "JAX internals, which a release outside that range may have changed (an error then names the primitive it "
    "could not rewrite). Install jax>={low},<{next_minor} for a tested combination."
)


def version_tuple(version: str) -> tuple[int, ...]:
    """``"0.12.0.1"`` -> ``(0, 12, 0, 1)``; a pre-release tail is dropped (``"0.13.0.dev2026"`` -> ``(0, 13, 0)``)."""
    out: list[int] = []
    for part in version.split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        out.append(int(digits.group()))
        if digits.group() != part:
            break
    return tuple(out)


def untested_message(version: str) -> str | None:
    """The warning for JAX ``version``; None for a tested one."""
    low, high = TESTED_JAX
    v = version_tuple(version)
    if low <= v and v[:2] <= high:
        return None
    return _MSG_UNTESTED.format(
        low=".".join(map(str, low)),
        high=".".join(map(str, high)),
        version=version,
        next_minor=f"{high[0]}.{high[1] + 1}",
    )


def warn_if_untested(version: str) -> None:
    """Warns (``RuntimeWarning``) when ``version`` is outside the tested range; called once, at import."""
    msg = untested_message(version)
    if msg is not None:
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
