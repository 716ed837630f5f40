"""Which matmuls to keep out of float8: the report's stand-out rule, the blame of flips, and the size mark."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import fmp
from fmp._core._dtypes import BLOCK_FORMATS, UNIT_ROUNDOFF
from fmp._float8._recipe import SCALINGS
from fmp._report._compare import FAR
from fmp._report._float8_choice import FAMILY, STANDS_OUT, too_small
from fmp._report._records import OpRecord

D, V, T = 64, 128, 64
U8 = UNIT_ROUNDOFF["float8_e4m3fn"]
K = jax.random.split(jax.random.key(0), 6)


def lm(p, x):
    """Three residual blocks and an LM head, each matmul under its own scope."""
    for i in range(3):
        with jax.named_scope(f"block{i}"):
            x = x + jax.nn.gelu(x @ p[f"w{i}"])
    h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True)) * p["scale"]
    with jax.named_scope("lm_head"):
        return h @ p["head"]


PARAMS = {f"w{i}": jax.random.normal(K[i], (D, D)) / 8 for i in range(3)}
PARAMS |= {"scale": jnp.ones(D), "head": jax.random.normal(K[3], (D, V)) / 8}
X = jax.random.normal(K[4], (T, D))


def planted(big: float = 2e4) -> dict:
    """The head's input carries one channel ``big`` times the rest, which the head's weights nearly ignore:
    float8's scale is set by that channel and the other channels fall to e4m3's subnormals."""
    return PARAMS | {"scale": PARAMS["scale"].at[0].set(big), "head": PARAMS["head"].at[0].divide(big)}


def _float8(rep):
    return {r.scope: r for r in rep.records if r.category == "float8"}


def test_a_head_whose_float8_error_stands_out_gets_a_bfloat16_fix():
    rep = fmp.explain(lm, "mixed_float8", compare=True)(planted(), X)
    rows = _float8(rep)
    head = rows["lm_head"]
    # the rule every op is held to lets it pass (its own error is below 4 e4m3 unit roundoffs) ...
    assert U8 < head.added_error < FAR * U8
    # ... but it is several times the other float8 matmuls' error, which are alike
    assert head.added_vs_float8_median > STANDS_OUT
    assert all(rows[f"block{i}"].added_vs_float8_median < 1.5 for i in range(3))
    assert head.suggestion == 'overrides={"lm_head": "mixed_bfloat16"}'  # one step out of float8, not float32
    assert rep.needs_fix == [head] and rep.suggested() == {"overrides": {"lm_head": "mixed_bfloat16"}}
    text = str(rep)
    assert text.startswith("1 op needs a fix") and "3x the median float8 matmul's" in text
    assert 'fix: overrides={"lm_head": "mixed_bfloat16"}' in text


def test_the_suggestion_applied_takes_the_head_out_of_float8_and_out_of_needs_fix():
    rep = fmp.explain(lm, "mixed_float8", compare=True)(planted(), X)
    fixed = fmp.explain(lm, "mixed_float8", compare=True, **rep.suggested())(planted(), X)
    assert fixed.needs_fix == []
    (head,) = [r for r in fixed.records if r.op == "dot_general" and r.scope == "lm_head"]
    assert head.category == "override" and head.out_after == ("bfloat16",)
    assert head.detail == "bfloat16 by overrides, rule lower_precision"
    assert set(_float8(fixed)) == {"block0", "block1", "block2"}  # the rest stays in float8


@pytest.mark.parametrize("policy", ["mixed_float8", "p=f32,c=bf16,o=f32,float8=rowwise"])
def test_alike_float8_matmuls_get_no_suggestion(policy):
    rep = fmp.explain(lm, policy, compare=True)(PARAMS, X)
    rows = _float8(rep).values()
    assert len(rows) == 4 and all(r.suggestion is None for r in rows)
    assert all(0.5 < r.added_vs_float8_median < 1.5 for r in rows)
    assert rep.needs_fix == [] and rep.suggested() == {}
    assert str(rep).startswith("no op needs a fix")


def test_a_lone_float8_matmul_has_no_peers_to_stand_out_from():
    rep = fmp.explain(lambda p, x: x @ p["head"], "mixed_float8", compare=True)(planted(), X * planted()["scale"])
    (row,) = _float8(rep).values()
    assert row.added_error > U8 and row.added_vs_float8_median is None and row.suggestion is None


def moe(p, x):
    """A router's logits, a softmax (its x - max(x) runs in bfloat16), then top_k; and one expert."""
    with jax.named_scope("router"):
        logits = x @ p["router"]
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), 2)
    with jax.named_scope("expert"):
        h = x @ p["w"]
    return h * weights.sum(-1, keepdims=True), experts


def test_router_flips_under_float8_are_charged_to_the_router():
    p = {"router": jax.random.normal(K[0], (32, 8)) / 6, "w": jax.random.normal(K[1], (32, 32)) / 6}
    x = jax.random.normal(K[2], (64, 32))
    rep = fmp.explain(moe, "mixed_float8", compare=True)(p, x)
    (top_k,) = rep.needs_fix
    assert top_k.op == "top_k" and top_k.flips > 0
    # charged past the softmax's bfloat16 subtraction, to the float8 matmul that rounded the logits
    assert top_k.suggestion == 'overrides={"router": "mixed_bfloat16"}'
    fixed = fmp.explain(moe, "mixed_float8", compare=True, **rep.suggested())(p, x)
    assert all(r.flips == 0 for r in fixed.records) and fixed.needs_fix == []
    assert set(_float8(fixed)) == {"expert"}


@pytest.mark.parametrize(
    ("k", "n", "scaling", "small"),
    [
        # tensorwise (torchao: small when K <= 4096 and N <= 1024)
        (768, 768, "tensorwise", True),  # GPT-2 small's attention output and ...
        (3072, 768, "tensorwise", True),  # ... MLP down projection
        (768, 2304, "tensorwise", False),  # its fused qkv and ...
        (768, 3072, "tensorwise", False),  # ... MLP up projection
        (4096, 1024, "tensorwise", True),
        (4112, 1024, "tensorwise", False),
        (4096, 1040, "tensorwise", False),
        (8192, 8192, "tensorwise", False),  # the benchmark's 8192^3 matmul
        (768, 768, "delayed", True),  # per-tensor scales: the tensorwise rule
        # rowwise (torchao: small when N <= 2048, K <= 1024, or K <= 2048 and N <= 4096)
        (768, 3072, "rowwise", True),  # every GPT-2 small matmul
        (3072, 768, "rowwise", True),
        (8192, 2048, "rowwise", True),
        (1024, 8192, "rowwise", True),
        (2048, 4096, "rowwise", True),
        (2048, 4112, "rowwise", False),
        (2064, 4096, "rowwise", False),
        (8192, 8192, "rowwise", False),
        (1024, 8192, "blockwise", True),  # finer scales: the rowwise rule
        (768, 50257, "tensorwise", True),  # GPT-2's vocabulary: not a multiple of 16
    ],
)
def test_the_size_rule_on_shapes(k, n, scaling, small):
    assert bool(too_small(k, n, scaling)) == small


def test_the_size_rule_says_which_box_holds_a_shape():
    assert too_small(768, 768, "tensorwise") == "tensorwise: K <= 4096 and N <= 1024"
    assert too_small(8192, 2048, "rowwise") == "rowwise: N <= 2048"
    assert too_small(1000, 8192, "rowwise") == "K or N not a multiple of 16"
    # a recipe without a published rule of its own: what ran, and the rule it follows
    assert too_small(768, 768, "delayed") == "delayed (tensorwise rule): K <= 4096 and N <= 1024"
    assert too_small(8192, 2048, "nvfp4") == "nvfp4 (rowwise rule): N <= 2048"


def test_every_scaling_a_row_can_name_has_a_size_rule_family():
    # a float8 row's detail names its recipe's scaling ("mx" is read as "mxfp8" and never reaches a row)
    assert set(SCALINGS) <= set(FAMILY) and "mx" not in FAMILY
    assert set(FAMILY) <= set(SCALINGS) | set(BLOCK_FORMATS)


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
def test_a_block_scaled_report_names_the_format_that_ran_in_its_size_mark(fmt):
    rep = fmp.explain(wide, f"mixed_{fmt}")(WIDE, jnp.ones((8, 64)))  # K = 64, N = 1040; K = 1040, N = 64
    rows = _float8(rep)
    assert {r.detail for r in rows.values()} == {fmt}
    assert rows["up"].float8_too_small == f"{fmt} (rowwise rule): N <= 2048"
    assert rows["down"].float8_too_small == f"{fmt} (rowwise rule): N <= 2048"
    assert f"K x N of the weight: {fmt} (rowwise rule): N <= 2048, or K <= 1024" in " ".join(str(rep).split())


def wide(p, x):
    with jax.named_scope("up"):
        h = x @ p["up"]  # K = 64, N = 1040: tensorwise pays (N > 1024), rowwise does not (N <= 2048)
    with jax.named_scope("down"):
        return h @ p["down"]  # K = 1040, N = 64: small under both


WIDE = {"up": jnp.ones((64, 1040)) / 64, "down": jnp.ones((1040, 64)) / 1040}


def test_the_report_marks_float8_matmuls_too_small_for_a_gpu():
    x = jnp.ones((8, 64))
    rep = fmp.explain(wide, "mixed_float8")(WIDE, x)  # no run: the size is the trace's
    rows = _float8(rep)
    assert rows["up"].gemm == (8, 64, 1040) and rows["down"].gemm == (8, 1040, 64)
    assert rows["up"].float8_too_small == "" and rows["down"].float8_too_small == "tensorwise: K <= 4096 and N <= 1024"
    text = str(rep)
    assert "1 of 2 float8 matmuls are below the size where float8 pays on a GPU" in text
    table = [
        cells
        for cells in map(str.split, text.splitlines())
        if cells[:2] in (["0", "dot_general"], ["1", "dot_general"])
    ]
    assert [("small" in cells, "up" in cells) for cells in table] == [(False, True), (True, False)]
    # a speed choice, asked for by name, not an accuracy fix
    assert rep.suggested(small_float8=True) == {"overrides": {"down": "mixed_bfloat16"}}
    with pytest.raises(ValueError, match="compare=True"):
        rep.suggested()
    rowwise = fmp.explain(wide, "p=f32,c=bf16,o=f32,float8=rowwise")(WIDE, x)
    assert rowwise.suggested(small_float8=True) == {"overrides": {"up": "mixed_bfloat16", "down": "mixed_bfloat16"}}
    kept = fmp.explain(wide, "p=f32,c=bf16,o=f32,float8=rowwise", **rowwise.suggested(small_float8=True))(WIDE, x)
    assert _float8(kept) == {} and "float8 pays" not in str(kept)


def test_size_fixes_join_accuracy_fixes_without_replacing_them():
    compared = fmp.explain(lm, "mixed_float8", compare=True)(planted(), X)
    both = compared.suggested(small_float8=True)["overrides"]
    assert both == {k: "mixed_bfloat16" for k in ("block0", "block1", "block2", "lm_head")}
    assert compared.suggested() == {"overrides": {"lm_head": "mixed_bfloat16"}}


def _row(**kw) -> OpRecord:
    base = {"index": 0, "op": "dot_general", "source": "", "scope": "s", "category": "float8"}
    return OpRecord(**(base | {"in_before": (), "in_after": (), "out_before": (), "out_after": ("bfloat16",)} | kw))


def test_float8_culprits_move_one_step_and_float32_wins_a_shared_key():
    from fmp._report._fixes import combined, fix_code

    f8, f16 = _row(), _row(out_after=("float16",))
    assert fix_code([f8], fmp.DEFAULT_RULES) == 'overrides={"s": "mixed_bfloat16"}'
    assert fix_code([f16], fmp.DEFAULT_RULES) == 'overrides={"s": "mixed_float16"}'
    assert fix_code([f8, _row(category="lower_precision")], fmp.DEFAULT_RULES) == 'overrides={"s": "float32"}'
    assert combined(['overrides={"s": "float32"}', 'overrides={"s": "mixed_bfloat16"}']) == {
        "overrides": {"s": "float32"}
    }


def test_a_float8_fix_in_a_crowded_scope_names_the_line_and_keeps_the_compute_dtype():
    from fmp._report._fixes import localised

    named = _row(index=0, scope="block", source="m.py:3:4 (f)", suggestion='overrides={"block": "mixed_bfloat16"}')
    named = dataclasses.replace(named, culprits=(0,), flops=1.0)
    beside = _row(index=1, scope="block", source="m.py:4:4 (f)", flops=1.0)  # a float8 matmul no fix names
    assert localised([named, beside])[0].suggestion == 'overrides={"m.py:3:4": "mixed_bfloat16"}'
