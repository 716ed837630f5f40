"""Package layout contracts: import isolation, public API, typing marker."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import fmp
from tests.helpers import ROOT, run_python, run_with_devices


def test_import_fmp_does_not_import_torch_optax_flax():
    out = run_python(
        """
        import sys
        import fmp
        heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'optax', 'flax'})
        print(heavy)
        """
    )
    assert out.strip() == "[]"


def test_all_is_sorted_and_resolves():
    assert fmp.__all__ == sorted(fmp.__all__)
    for name in fmp.__all__:
        assert getattr(fmp, name) is not None


def test_py_typed_is_shipped():
    assert (Path(fmp.__file__).parent / "py.typed").exists()


def test_core_imports_neither_jax_nor_torch():
    # The framework-neutral core must stay framework-neutral.
    for path in (ROOT / "fmp" / "_core").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in {"jax", "jaxlib", "torch", "optax", "flax"}, (path, name)


def test_imports_point_downward():
    # fmp._core never imports from the rest of fmp (no cycles through the core).
    for path in (ROOT / "fmp" / "_core").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fmp."):
                assert node.module.startswith("fmp._core"), (path, node.module)


def test_autocast_modules_form_no_cycle():
    # fmp._autocast: the interpreter core (_interp on _context and _cast, with _rows and _provenance) at the bottom; rules, handlers, the public wrappers and
    # explain stand on it. Every import inside the package (local imports included) must form a DAG.
    pkg = ROOT / "fmp" / "_autocast"
    graph: dict[str, set[str]] = {}
    for path in pkg.glob("*.py"):
        deps = graph.setdefault(path.stem, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fmp._autocast"):
                mods = [a.name for a in node.names] if node.module == "fmp._autocast" else [node.module.split(".")[2]]
                deps.update(m for m in mods if (pkg / f"{m}.py").exists())
    assert graph["_context"] <= {"_rows", "_provenance"}, graph["_context"]
    assert graph["_cast"] <= {"_context", "_jax_internals", "_lru"}, graph["_cast"]
    assert graph["_interp"] <= {"_context", "_cast", "_jax_internals", "_provenance", "_lru"}, graph["_interp"]
    assert graph["_provenance"] <= {"_lru"}, graph["_provenance"]
    assert graph["_lru"] == set(), graph["_lru"]
    _assert_no_cycle(graph)


def _assert_no_cycle(graph: dict[str, set[str]]) -> None:
    done: set[str] = set()

    def visit(mod: str, path: tuple[str, ...]) -> None:
        assert mod not in path, f"import cycle: {' -> '.join((*path[path.index(mod) :], mod))}"
        if mod not in done:
            for dep in sorted(graph[mod]):
                visit(dep, (*path, mod))
            done.add(mod)

    for mod in sorted(graph):
        visit(mod, ())


def _fmp_import_graph() -> dict[str, set[str]]:
    """``{module: fmp modules it imports}`` over every module of fmp, function-level imports included.

    ``from fmp.pkg import name`` is an edge to ``fmp.pkg.name`` when that is a module, else to ``fmp.pkg``; the
    implicit import of a parent package is not an edge (every submodule has it).
    """
    mods = {}
    for path in (ROOT / "fmp").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        deps = graph.setdefault(mod, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{mod}: relative import"
                base = node.module or ""
                deps.update(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        deps &= mods.keys() - {mod}
    return graph


def test_fmp_modules_form_no_import_cycle():
    # imports point downward across the whole package: no module imports (at the top or in a function) one
    # that imports it back, directly or through others
    graph = _fmp_import_graph()
    assert {"fmp._scaler", "fmp._flax_serialization", "fmp.torch._fx"} <= graph.keys()
    _assert_no_cycle(graph)


def test_eight_fake_devices_helper():
    out = run_with_devices(
        """
        import jax, jax.numpy as jnp
        import fmp
        from jax.sharding import NamedSharding, PartitionSpec as P
        mesh = jax.make_mesh((8,), ("d",))
        x = jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, P("d")))
        y = fmp.get_policy("mixed_bfloat16").cast_to_compute(x)
        print(jax.device_count(), y.dtype, len(y.sharding.device_set))
        """
    )
    assert out.split() == ["8", "bfloat16", "8"]


_HIDE = "import sys; sys.modules[{dep!r}] = None  # as if {dep} were not installed\n"


@pytest.mark.parametrize(("module", "dep", "how"), [
    ("fmp.torch", "torch", "install torch first with its own command (CPU build: pip install torch --index-url "
                           "https://download.pytorch.org/whl/cpu ; for a CUDA build see "
                           "https://pytorch.org/get-started/locally/), then pip install 'fmp[torch]'."),
    ("fmp.optax", "optax", "pip install 'fmp[optax]' (or pip install optax)."),
])  # fmt: skip
def test_missing_optional_dependency_says_how_to_install_it(module, dep, how):
    out = run_python(
        _HIDE.format(dep=dep)
        + f"""
try:
    import {module}
except ModuleNotFoundError as e:
    print(type(e).__name__, e.name)
    print(e)
"""
    )
    kind, msg = out.strip().split("\n", 1)
    assert kind == f"ModuleNotFoundError {dep}"
    assert msg == f"{module} needs {dep}, which is not installed: {how}"


def test_import_fmp_works_without_torch_optax_flax():
    out = run_python(
        "import sys\n"
        + "".join(_HIDE.format(dep=d) for d in ("torch", "optax", "flax"))
        + "import jax.numpy as jnp, fmp\nprint(fmp.GradScaler(init_scale=4.0).scale(jnp.float32(2.0)))\n"
    )
    assert out.strip() == "8.0"


def test_pyproject_claims_only_what_is_tested():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    import jax
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = {r.name: r for r in map(Requirement, project["dependencies"])}
    # the JAX range is the minor version tested here, and it holds the installed one
    for name in ("jax", "jaxlib"):
        assert reqs[name].specifier.contains(jax.__version__), (name, jax.__version__)
        assert not reqs[name].specifier.contains("0.11.0"), f"{name}: 0.11 is untested"
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    versions = [
        c.rsplit(" :: ", 1)[1] for c in project["classifiers"] if c.startswith("Programming Language :: Python :: 3.")
    ]
    assert py in versions, (versions, py)
    text = (ROOT / "pyproject.toml").read_text()
    assert "CUDA)" not in text and "0.11.x" not in text
    assert "Typing :: Typed" in project["classifiers"] and (ROOT / "fmp" / "py.typed").exists()
