"""Every example runs end to end in its fast mode, in a fresh process, and prints its key line."""

from __future__ import annotations

import ast
import concurrent.futures
import importlib.util
import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest
from _helpers.common import ROOT


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("XLA_FLAGS", None)
    return env


# The default-suite runs: script and arguments. In a plain pytest run, the runs that the selected tests read all
# start on first use, two at a time (much of each run is single-threaded import and compile time); under
# pytest-xdist each run starts when its test asks for it (the workers are the parallelism, and a worker that
# started every run would repeat the other worker's). Each test reads its own run's output.
FAST = {
    "loss_function": ("loss_function.py", "--fast"),
    "optax_chain": ("optax_chain.py", "--fast"),
    "flax_nnx": ("flax_nnx.py", "--fast"),
    "flax_linen": ("flax_linen.py", "--fast"),
    "sharding": ("sharding.py", "--fast"),
    "torch_facade": ("torch_facade.py", "--fast"),
    "torch_fx": ("torch_fx.py", "--fast"),
    "apex_migration": ("apex_migration.py", "--fast"),
    "accumulation": ("accumulation.py", "--fast"),
    # growth every 20 steps: the scale doubles on the last of the 60 steps, after the last step it plots; the
    # story itself (float16 without scaling stuck at the average digit) needs the full run: test_main_default_run
    "main": (
        "main.py",
        "--steps",
        "60",
        "--growth-interval",
        "20",
        "--checks",
        "2",
        "--runs",
        "float32,float16+scaling,float16",
        "--no-plot",
        "--quiet",
    ),  # fmt: skip
}
_TORCH_RUNS = {
    "torch_facade",
    "torch_fx",
    "apex_migration",
    "migration/torch_amp",
    "migration/apex",
    "migration/torchao",
}
_futures: dict[str, concurrent.futures.Future] = {}
_pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
_prefetch: list[str] = []  # the runs to start on first use


@pytest.fixture(scope="module", autouse=True)
def _stop_pending_runs(request):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        _prefetch[:] = _runs_read_by(request.session.items)
    yield
    for future in _futures.values():  # a run that did not start is not kept as cancelled
        future.cancel()
    concurrent.futures.wait(_futures.values())
    for name in [n for n, f in _futures.items() if f.cancelled()]:
        del _futures[name]


def _runs_read_by(items: list[pytest.Item]) -> list[str]:
    """The runs that the selected tests of this module read with ``_out("name")`` (a gallery run reads one)."""
    module = sys.modules[__name__]
    names = [
        name
        for item in items
        if isinstance(item, pytest.Function) and item.module is module
        for name in re.findall(r'_out\("([^"]+)"', inspect.getsource(item.function))
    ]
    return list(dict.fromkeys(names))


def _start(name: str, timeout: float) -> concurrent.futures.Future:
    if name.startswith("migration/"):
        return _pool.submit(_run_migration, name.removeprefix("migration/"), timeout=timeout)
    script, *args = FAST[name]
    return _pool.submit(_run, script, *args, timeout=timeout)


def _out(name: str, timeout: float = 300) -> str:
    if not _futures:
        has_torch = _has_torch()
        for key in _prefetch:
            if has_torch or key not in _TORCH_RUNS:
                _futures[key] = _start(key, timeout)
    if name not in _futures:
        _futures[name] = _start(name, timeout)
    return _futures[name].result()


# The migration pages' before/after listings (examples/migration/<name>_before.py, <name>_after.py), both run
# in one process. apex is not installable here: its listing runs with ``apex.fp16_utils`` resolving to
# ``fmp.torch.fp16_utils``, which is exactly step 1 of that page (change the import, nothing else).
MIGRATIONS = {
    "torch_amp": "",
    "jmp": "",
    "flax": "",
    "torchao": "",
    "apex": "import fmp.torch.fp16_utils\nsys.modules['apex'] = types.ModuleType('apex')\n"
    "sys.modules['apex.fp16_utils'] = fmp.torch.fp16_utils",
}
_PAIR = """
import runpy, sys, types
{alias}
for part in ('before', 'after'):
    print('=== ' + part, flush=True)
    sys.argv = [part]
    runpy.run_path('examples/migration/{name}_' + part + '.py', run_name='__main__')
"""


def _run_migration(name: str, timeout: float) -> tuple[str, str]:
    code = _PAIR.format(name=name, alias=MIGRATIONS[name])
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=timeout, cwd=ROOT
    )
    assert proc.returncode == 0, f"migration {name} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    _, before, after = proc.stdout.split("=== ")
    return before, after


def _losses(out: str) -> list[float]:
    return [float(v) for v in re.findall(r"loss ([0-9.e-]+)", out)]


# the torch examples skip, with this reason, where torch is not installed (the JAX-only CI venvs)
def _has_torch() -> bool:
    try:  # tests/conftest.py's finder raises where only the tests/torch folder would be found
        return importlib.util.find_spec("torch") is not None
    except ModuleNotFoundError:
        return False


needs_torch = pytest.mark.skipif(not _has_torch(), reason="needs torch, not installed")


@pytest.mark.gallery  # a full torch training comparison (about 30 s): with the galleries
@needs_torch
def test_migration_torch_amp_is_bit_for_bit():
    """One import changed: fmp.torch computes exactly what torch.amp does (same losses, to the last bit)."""
    before, after = _out("migration/torch_amp")
    assert "import torch.amp as amp" in (ROOT / "examples/migration/torch_amp_before.py").read_text()
    assert before.splitlines()[1:] == after.splitlines()[1:], (before, after)
    assert _final(after, "train accuracy") > 90


def test_migration_jmp():
    """fmp.autocast + GradScaler trains like jmp's cast-everything policy + DynamicLossScale."""
    before, after = _out("migration/jmp")
    b, a = _losses(before), _losses(after)
    assert len(b) == len(a) == 5 and b[0] == a[0], (before, after)
    assert all(abs(x - y) <= 0.05 * x for x, y in zip(b, a, strict=True)), (before, after)
    assert a[-1] < 0.05 * a[0] and _final(after, "train accuracy") > 95


def test_migration_flax_dynamic_scale():
    """fmp.GradScaler in place of flax's DynamicScale: the same gradients, so the same training curve."""
    before, after = _out("migration/flax")
    b, a = _losses(before), _losses(after)
    # printed to 4 decimals: equal, or (jaxlib 0.11+ compiles the two steps' multiply-adds differently) one unit
    # of the last printed place apart
    assert len(b) == len(a) == 5 and b[0] == a[0], (before, after)
    assert all(abs(x - y) <= 1.5e-4 for x, y in zip(b[:4], a[:4], strict=True)), (before, after)
    assert abs(b[-1] - a[-1]) <= 0.05 * b[-1], (before, after)
    assert _final(after, "train accuracy") > 95


@needs_torch
def test_migration_torchao_is_bit_for_bit():
    """The conversion line changed: autocast_fx with torchao's rowwise recipe prints torchao's losses to the last bit."""
    if importlib.util.find_spec("torchao") is None:
        pytest.skip("needs torchao (the torch extra installs it), not installed")
    before, after = _out("migration/torchao")
    assert "convert_to_float8_training(model" in (ROOT / "examples/migration/torchao_before.py").read_text()
    assert before.splitlines()[1:] == after.splitlines()[1:] and len(_losses(after)) == 5, (before, after)
    assert _final(after, "train accuracy") > 80


@needs_torch
def test_migration_apex():
    """The apex loop runs on fmp.torch.fp16_utils; the autocast loop that replaces it trains as well."""
    before, after = _out("migration/apex")
    assert "from apex.fp16_utils import FP16_Optimizer" in (ROOT / "examples/migration/apex_before.py").read_text()
    b, a = _losses(before), _losses(after)
    assert len(b) == len(a) == 5 and abs(b[0] - a[0]) < 1e-2, (before, after)  # same init, float16 vs bfloat16
    assert b[-1] < 0.3 * b[0] and a[-1] < 0.3 * a[0], (before, after)
    assert _final(before, "train accuracy") > 90 and _final(after, "train accuracy") > 90


def _run(script: str, *args: str, timeout: float = 600) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=timeout,
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _final(out: str, key: str) -> float:
    m = re.search(rf"{key} ([0-9.]+)", out)
    assert m, f"no '{key}' in output:\n{out}"
    return float(m.group(1))


def test_loss_function():
    out = _out("loss_function")
    assert _final(out, "final loss") < 0.1
    skipped = int(re.search(r"skipped (\d+) of", out).group(1))
    assert 0 < skipped < 10  # the first steps overflow at 2**16 and are skipped


def test_optax_chain():
    out = _out("optax_chain")
    assert _final(out, "final loss") < 0.3
    assert "skipped steps 0" in out and "final scale 131072" in out  # grew once, growth_interval=50


def test_flax_nnx():
    out = _out("flax_nnx")
    assert _final(out, "train accuracy") > 95
    assert "model param dtype: float32" in out


def test_flax_linen():
    out = _out("flax_linen")
    assert _final(out, "train accuracy") > 95
    # the override keeps every op inside LayerNorm in float32 while the matmuls run in bfloat16
    m = re.search(r"ops inside LayerNorm: (\d+), output dtypes \[([^\]]*)\]; dot_general outputs \[([^\]]*)\]", out)
    assert m and int(m.group(1)) > 0, out
    assert m.group(2) == "'float32'" and m.group(3) == "'bfloat16'", m.group(0)


def test_sharding():
    out = _out("sharding")
    assert "8 devices: cpu" in out
    assert "x sharding: P('data',)" in out and "scaler sharding: P()" in out
    assert _final(out, "final loss") < 0.5


@needs_torch
def test_torch_facade():
    out = _out("torch_facade")
    assert "computed in torch.bfloat16" in out and "params stay torch.float32" in out
    assert _final(out, "train accuracy") > 50


@needs_torch
def test_torch_fx():
    out = _out("torch_fx")
    assert re.search(r"aten::linear\s+lower_precision\s+bfloat16", out)
    assert "max abs difference 0" in out  # the rewritten graph matches torch.autocast exactly


@needs_torch
def test_apex_migration():
    out = _out("apex_migration")
    assert "apex-style: model params torch.float16" in out and "amp-style:  model params torch.float32" in out
    first, last = re.search(r"final\s+([0-9.]+)\s+([0-9.]+)", out).groups()
    assert float(first) < 10 and float(last) < 10


def _flushed(out: str) -> dict[str, tuple[int, int]]:
    """The results table's ``grads flushed to 0`` column: run -> (flushed, non-zero in float32)."""
    return {name: (int(a), int(b)) for name, a, b in re.findall(r"^\| ([\w+]+) +\|.*\| (\d+)/(\d+) \(", out, re.M)}


@pytest.mark.xdist_group("examples-main")  # both read one run of main.py
def test_main_fast_float16_underflows_without_scaling():
    """The mechanism, on a short run: without the scaler float16 rounds most gradient elements to zero (the deep
    autoencoder's gradients are below 2**-24 from the decoder's middle down); with it, almost none."""
    out = _out("main")
    assert "share of FLOPs in float16: 100.0%" in out
    flushed = _flushed(out)
    assert set(flushed) == {"float32", "float16+scaling", "float16"}, out
    unscaled, nonzero = flushed["float16"]
    assert flushed["float32"][0] == 0 and unscaled >= 0.3 * nonzero, out
    assert flushed["float16+scaling"][0] * 10 <= unscaled, "loss scaling did not prevent the flushes"
    _assert_no_negative_loss(out)


@pytest.mark.xdist_group("examples-main")  # both read one run of main.py
def test_main_reports_what_mixed_precision_saves():
    """The cost table reads the compiled step; the plotted loss scale ends at the printed final scale."""
    out = _out("main")
    costs = {
        name: [float(v) for v in vals.split("|")]
        for name, vals in re.findall(r"^\| ([\w+]+) +\| +[0-9]+ +\| (.*) \|$", out, re.M)
    }
    assert set(costs) == {"float32", "float16+scaling", "float16"}, out
    saved, _, _, state = zip(*(costs[n] for n in ("float32", "float16+scaling", "float16")), strict=True)
    # float16 matmul inputs are what the backward pass keeps: half of float32's bytes; master weights stay float32
    assert saved[1] == saved[2] and abs(saved[1] / saved[0] - 0.5) < 0.01, out
    assert state[0] == state[1] == state[2], out
    final = re.search(r"^\| float16\+scaling +\|.*\| (2\^\d+) +\| \d+/", out, re.M)
    plotted = re.search(r"^float16\+scaling: loss scale 2\^16 before the first step, (\S+) after the last", out, re.M)
    assert final and plotted and final.group(1) == plotted.group(1) == "2^19", out


def _assert_no_negative_loss(out: str) -> None:
    lows = re.search(r"lowest logged loss: (.*)", out)
    assert lows, out
    for name, val in re.findall(r"([\w+]+) (-?[0-9.e+-]+)", lows.group(1)):
        assert float(val) >= 0, f"{name} logged a negative loss: {lows.group(0)}"


@pytest.mark.gallery  # the README's command as it is: about 1.5 minutes on 2 cores
def test_main_default_run(tmp_path):
    """The story the figure tells: float16 without loss scaling stays at the average digit while float32,
    bfloat16 and float16 with scaling leave it; the dynamic scale backs off at least once (skipped steps).
    Under .ci/run, FMP_MAIN_RUN names the folder where its README stage ran this same command from the wheel
    (figure and stdout.txt): the test reads that run rather than running it a second time."""
    ran = os.environ.get("FMP_MAIN_RUN")
    if ran:
        folder = pathlib.Path(ran)
        out = (folder / "stdout.txt").read_text()
    else:
        folder = tmp_path
        out = _run("main.py", "--out", str(tmp_path), "--quiet", timeout=900)
    assert (folder / "fmp_main.png").stat().st_size > 10_000
    _assert_no_negative_loss(out)
    vs = {
        name: (float(ratio), float(of_plateau))
        for name, ratio, of_plateau in re.findall(
            r"^([\w+]+) vs float32: final train loss \S+ = ([0-9.]+)x float32's \S+ \(the average digit: ([0-9.]+)x\)",
            out,
            re.M,
        )
    }
    assert set(vs) == {"bfloat16", "float16+scaling", "float16"}, out
    assert vs["float16"][0] >= 1.4 and vs["float16"][1] >= 0.95, out  # stuck on the plateau
    for name in ("bfloat16", "float16+scaling"):
        assert vs[name][0] <= 1.3 and vs[name][1] <= 0.8, out  # tracks float32, well below the plateau
    skipped = re.search(r"^\| float16\+scaling +\|(?:[^|]*\|){3} (\d+) +\|", out, re.M)
    assert skipped and int(skipped.group(1)) >= 1, out


def _third_party_imports(path) -> set[str]:
    tree = ast.parse(path.read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    siblings = {p.stem for p in path.parent.glob("*.py")}  # an example may import another example beside it
    local = {"fmp", "examples", "__future__"} | siblings
    return {m for m in imported if m not in sys.stdlib_module_names and m not in local}


def test_examples_extra_covers_every_example():
    """``pip install -e ".[examples,torch]"`` (torch installed first) is enough for every example; the README's
    main command installs ``[examples]`` alone, which names no torch, and main.py needs none."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def names(reqs):
        return {re.split(r"[<>=!~\[ ]", r, maxsplit=1)[0].lower() for r in reqs}

    assert "torch" not in names(extras["examples"]), "the README's main command would pull a torch build"
    dists = names(project["dependencies"] + extras["examples"] + extras["torch"])
    dist_of = {"sklearn": "scikit-learn"}  # import name -> distribution name where they differ
    examples = sorted((ROOT / "examples").glob("*.py"))
    assert len(examples) >= 10
    for path in examples:
        missing = sorted(m for m in _third_party_imports(path) if dist_of.get(m, m) not in dists)
        assert not missing, (
            f"examples/{path.name} imports {missing}, not in the 'examples'/'torch' extras or the dependencies"
        )
    # the README's first command runs main.py, which must not need torch (installed separately)
    assert "torch" not in _third_party_imports(ROOT / "examples" / "main.py")
    # the extra's comment says how to install torch first
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in (ROOT / "pyproject.toml").read_text()


def test_accumulation():
    out = _out("accumulation")
    # accumulate skips exactly the effective batches that held a bad micro-batch; MultiSteps skips more
    assert "skipped exactly the" in out and out.rstrip().endswith("OK")


@pytest.mark.gallery
@pytest.mark.xdist_group("processes")  # see tests/conftest.py
def test_multiprocess():
    """2 local processes per run (JAX, torch DDP, torch FSDP2); process 1 alone feeds an inf at step 5."""
    out = _run("multiprocess.py", "--fast", timeout=500)
    for run in ("jax", "ddp", "fsdp2"):
        assert re.search(rf"^{run}: .*processes agree bit for bit: True$", out, re.M), out
        # the fault step is skipped on process 0 too: its scale halves and its skip count grows there
        before = re.search(rf"^{run} step +4 .* scale (\d+) +skipped (\d+)$", out, re.M)
        fault = re.search(rf"^{run} step +5 .* scale (\d+) +skipped (\d+)$", out, re.M)
        assert before and fault, out
        assert int(fault.group(1)) * 2 == int(before.group(1)) and int(fault.group(2)) == int(before.group(2)) + 1
    # bfloat16 never overflows at 2**16: the torch runs skip the fault step only, and DDP and FSDP2 agree
    digests = {
        run: re.search(rf"^{run}: 2 processes, skipped 1 of 12; .* params (\w+)$", out, re.M)
        for run in ("ddp", "fsdp2")
    }
    assert all(digests.values()), out
    assert digests["ddp"].group(1) == digests["fsdp2"].group(1)


def test_docs_include_existing_example_sections():
    """Every ``<!-- from: examples/x.py:name -->`` copy in docs/ names a section the example marks."""
    found = [
        (page, path, name)
        for page in (ROOT / "docs").rglob("*.md")
        for path, name in re.findall(r"<!-- from: (examples/[\w./]+\.py):(\w+) -->", page.read_text())
    ]
    assert len(found) >= 2  # the multi-process guide's JAX and torch recipes at least
    for page, path, name in found:
        text = (ROOT / path).read_text()
        assert f"# --8<-- [start:{name}]" in text and f"# --8<-- [end:{name}]" in text, (page, path, name)


def test_migration_pages_show_the_tested_listings():
    """Each migration page holds its before/after files whole (tests/docs/test_synced.py keeps the copies
    current), so the docs show what runs."""
    pages = {
        "torch_amp": "torch-amp.md",
        "jmp": "jmp.md",
        "flax": "flax.md",
        "apex": "apex.md",
        "torchao": "torchao.md",
    }
    assert set(pages) == set(MIGRATIONS)
    for name, page in pages.items():
        text = (ROOT / "docs" / "migration" / page).read_text()
        for part in ("before", "after"):
            assert f"<!-- from: examples/migration/{name}_{part}.py -->" in text, f"{page} lacks the {part} listing"
