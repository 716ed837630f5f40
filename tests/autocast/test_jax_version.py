"""The tested JAX range: ``import fmp`` is silent inside it and warns once, naming it, outside it."""

from __future__ import annotations

import json
import re

import jax
import pytest
import tomllib
from _helpers.common import ROOT, run_python

from fmp._autocast._engine._jax_version import TESTED_JAX, untested_message, version_tuple


@pytest.mark.parametrize("version", ["0.10.2", "0.11.0", "0.11.2", "0.12.0", "0.12.0.1", "0.12.7"])
def test_tested_versions_give_no_warning(version: str) -> None:
    assert untested_message(version) is None


@pytest.mark.parametrize("version", ["0.13.0", "0.13.0.dev20261201", "1.0.0", "0.10.1", "0.9.2"])
def test_untested_versions_are_named_with_the_tested_range(version: str) -> None:
    msg = untested_message(version)
    assert msg is not None
    assert f"jax {version}:" in msg
    assert "tested with jax 0.10.2 through 0.12.x" in msg
    assert "jax>=0.10.2,<0.13" in msg


def test_version_tuple() -> None:
    assert version_tuple("0.12.0.1") == (0, 12, 0, 1)
    assert version_tuple("0.13.0.dev20261201") == (0, 13, 0)
    assert version_tuple("0.12.0rc1") == (0, 12, 0)


def test_installed_jax_is_a_tested_one() -> None:
    """CI runs the suite on each claimed version; an untested one here means CI installed the wrong JAX."""
    assert untested_message(jax.__version__) is None, jax.__version__


def test_pyproject_allows_exactly_the_tested_range() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    low, high = TESTED_JAX
    want = f">={'.'.join(map(str, low))},<{high[0]}.{high[1] + 1}"
    for name in ("jax", "jaxlib"):
        (spec,) = [d[len(name) :] for d in deps if re.match(rf"{name}[<>=]", d)]
        assert spec == want, (name, spec)


_IMPORT_AS = """
import json, warnings
import jax
jax.__version__ = {version!r}  # what import fmp reads
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import fmp
    import fmp.optax  # a second import of the package's modules adds nothing
    fmp.autocast(lambda x: x * 2)(jax.numpy.ones(2))
print(json.dumps([(w.category.__name__, str(w.message)) for w in caught]))
"""


@pytest.mark.parametrize(("version", "warns"), [("0.13.0", True), (jax.__version__, False)])
def test_import_warns_once_outside_the_range(version: str, warns: bool) -> None:
    caught = json.loads(run_python(_IMPORT_AS.format(version=version)).strip().splitlines()[-1])
    ours = [(cat, msg) for cat, msg in caught if "fmp is tested with jax" in msg]
    if warns:
        assert ours == [("RuntimeWarning", untested_message(version))]
    else:
        assert ours == []
