"""An overrides key selects scope paths, but never cuts a number: ``blocks/1`` is not ``blocks/10``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import fmp
from fmp._core._scopes import find_key


def _layers(x, ws):
    for i, w in enumerate(ws):
        with jax.named_scope(f"blocks/{i}"):
            with jax.named_scope("LayerNorm_0" if i % 2 else "attn"):
                x = jnp.tanh(x @ w)
    return x


def _dot_dtypes(overrides):
    ws = [jnp.eye(4) * 0.5 for _ in range(12)]
    rep = fmp.explain(_layers, "mixed_bfloat16", overrides=overrides)(jnp.ones((2, 4)), ws)
    return {r.scope.split("/")[1]: r.in_after[0] for r in rep.records if r.op == "dot_general"}


def test_a_numbered_key_selects_that_layer_only():
    got = _dot_dtypes({"blocks/1": "float32"})
    assert got["1"] == "float32"
    assert [i for i, dt in got.items() if dt == "float32"] == ["1"]  # not blocks/10 and blocks/11


def test_a_key_still_selects_numbered_module_names_and_name_parts():
    by_norm = _dot_dtypes({"LayerNorm": "float32"})
    assert [i for i, dt in by_norm.items() if dt == "float32"] == [str(i) for i in range(1, 12, 2)]
    tail = _dot_dtypes({"1/attn": "float32"})  # blocks/1 has LayerNorm_0; blocks/11 must not be cut
    assert set(tail.values()) == {"bfloat16"}


def test_a_key_that_only_matched_inside_a_number_warns():
    def two(x):
        for name in ("blocks/10", "blocks/11"):
            with jax.named_scope(name):
                x = x @ x
        return x

    with pytest.warns(UserWarning, match=r"overrides key 'blocks/1' matches no jax.named_scope"):
        fmp.autocast(two, "mixed_bfloat16", overrides={"blocks/1": "float32"})(jnp.ones((4, 4)))


@pytest.mark.parametrize(
    ("path", "key", "want"),
    [("blocks/10/attn", "blocks/1", -1), ("blocks/1", "blocks/1", 0), ("blocks/11/attn", "1/attn", -1),
     ("enc/blocks/1/x/blocks/12", "blocks/1", 4), ("model.layers.1.mlp", "layers.1", 6),
     ("model.layers.10.mlp", "layers.1", -1), ("self_attn", "attn", 5)],
)  # fmt: skip
def test_find_key(path, key, want):
    assert find_key(path, key) == want
