"""The user's frame: one rule (fmp/_core/_frames.py) for explain's source column in JAX and torch.

Library files are placed on fabricated paths (a site-packages folder outside the standard library, as in a
virtual environment or conda, an editable project, a named user package); tests/core/test_frames_venv.py runs the
same models from a real fresh venv and from the base interpreter.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig

import jax.numpy as jnp
import pytest

import fmp
from fmp._autocast._engine import _rows
from fmp._core import _frames

X = jnp.ones((4, 4), jnp.float32)
_LAYER = "def layer(x, w):\n    return x @ w\n"


def _install(root, name, text=_LAYER):
    """A package ``name`` in ``root`` (put first on sys.path by the caller)."""
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(text)
    return root / name / "__init__.py"


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A site-packages folder outside the standard library (a venv's, conda's), first on sys.path."""
    root = tmp_path / "env" / "lib" / "python3.11" / "site-packages"
    root.mkdir(parents=True)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delenv(_frames.ENV, raising=False)
    return root


def _kind(path, **kw):
    return _frames.Rule(kw.pop("cwd", os.getcwd()), kw.pop("user", ()), kw.pop("editable", ())).kind(str(path))


def test_installed_packages_frameworks_and_the_stdlib_are_not_the_users(site):
    import flax

    assert _kind(site / "thirdlib" / "layers.py") == "library"  # a venv's site-packages, outside the stdlib
    assert _kind("/opt/conda/envs/x/lib/python3.11/site-packages/transformers/modeling.py") == "library"
    assert _kind("/usr/lib/python3/dist-packages/foo/bar.py") == "library"
    assert _kind(sysconfig.get_paths()["purelib"] + "/anything.py") == "library"
    assert _kind(flax.__file__) == "library"
    assert _kind(jnp.__file__) == _kind(fmp.__file__) == _kind(os.__file__) == "framework"
    assert _kind("<frozen runpy>") == "framework"


def test_the_users_files_are_theirs(tmp_path):
    assert _kind(tmp_path / "model.py") == "user"
    assert _kind(tmp_path / "proj" / "src" / "m.py", cwd=str(tmp_path / "proj")) == "user"
    assert _kind(__file__) == "user"
    assert _kind("<stdin>") == _kind("<string>") == "user"


def test_an_editable_install_is_the_users_only_when_it_holds_or_is_in_the_working_directory(tmp_path):
    other, mine = tmp_path / "src" / "transformers", tmp_path / "work" / "myproj"
    editable = (_frames._prefix(str(other)), _frames._prefix(str(mine)))
    for cwd in (mine, mine / "notebooks", tmp_path / "work"):
        assert _kind(other / "modeling.py", cwd=str(cwd), editable=editable) == "library"
        assert _kind(mine / "pkg" / "model.py", cwd=str(cwd), editable=editable) == "user"
    assert _kind(mine / "pkg" / "model.py", cwd=str(tmp_path / "elsewhere"), editable=editable) == "library"


def test_editable_installs_are_found_by_their_direct_url(tmp_path, monkeypatch):
    dist = tmp_path / "thirdlib-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdlib\nVersion: 1.0\n")
    url = (tmp_path / "checkout").as_uri()
    (dist / "direct_url.json").write_text(json.dumps({"url": url, "dir_info": {"editable": True}}))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _frames._prefix(str(tmp_path / "checkout")) in _frames.editable_projects.__wrapped__()


def test_a_package_the_user_names_is_theirs(site, monkeypatch):
    path = _install(site, "mymodels")
    assert _frames.rule().kind(str(path)) == "library"
    monkeypatch.setenv(_frames.ENV, "mymodels, other_missing_one")
    with pytest.warns(UserWarning, match="FMP_USER_PACKAGES names other_missing_one"):
        assert _frames.rule().kind(str(path)) == "user"
    monkeypatch.setenv(_frames.ENV, "flax")
    import flax

    assert _frames.rule().kind(flax.__file__) == "user"


def test_jax_rows_name_the_users_line_past_an_installed_package(site, monkeypatch):
    _install(site, "thirdlib_jax")
    import thirdlib_jax

    line = sys._getframe().f_lineno + 1
    report = fmp.explain(lambda x: thirdlib_jax.layer(x, x))(X)
    (dot,) = report.filter(op="dot_general").records
    assert dot.source_full.startswith(f"{__file__}:{line}:"), dot.source_full  # not the package's line
    monkeypatch.setenv(_frames.ENV, "thirdlib_jax")
    (dot,) = fmp.explain(lambda x: thirdlib_jax.layer(x, x))(X).filter(op="dot_general").records
    assert dot.source_full == f"{thirdlib_jax.__file__}:2:11 (layer)"


def test_no_user_frame_gives_an_empty_source(site):
    code = compile("x = 1", str(site / "thirdlib" / "m.py"), "exec")

    class Traceback:
        def raw_frames(self):
            return [code], [0]

    assert _rows._summary(Traceback(), _frames.rule()) == ""
    assert _frames.user_frame([str(site / "a.py"), os.__file__], str) is None


def test_torch_rows_name_the_users_line_past_an_installed_package(site, monkeypatch):
    torch = pytest.importorskip("torch")
    import fmp.torch

    text = "import torch\n\nclass Block(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
    text += "        self.lin = torch.nn.Linear(4, 4)\n\n    def forward(self, x):\n        return self.lin(x)\n"
    _install(site, "thirdlib_torch", text)
    import thirdlib_torch

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = thirdlib_torch.Block()

        def forward(self, x):
            return self.block(x)  # the user's line

    line = Model.forward.__code__.co_firstlineno + 1
    (lin,) = fmp.torch.explain_fx(Model(), (torch.ones(2, 4),), "cpu").filter(op="aten::linear").records
    assert lin.source_full == f"{__file__}:{line} (forward)"
    monkeypatch.setenv(_frames.ENV, "thirdlib_torch")
    (lin,) = fmp.torch.explain_fx(Model(), (torch.ones(2, 4),), "cpu").filter(op="aten::linear").records
    assert lin.source_full == f"{thirdlib_torch.__file__}:9 (forward)"


def test_a_data_dependent_branch_in_an_installed_package_names_its_line_and_the_users(site):
    torch = pytest.importorskip("torch")
    import fmp.torch
    from fmp.torch._fx._trace import _MSG_DATA_DEPENDENT

    path = _install(
        site, "thirdlib_branch", "def check(x):\n    if x.max() > 0:\n        return x.relu()\n    return x\n"
    )
    import thirdlib_branch

    def program(x):
        return thirdlib_branch.check(x) * 2

    with pytest.raises(RuntimeError) as info:
        fmp.torch.autocast_fx(program, (torch.randn(2, 4),))
    line = program.__code__.co_firstlineno + 1
    user = f"{__file__}:{line} (return thirdlib_branch.check(x) * 2)"
    where = f"{path}:2 (if x.max() > 0:) (an installed package's code, reached from {user})"
    assert str(info.value) == _MSG_DATA_DEPENDENT.format(where=where)
