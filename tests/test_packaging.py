"""Package layout contracts: import isolation, public API, typing marker."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from _helpers.common import ROOT, run_python, run_with_devices

import fmp


def test_import_fmp_does_not_import_torch_optax_flax_matplotlib():
    out = run_python(
        """
        import sys
        import fmp
        heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'optax', 'flax', 'matplotlib'})
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


_FRAMEWORKS = {"jax", "jaxlib", "torch", "optax", "flax"}


def _imports(path: Path) -> list[str]:
    """The modules ``path`` imports, function-level imports included."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            names += [f"{base}.{a.name}" for a in node.names] if base.startswith("fmp") else [base]
    return names


@pytest.mark.parametrize("folder", ["_core", "_report", "_plan"])
def test_framework_neutral_rooms_import_neither_jax_nor_torch(folder):
    # the rule table, the scaler rule and the comparison core serve both frameworks
    for path in (ROOT / "fmp" / folder).glob("*.py"):
        for name in _imports(path):
            assert name.split(".")[0] not in _FRAMEWORKS, (path, name)


@pytest.mark.parametrize(
    ("folder", "allowed"),
    [
        ("_core", ("fmp._core",)),  # the bottom: nothing else of fmp
        ("_report", ("fmp._core", "fmp._report")),
        ("_plan", ("fmp._core", "fmp._report", "fmp._plan")),  # chooses beside the report, measures nothing
        # the interpreter imports nothing of the transform above it (handlers, leaf rules, explain)
        ("_autocast/_engine", ("fmp._core", "fmp._report", "fmp._policy", "fmp._float8", "fmp._autocast._engine")),
    ],
)
def test_imports_point_downward(folder, allowed):
    for path in (ROOT / "fmp" / folder).rglob("*.py"):
        for name in _imports(path):
            if name.startswith("fmp"):
                assert name.startswith(allowed), (path, name)


def test_autocast_rooms_stand_on_each_other_in_order():
    # _engine <- _hops <- the transform's own modules <- _explain: no room imports one above it
    order = ["_engine", "_hops", "", "_explain"]
    pkg = ROOT / "fmp" / "_autocast"
    for level, room in enumerate(order):
        paths = pkg.glob("*.py") if room == "" else (pkg / room).glob("*.py")
        above = [r for r in order[level + 1 :] if r]
        for path in paths:
            if path.name == "__init__.py" and room == "":
                continue  # the package's face re-exports explain
            for name in _imports(path):
                for r in above:
                    assert not name.startswith(f"fmp._autocast.{r}"), (path, name)
                if room in ("_engine", "_hops"):
                    parts = name.split(".")
                    top_level = len(parts) >= 3 and parts[:2] == ["fmp", "_autocast"] and parts[2] not in order
                    assert not top_level, (path, name)


def test_fx_rewrite_side_never_imports_its_explain_room():
    # torch/_fx: trace, rewrite, casts, values, float8 and prepare below; explain and compare (_explain/) on them
    pkg = ROOT / "fmp" / "torch" / "_fx"
    for path in pkg.glob("*.py"):
        for name in _imports(path):
            assert not name.startswith("fmp.torch._fx._explain"), (path, name)
    room = {n for path in (pkg / "_explain").glob("*.py") for n in _imports(path) if n.startswith("fmp.torch._fx.")}
    assert {n.split(".")[3] for n in room} <= {"_common", "_float8", "_nested", "_prepare", "_explain"}, room
    # the runs below the comparison: _runner imports neither _compare nor _api
    runner = _imports(pkg / "_explain" / "_runner.py")
    assert not [n for n in runner if n.startswith("fmp.torch._fx._explain")], runner


def test_autocast_engine_forms_no_cycle():
    # the interpreter (_interp on _context and _cast, with _rows, _provenance and its _frames) at the bottom
    pkg = ROOT / "fmp" / "_autocast" / "_engine"
    graph = {
        path.stem: {n.split(".")[3] for n in _imports(path) if n.startswith("fmp._autocast._engine.")}
        for path in pkg.glob("*.py")
    }
    graph.pop("__init__")
    for folder in (p for p in pkg.iterdir() if (p / "__init__.py").exists()):  # a folder is one node
        inside = (n for path in folder.glob("*.py") for n in _imports(path))
        graph[folder.name] = {n.split(".")[3] for n in inside if n.startswith("fmp._autocast._engine.")} - {folder.name}
    assert graph["_context"] <= {"_rows", "_provenance", "_frames"}, graph["_context"]
    assert graph["_cast"] <= {"_context", "_jax_internals", "_lru"}, graph["_cast"]
    interp = {"_context", "_cast", "_jax_internals", "_provenance", "_frames", "_lru", "_weights"}
    assert graph["_interp"] <= interp, graph["_interp"]
    assert graph["_weights"] <= {"_provenance", "_frames", "_jax_internals"}, graph["_weights"]  # the float8 scope
    assert graph["_provenance"] <= {"_frames", "_lru", "_dims", "_jax_internals"}, graph["_provenance"]
    assert graph["_frames"] <= {"_lru", "_jax_internals"}, graph["_frames"]  # a frame of the walks, and its caches
    # JAX's internals, each difference between its releases: a leaf but for the tested range it warns about
    assert graph["_jax_internals"] <= {"_jax_version"}, graph["_jax_internals"]
    assert graph["_jax_version"] == set(), graph["_jax_version"]
    assert graph["_lru"] == set(), graph["_lru"]
    assert graph["_dims"] == set(), graph["_dims"]  # dimension arithmetic of a dot_general: a leaf module
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
    assert {"fmp._scaling._scaler", "fmp._flax_serialization", "fmp.torch._fx._api"} <= graph.keys()
    _assert_no_cycle(graph)


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


@pytest.mark.parametrize("module", ["fmp.torch._autocast", "fmp.torch._custom", "fmp.torch._scaler._grad_scaler",
                                    "fmp.torch._scaler._sharded", "fmp.torch.cuda.amp", "fmp.torch.fp16_utils"])  # fmt: skip
def test_eager_torch_facade_does_not_import_the_fx_passes(module):
    reached = _reach(_fmp_import_graph(), module)
    assert not {m for m in reached if m.startswith("fmp.torch._fx")}, sorted(reached)


def _private_names_across_files() -> list[str]:
    """``from fmp.x import _name`` or ``module._name`` where ``_name`` is not a module: a private name that
    crosses a file boundary."""
    mods = {}
    for path in (ROOT / "fmp").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    bad = []
    for path in mods.values():
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fmp"):
                for a in node.names:
                    if f"{node.module}.{a.name}" in mods:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                    elif a.name.startswith("_"):
                        bad.append(f"{path.name}:{node.lineno} imports {a.name} from {node.module}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                full = f"{aliases[node.value.id]}.{node.attr}"
                if node.attr.startswith("_") and not node.attr.startswith("__") and full not in mods:
                    bad.append(f"{path.name}:{node.lineno} uses {node.value.id}.{node.attr}")
    return bad


def test_each_folder_is_one_subsystem_of_at_most_twelve_modules():
    # a reader sees the architecture in `ls`: a folder per subsystem, not prefixes in a flat folder
    for folder in [ROOT / "fmp", *(p for p in (ROOT / "fmp").rglob("*") if p.is_dir() and p.name != "__pycache__")]:
        modules = [p.name for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= 12, (folder, sorted(modules))


def test_no_private_name_crosses_a_file_boundary():
    assert _private_names_across_files() == []


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
                           "https://pytorch.org/get-started/locally/), then pip install 'jax-fmp[torch]'."),
    ("fmp.optax", "optax", "pip install 'jax-fmp[optax]' (or pip install optax)."),
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
    from packaging.version import Version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = {r.name: r for r in map(Requirement, project["dependencies"])}
    # the JAX range runs from the oldest version that CI pins (.ci/constraints-py3.*.txt) to the newest pinned
    # minor version, and it holds the installed one
    pinned = {
        name: sorted(
            (
                Version(v)
                for f in (ROOT / ".ci").glob("constraints-py3.*.txt")
                for v in re.findall(rf"^{name}==(\S+)$", f.read_text(), re.M)
            ),
        )  # fmt: skip
        for name in ("jax", "jaxlib")
    }
    for name, versions in pinned.items():
        assert len(versions) == 3, (name, versions)  # one per Python version that CI runs
        spec = reqs[name].specifier
        assert spec.contains(jax.__version__) and all(spec.contains(v) for v in versions), (name, spec, versions)
        assert not spec.contains(f"{versions[0].major}.{versions[0].minor}.{versions[0].micro - 1}"), (name, spec)
        newest = versions[-1]
        assert not spec.contains(f"{newest.major}.{newest.minor + 1}.0"), f"{name}: {spec} claims an untested minor"
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    versions = [
        c.rsplit(" :: ", 1)[1] for c in project["classifiers"] if c.startswith("Programming Language :: Python :: 3.")
    ]
    assert py in versions, (versions, py)
    text = (ROOT / "pyproject.toml").read_text()
    assert "CUDA)" not in text and "0.11.x" not in text
    assert "Typing :: Typed" in project["classifiers"] and (ROOT / "fmp" / "py.typed").exists()


DIST = "jax-fmp"  # the distribution's name; the import name is fmp
_NOT_SOURCE = (".git", "site", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", "*out")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The sdist and the wheel, built from a copy of the tree with the installed setuptools (no isolated build
    env: a few seconds); .ci/run builds them again with ``python -m build`` and installs the wheel."""
    src = tmp_path_factory.mktemp("src") / "tree"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*_NOT_SOURCE))
    out = src.parent / "out"
    build = f"from setuptools import build_meta as b; b.build_sdist({str(out)!r}); b.build_wheel({str(out)!r})"
    proc = subprocess.run([sys.executable, "-c", build], cwd=src, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (sdist,), (wheel,) = out.glob("*.tar.gz"), out.glob("*.whl")
    with tarfile.open(sdist) as tar:
        sdist_files = {n.split("/", 1)[1]: n for n in tar.getnames() if "/" in n}
        sdist_license = tar.extractfile(sdist_files["LICENSE"]).read().decode()
    with zipfile.ZipFile(wheel) as zf:
        wheel_files = {n: zf.read(n).decode() for n in zf.namelist() if ".dist-info/" in n}
    return sdist.name, sdist_files, sdist_license, wheel.name, wheel_files


def test_artifacts_are_named_for_the_distribution(built):
    sdist, _, _, wheel, files = built
    assert sdist == f"jax_fmp-{fmp.__version__}.tar.gz" and wheel == f"jax_fmp-{fmp.__version__}-py3-none-any.whl"
    meta = files[f"jax_fmp-{fmp.__version__}.dist-info/METADATA"]
    assert f"\nName: {DIST}\n" in meta and "\nAuthor: fmp developers\n" in meta
    assert "Project-URL" not in meta, "no public address exists yet: the metadata must not invent one"


def test_license_is_in_the_sdist_and_the_wheel(built):
    _, _, sdist_license, _, files = built
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert sdist_license == text
    assert files[f"jax_fmp-{fmp.__version__}.dist-info/licenses/LICENSE"] == text
    meta = files[f"jax_fmp-{fmp.__version__}.dist-info/METADATA"]
    assert "\nLicense-Expression: Apache-2.0\n" in meta and "\nLicense-File: LICENSE\n" in meta


def test_sdist_ships_no_tests_they_need_the_repository(built):
    # the tests run examples/, docs/, bench/ and .ci/ files, which the sdist does not carry
    _, sdist_files, _, _, _ = built
    assert not [n for n in sdist_files if n.startswith(("tests/", "examples/", "docs/", "bench/"))]
    assert {"LICENSE", "pyproject.toml", "PKG-INFO", "fmp/__init__.py", "fmp/py.typed"} <= set(sdist_files)


def test_index_description_has_no_repository_links_and_its_snippet_runs(built):
    """The wheel's description (the index page) is DESCRIPTION.md: links to repository files would be dead
    there, and its code snippet runs."""
    text = (ROOT / "DESCRIPTION.md").read_text()
    meta = built[4][f"jax_fmp-{fmp.__version__}.dist-info/METADATA"]
    assert meta.split("\n\n", 1)[1].strip() == text.strip()
    assert not re.findall(r"\]\((?!https://)[^)]*\)", text), "a relative link is dead on an index page"
    assert "pip install fmp" not in text and f"`{DIST}`" in text
    block, debugger = re.findall(r"```python\n(.*?)```", text, re.S)  # the debugger's: tests/docs/test_first_page.py
    assert "fmp.explain(" in debugger
    ns: dict = {}
    exec(compile(block, "DESCRIPTION.md", "exec"), ns)  # noqa: S102
    import jax.numpy as jnp

    x = jnp.ones((4, 8))
    params, scaler, loss = ns["train_step"]({"w": jnp.zeros((8, 1))}, fmp.GradScaler(), x, x[:, :1])
    assert params["w"].dtype == jnp.float32 and float(loss) == 1.0, (params, loss)
    scale, moved = float(scaler.loss_scale), float(jnp.abs(params["w"]).max())
    # a step (w moves by lr * 2), or a step skipped on overflow with the scale halved
    assert (scale == 2.0**16 and abs(moved - 0.2) < 1e-3) or (scale == 2.0**15 and moved == 0.0), (scale, moved)


def test_users_are_told_the_distribution_name():
    # every "pip install" of the project names the distribution (or a checkout), never the index's other "fmp"
    other_fmp = re.compile(r"""(^|[\s'"])fmp($|[\s\['"])""")
    texts = [ROOT / "README.md", ROOT / "DESCRIPTION.md", ROOT / "pyproject.toml", ROOT / "fmp" / "_core" / "_optional.py",
             *(ROOT / "docs").rglob("*.md")]  # fmt: skip
    for path in texts:
        for cmd in re.findall(r"pip install [^\n`]*", path.read_text()):
            assert not other_fmp.search(cmd.split("#")[0].removeprefix("pip install ")), (path, cmd)
    assert f'name = "{DIST}"' in (ROOT / "pyproject.toml").read_text()


def test_tested_versions_table_matches_ci_and_the_claims():
    """docs/installation.md's table: one row per Python that .ci/run tests (the main run on 3.11, then
    jax_suite's venvs), the same Pythons as the classifiers, and the first row holds the lower bounds."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    page = (ROOT / "docs" / "installation.md").read_text()
    rows = [[c.strip() for c in r.split("|")[1:-1]] for r in re.findall(r"^\| 3\.\d+ \|.*\|$", page, re.M)]
    table = {r[0]: r[1:] for r in rows}
    ci = (ROOT / ".ci" / "run").read_text()
    assert list(table) == ["3.11", *re.findall(r"^jax_suite (3\.\d+)$", ci, re.M)], list(table)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    classified = [
        c.rsplit(" :: ", 1)[1] for c in project["classifiers"] if c.startswith("Programming Language :: Python :: 3.")
    ]
    assert classified == list(table)
    assert project["requires-python"] == f">={list(table)[0]}"
    deps = [Requirement(r) for r in project["dependencies"]]
    deps += [Requirement(r) for key in ("optax", "flax") for r in project["optional-dependencies"][key]]
    lowest = {r.name: next(s.version for s in r.specifier if s.operator == ">=") for r in deps}
    first = dict(zip(("jax", "numpy", "flax", "optax"), table["3.11"], strict=False))
    assert lowest["jax"] == lowest["jaxlib"] == first["jax"]
    assert first["numpy"].startswith(lowest["numpy"] + ".")
    assert (lowest["flax"], lowest["optax"]) == (first["flax"], first["optax"])
    # each row is what CI pins for that Python's venv (.ci/constraints-py3.1x.txt)
    for python, cells in table.items():
        name = f"constraints-py{python}.txt"
        pins = dict(re.findall(r"^([\w-]+)==(\S+)$", (ROOT / ".ci" / name).read_text(), re.M))
        row = dict(zip(("jax", "numpy", "flax", "optax"), cells, strict=False))
        assert {k: pins.get(k) for k in row} == row, (python, name)
        assert pins["jaxlib"] == pins["jax"], name
    assert 'export PIP_CONSTRAINT="$root/.ci/constraints-py$1.txt"' in ci


def test_torch_extra_claims_the_tested_releases():
    """The torch extra's lower bound is the oldest release the rule table was read from; CI pins the oldest
    (the Python 3.11 row) and the newest (a constraints-torch file of its own, in a stage of .ci/run)."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    from fmp._core._rules_data import TORCH_RELEASES
    from fmp._core._torch_releases import release_of

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (torch_req,) = map(Requirement, project["optional-dependencies"]["torch"])
    oldest, newest = TORCH_RELEASES[0], TORCH_RELEASES[-1]
    assert str(torch_req.specifier) == f">={oldest[0]}.{oldest[1]}"

    def pinned(name):
        return release_of(re.search(r"^torch==(\S+)$", (ROOT / ".ci" / name).read_text(), re.M).group(1))

    assert pinned("constraints-py3.11.txt") == oldest
    newest_file = f"constraints-torch{newest[0]}.{newest[1]}.txt"
    assert pinned(newest_file) == newest
    ci = (ROOT / ".ci" / "run").read_text()
    assert f'export PIP_CONSTRAINT="$root/.ci/{newest_file}"' in ci
    page = (ROOT / "docs" / "installation.md").read_text()
    for major, minor in TORCH_RELEASES:
        assert re.search(rf"^\| {major}\.{minor}\.\d+ \|", page, re.M), f"docs/installation.md: no {major}.{minor}"


def _ci_function(name: str) -> str:
    """The text of shell function ``name`` as .ci/run defines it (from ``name() {`` to its closing ``}``)."""
    ci = (ROOT / ".ci" / "run").read_text()
    match = re.search(rf"^{name}\(\) \{{\n.*?^\}}\n", ci, re.M | re.S)
    assert match, f".ci/run defines no function {name}"
    return match.group(0)


def _leave_venv(tmp_path: Path, setup: str) -> dict[str, str]:
    """Runs .ci/run's ``leave_venv`` in bash (as the script runs: ``set -euo pipefail``) after ``setup``;
    returns VIRTUAL_ENV and PATH afterwards."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    steps = ["set -euo pipefail", _ci_function("leave_venv"), setup, "leave_venv"]
    script = "\n".join([*steps, 'echo "VIRTUAL_ENV=${VIRTUAL_ENV:-}"', 'echo "PATH=$PATH"'])
    env = {"HOME": str(tmp_path), "VIRTUAL_ENV": str(venv), "PATH": f"{venv}/bin:/usr/bin:/bin"}
    # A `deactivate` on PATH that fails as pyenv's shim does when run rather than sourced.
    shim = tmp_path / "shims"
    shim.mkdir()
    (shim / "deactivate").write_text("#!/bin/sh\necho 'deactivate must be sourced' >&2\nexit 1\n")
    (shim / "deactivate").chmod(0o755)
    env["PATH"] = f"{env['PATH']}:{shim}"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, check=True)
    return dict(line.split("=", 1) for line in out.stdout.splitlines())


def test_ci_leaves_a_venv_inherited_from_its_caller(tmp_path):
    """CI started from inside an activated venv: only VIRTUAL_ENV and PATH came along, no `deactivate`
    function; the venv is left all the same (VIRTUAL_ENV cleared, its bin/ off PATH, the rest of PATH kept)."""
    got = _leave_venv(tmp_path, "")
    assert got["VIRTUAL_ENV"] == ""
    assert got["PATH"].split(":") == ["/usr/bin", "/bin", str(tmp_path / "shims")]


def test_ci_leaves_a_venv_it_activated_through_its_deactivate(tmp_path):
    """A venv activated in the script's own shell is left by its own `deactivate` function."""
    setup = 'deactivate() { echo "own deactivate" >&2; unset VIRTUAL_ENV; PATH=/bin; }'
    got = _leave_venv(tmp_path, setup)
    assert got == {"VIRTUAL_ENV": "", "PATH": "/bin"}
