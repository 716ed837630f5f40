"""Dtype facts live in one framework-neutral module; JAX and torch agree with every number in it."""

from __future__ import annotations

import ast

import jax.numpy as jnp
import pytest
from _helpers.common import ROOT, run_python

import fmp
from fmp._core import _dtypes

NARROW = ["float16", "bfloat16", _dtypes.E4M3, _dtypes.E5M2]


@pytest.mark.parametrize("name", NARROW)
def test_limits_match_jax(name):
    assert _dtypes.MAX_FINITE[name] == float(jnp.finfo(name).max)


@pytest.mark.parametrize("name", [*NARROW, "float32", "float64"])
def test_unit_roundoff_is_half_the_machine_epsilon(name):
    assert _dtypes.UNIT_ROUNDOFF[name] == float(jnp.finfo(name).eps) / 2


@pytest.mark.parametrize("name", [*NARROW, "float32", "float64"])
def test_limits_and_roundoffs_match_torch(name):
    torch = pytest.importorskip("torch")  # Python 3.12 and 3.13 CI run without torch
    info = torch.finfo(getattr(torch, name))
    assert _dtypes.UNIT_ROUNDOFF[name] == info.eps / 2
    if name in NARROW:
        assert _dtypes.MAX_FINITE[name] == info.max


@pytest.mark.parametrize("name", sorted(_dtypes.FORMAT_BITS))
def test_format_bits(name):
    info = jnp.finfo(name)
    assert _dtypes.FORMAT_BITS[name] == (info.nexp, info.nmant)


def test_groups_and_scales():
    assert _dtypes.BELOW_FLOAT32 == _dtypes.LOW_PRECISION | set(_dtypes.FLOAT8)
    assert _dtypes.LOW_PRECISION < _dtypes.CASTABLE
    tiny = float(jnp.finfo(jnp.float32).tiny)  # the smallest normal float32
    assert tiny <= _dtypes.SCALE_MIN and 1 / _dtypes.SCALE_MAX >= tiny and _dtypes.SCALE_MIN * _dtypes.SCALE_MAX == 1
    assert fmp.GradScaler().init_scale == _dtypes.INIT_SCALE


def test_initial_scale_is_torchs():
    torch = pytest.importorskip("torch")
    assert _dtypes.INIT_SCALE == torch.amp.GradScaler("cpu").get_scale()


def test_core_dtypes_imports_no_framework():
    # the file alone (``import fmp._core._dtypes`` would run ``fmp/__init__``, which imports JAX)
    out = run_python(
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('dtypes', 'fmp/_core/_dtypes.py')\n"
        "module = sys.modules['dtypes'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "print(sorted(m for m in ('fmp', 'jax', 'torch', 'numpy', 'ml_dtypes') if m in sys.modules))"
    )
    assert out.strip() == "[]"


def _imports(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            yield from ((a.name, []) for a in node.names)


def test_torch_side_reads_dtype_facts_from_the_core():
    """No torch module takes a float8 name, limit or scale bound from the JAX float8 math (the recipe, a
    plain dataclass, and the block-scaled arithmetic the FX pass runs on purpose are not dtype facts)."""
    facts = {"E4M3", "E5M2", "SCALE_MIN", "SCALE_MAX", "float8_max", "F32"}
    seen = {}
    for path in sorted((ROOT / "fmp" / "torch").rglob("*.py")):
        for module, names in _imports(path):
            if module.startswith("fmp._float8"):
                seen[(path.relative_to(ROOT).as_posix(), module)] = names
    assert seen, "the FX float8 pass takes its recipe from fmp._float8._recipe"
    assert "fmp._float8._quant" not in {module for _, module in seen}, seen
    assert not {n for names in seen.values() for n in names} & facts, seen
    scaled_mm = dict(_imports(ROOT / "fmp" / "torch" / "_fx" / "_scaled_mm.py"))
    assert set(scaled_mm["fmp._core._dtypes"]) >= {"E4M3", "E5M2", "SCALE_MIN", "SCALE_MAX"}
