"""The source column names the user's file and line in a fresh virtual environment as in the base interpreter.

A base interpreter keeps its site-packages inside the standard library's folder, a venv (or conda) keeps them
outside it, and JAX's own frame filter only knows the former: in a venv its rows named flax's file. The venv is
made with ``python -m venv`` and gets the running interpreter's distributions linked into its site-packages
(no copy of the gigabyte of jaxlib and torch, no download): Python then sees every library file at the venv's
path, as after ``pip install`` there, which is what decides a frame's owner. Slow (each run imports jax, flax
and torch in a fresh process): a gallery.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig

import pytest
from _helpers.common import ROOT

pytestmark = [pytest.mark.gallery, pytest.mark.skipif(sys.platform == "win32", reason="links a venv with symlinks")]

_MODEL = """\
import json

import jax
import jax.numpy as jnp

import fmp

x, out = jnp.ones((2, 3)), {}
try:
    import flax.linen as nn
    from flax import nnx
except ImportError:
    nn = None
if nn is not None:

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(8)(x)  # linen Dense
            return nn.DenseGeneral(4)(h)  # linen DenseGeneral

    class Nnx(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 4, rngs=rngs)

        def __call__(self, x):
            return self.lin(x)  # nnx Linear

    linen = Linen()
    params = linen.init(jax.random.PRNGKey(0), x)
    rows = fmp.explain(linen.apply, "mixed_bfloat16")(params, x).filter(op="dot_general").records
    out["linen"] = [r.source for r in rows]
    rows = fmp.explain(lambda m, x: m(x), "mixed_bfloat16")(Nnx(nnx.Rngs(0)), x).filter(op="dot_general").records
    out["nnx"] = [r.source for r in rows]
try:
    import torch
except ImportError:
    torch = None
if torch is not None:
    import fmp.torch

    class Torch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 4)

        def forward(self, x):
            return self.lin(x)  # torch Linear

    rows = fmp.torch.explain_fx(Torch(), (torch.ones(2, 3),), "cpu").filter(op="aten::linear").records
    out["torch"] = [r.source for r in rows]
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        Conv1D = None
    if Conv1D is not None:

        class GPT2Style(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = Conv1D(4, 3)

            def forward(self, x):
                return self.proj(x)  # transformers Conv1D

        rows = fmp.torch.explain_fx(GPT2Style(), (torch.ones(2, 3),), "cpu").filter(op="aten::addmm").records
        out["transformers"] = [r.source for r in rows]
print(json.dumps(out))
"""
_SKIP = re.compile(r"(\.pth|__pycache__|__editable__.*|jax_fmp.*)$")  # fmp itself comes from the tree under test


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A fresh venv holding the running interpreter's distributions, each at the venv's own path."""
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    query = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = subprocess.run([python, "-c", query], check=True, capture_output=True, text=True).stdout.strip()
    paths = sysconfig.get_paths()
    for base in dict.fromkeys((paths["purelib"], paths["platlib"])):
        for name in os.listdir(base):
            target = os.path.join(site, name)
            if not _SKIP.search(name) and not os.path.lexists(target):
                os.symlink(os.path.join(base, name), target)
    return python


def _run(python, cwd, script, *args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("FMP_USER_PACKAGES", None)
    done = subprocess.run(
        [str(python), script, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_venv_is_a_venv(venv):
    """The setup reproduces a user's venv: its libraries live outside the standard library's folder."""
    query = "import jax, sysconfig; print(jax.__file__); print(sysconfig.get_paths()['stdlib'])"
    jax_file, stdlib = _run(venv, ROOT, "-c", query).split()
    assert jax_file.startswith(str(venv.parent.parent)) and not jax_file.startswith(stdlib)


def test_flax_and_torch_rows_name_the_users_line_in_a_venv_and_in_the_base_interpreter(venv, tmp_path):
    (tmp_path / "model.py").write_text(_MODEL)
    lines = {
        marker: i
        for i, text in enumerate(_MODEL.splitlines(), 1)
        for marker in ("linen Dense", "linen DenseGeneral", "nnx Linear", "torch Linear", "transformers Conv1D")
        if text.endswith(f"# {marker}")
    }
    in_venv = json.loads(_run(venv, tmp_path, "model.py").splitlines()[-1])
    in_base = json.loads(_run(sys.executable, tmp_path, "model.py").splitlines()[-1])
    assert in_venv == in_base
    expected = {
        "linen": [f"model.py:{lines['linen Dense']}:", f"model.py:{lines['linen DenseGeneral']}:"],
        "nnx": [f"model.py:{lines['nnx Linear']}:"],
        "torch": [f"model.py:{lines['torch Linear']} (forward)"],
        "transformers": [f"model.py:{lines['transformers Conv1D']} (forward)"],
    }
    for name, sources in in_venv.items():
        assert len(sources) == len(expected[name]), (name, sources)
        assert all(s.startswith(e) for s, e in zip(sources, expected[name], strict=True)), (name, sources)
    assert {"linen", "nnx", "torch"} <= set(in_venv), in_venv  # the project's test dependencies


def test_the_docs_assets_regenerate_identically_in_a_venv(venv, tmp_path):
    """docs/assets/precision_loss_*.txt: what does not depend on the CPU (ops, dtypes, scopes, source lines)
    comes out of a venv as the page shows it."""
    pytest.importorskip("flax")
    pytest.importorskip("matplotlib")
    _run(venv, ROOT, str(ROOT / "examples" / "precision_loss.py"), "--out", str(tmp_path))
    number = re.compile(r"-?\d+\.\d+(?:e[-+]\d+)?")
    for name in ("precision_loss_planted.txt", "precision_loss_fixed.txt", "precision_loss_nnx.txt"):
        shown, now = ((d / name).read_text() for d in (ROOT / "docs" / "assets", tmp_path))
        assert "linear.py" not in now
        # ops of equal error may swap places on another CPU: the blocks (one per op) are compared as a set
        assert sorted(number.sub("N", now).split("\n#")) == sorted(number.sub("N", shown).split("\n#")), name
