"""flax nnx modules get name scopes from their path (``head``, ``blocks/0/attn``), as linen modules do from
their names: overrides select them, an override that matches nothing warns, explain and float8 sites show them."""

from __future__ import annotations

import warnings

import jax
import numpy as np
import pytest

import fmp

nnx = pytest.importorskip("flax.nnx")


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.attn = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return jax.nn.relu(self.attn(x))


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.blocks = nnx.List([Block(rngs), Block(rngs)])
        self.head = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _run(model, x):
    return model(x)


def _x():
    return jax.random.normal(jax.random.key(1), (4, 8))


def test_explain_and_float8_sites_carry_module_paths():
    model, x = Net(nnx.Rngs(0)), _x()
    rep = fmp.explain(_run, "mixed_float8")(model, x)
    dots = [r for r in rep.records if r.op == "dot_general"]
    assert [r.scope for r in dots] == ["blocks/0/attn", "blocks/1/attn", "head"]
    assert all(r.category == "float8" for r in dots)
    assert "blocks/0" in {r.scope for r in rep.records if r.op == "max"}  # the block's relu, outside attn
    assert all("fmp/_autocast" not in r.source for r in rep.records)  # the source column is the user's line
    st = fmp.float8_state(_run)(model, x)
    assert st.sites == ("dot_general@blocks/0/attn", "dot_general@blocks/1/attn", "dot_general@head")


def test_override_by_module_path_keeps_head_in_float32():
    model, x = Net(nnx.Rngs(0)), _x()
    got = nnx.jit(fmp.autocast(_run, "mixed_float8", overrides={"head": "float32"}))(model, x)

    def blocks(model, x):
        for block in model.blocks:
            x = block(x)
        return x

    h = nnx.jit(fmp.autocast(blocks, "mixed_float8"))(model, x)
    want = nnx.jit(lambda m, h: m.head(h))(model, h)  # float32, as written
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not np.array_equal(np.asarray(got), np.asarray(nnx.jit(fmp.autocast(_run, "mixed_float8"))(model, x)))
    rep = fmp.explain(_run, "mixed_float8", overrides={"blocks/1": "mixed_bfloat16"})(model, x)
    assert [r.category for r in rep.records if r.op == "dot_general"] == ["float8", "override", "float8"]


def test_override_that_matches_no_module_warns():
    model, x = Net(nnx.Rngs(0)), _x()
    with pytest.warns(UserWarning, match=r"'Head'.*matches no.*'blocks/0/attn'.*'head'"):
        fmp.autocast(_run, "mixed_float8", overrides={"Head": "float32"})(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fmp.autocast(_run, "mixed_float8", overrides={"head": "float32"})(model, x)


def test_modules_run_as_written_outside_the_trace():
    model, x = Net(nnx.Rngs(0)), _x()
    calls = (Net.__call__, Block.__call__, nnx.Linear.__call__)
    fmp.explain(_run, "mixed_float8")(model, x)
    assert (Net.__call__, Block.__call__, nnx.Linear.__call__) == calls
    # a module built inside the function, and one that is not an argument, get no scope
    other = nnx.Linear(8, 8, rngs=nnx.Rngs(2))
    rep = fmp.explain(lambda m, x: m(other(x)), "mixed_float8")(model, x)
    assert [r.scope for r in rep.records if r.op == "dot_general"] == ["", "blocks/0/attn", "blocks/1/attn", "head"]


def test_patch_is_undone_when_the_function_raises_and_threads_see_their_own_scopes():
    import threading

    model, x = Net(nnx.Rngs(0)), _x()
    calls = (Net.__call__, Block.__call__, nnx.Linear.__call__)

    def fails(m, x):
        m(x)
        raise RuntimeError("inside the trace")

    with pytest.raises(RuntimeError, match="inside the trace"):
        fmp.autocast(fails, "mixed_bfloat16")(model, x)
    assert (Net.__call__, Block.__call__, nnx.Linear.__call__) == calls
    scopes: list[list[str]] = []

    def worker(seed):
        rep = fmp.explain(_run, "mixed_bfloat16")(Net(nnx.Rngs(seed)), x)
        scopes.append([r.scope for r in rep.records if r.op == "dot_general"])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert scopes == [["blocks/0/attn", "blocks/1/attn", "head"]] * 2
    assert (Net.__call__, Block.__call__, nnx.Linear.__call__) == calls
