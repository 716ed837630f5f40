"""Every example runs end to end in its fast mode, in a fresh process, and prints its key line."""

from __future__ import annotations

import ast
import concurrent.futures
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("XLA_FLAGS", None)
    return env


# The default-suite runs: script and arguments. They all start on first use, two at a time (much of each
# run is single-threaded import and compile time), and each test reads its own run's output.
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
    "main": ("main.py", "--steps", "100", "--runs", "float32,float16+scaling,float16", "--no-plot", "--quiet"),
}
_futures: dict[str, concurrent.futures.Future] = {}
_pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)


@pytest.fixture(scope="module", autouse=True)
def _stop_pending_runs():
    yield
    _pool.shutdown(wait=True, cancel_futures=True)  # a -k selection does not run every example


def _out(name: str, timeout: float = 300) -> str:
    if not _futures:
        for key, (script, *args) in FAST.items():
            _futures[key] = _pool.submit(_run, script, *args, timeout=timeout)
    return _futures[name].result()


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


def test_torch_facade():
    out = _out("torch_facade")
    assert "computed in torch.bfloat16" in out and "params stay torch.float32" in out
    assert _final(out, "train accuracy") > 50


def test_torch_fx():
    out = _out("torch_fx")
    assert re.search(r"aten::linear\s+lower_precision\s+bfloat16", out)
    assert "max abs difference 0" in out  # the rewritten graph matches torch.autocast exactly


def test_apex_migration():
    out = _out("apex_migration")
    assert "apex-style: model params torch.float16" in out and "amp-style:  model params torch.float32" in out
    first, last = re.search(r"final\s+([0-9.]+)\s+([0-9.]+)", out).groups()
    assert float(first) < 10 and float(last) < 10


def test_main_fast_float16_scaling_matches_float32():
    out = _out("main")
    assert "share of FLOPs in float16: 100.0%" in out
    assert "(within 1 point)" in out, out
    m = re.search(r"float16 without scaling: (\d+) of (\d+) gradient elements", out)
    assert m and int(m.group(1)) > 0, "the unscaled float16 run flushed no gradient to zero"
    scaled = re.search(r"\| float16\+scaling \|.*\| (\d+)/\d+ \(", out)
    assert scaled and int(scaled.group(1)) * 10 <= int(m.group(1)), "loss scaling did not prevent the flushes"
    _assert_no_negative_loss(out)


def _assert_no_negative_loss(out: str) -> None:
    lows = re.search(r"lowest logged loss: (.*)", out)
    assert lows, out
    for name, val in re.findall(r"([\w+]+) (-?[0-9.e+-]+)", lows.group(1)):
        assert float(val) >= 0, f"{name} logged a negative cross-entropy: {lows.group(0)}"


@pytest.mark.slow
def test_main_default_run(tmp_path):
    out = _run("main.py", "--out", str(tmp_path), "--quiet", timeout=600)
    assert "(within 1 point)" in out, out
    assert (tmp_path / "fmp_main.png").stat().st_size > 10_000
    _assert_no_negative_loss(out)


def test_examples_extra_covers_the_main_job():
    """``pip install -e ".[examples]" && python examples/main.py`` needs nothing else (and no torch)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + project["optional-dependencies"]["examples"]
    dists = {re.split(r"[<>=!~\[ ]", r, maxsplit=1)[0].lower() for r in reqs}
    dist_of = {"sklearn": "scikit-learn"}  # import name -> distribution name where they differ
    tree = ast.parse((ROOT / "examples" / "main.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    third_party = {m for m in imported if m not in sys.stdlib_module_names and m not in {"fmp", "__future__"}}
    assert "torch" not in third_party
    missing = sorted(m for m in third_party if dist_of.get(m, m) not in dists)
    assert not missing, f"examples/main.py imports {missing}, not in the 'examples' extra or the dependencies"


def test_accumulation():
    out = _out("accumulation")
    # accumulate skips exactly the effective batches that held a bad micro-batch; MultiSteps skips more
    assert "skipped exactly the" in out and out.rstrip().endswith("OK")
