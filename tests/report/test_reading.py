"""The verdict's second line: the output's error against float32, read against the baseline (the float32
program on inputs and parameters rounded to the compute dtype)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import pytest

import fmp
from fmp._report._records import OpRecord
from fmp._report._verdict import reading

BF16 = "params=float32,compute=bfloat16,output=float32"


def _row(i, op, added, scope="", suggestion=None):
    return OpRecord(
        i, op, f"model.py:{i}:4 (f)", scope, "lower_precision", ("bfloat16",), ("bfloat16",), ("float32",),
        ("bfloat16",), added_error=added, error=added, suggestion=suggestion,
    )  # fmt: skip


ROWS = [_row(0, "dot_general", 2e-3, "mlp"), _row(1, "exp", 9e-3, "attn"), _row(2, "add", 1e-3), _row(3, "tanh", 0.0)]


def test_within_a_small_factor_of_the_baseline_it_is_the_models_sensitivity():
    text = reading(ROWS, BF16, 0.21, 0.09)
    assert text.startswith("output error 2.1e-01 vs float32; baseline 9.0e-02 (the float32 program with its")
    assert "within 4x of the baseline, the error is the model's own sensitivity at bfloat16, not an op to fix" in text
    assert "float32 for the inputs, the embedding or a norm" in text


def test_well_above_the_baseline_it_names_the_ops_adding_the_most_even_below_the_threshold():
    text = reading(ROWS, BF16, 0.21, 0.001)
    assert "210.0x the baseline; the ops adding the most error (those with a fix first): #1 exp (attn, added 9.0e-03), #0 dot_general" in text
    assert "#2 add (model.py:2:4, added 1.0e-03)" in text and "tanh" not in text  # three, by added error


def test_below_the_unit_roundoff_and_exact_outputs_say_so():
    assert "below bfloat16's unit roundoff u = 3.9e-03: the rounding the policy asks for" in reading(
        ROWS, BF16, 1e-3, 1e-4
    )
    assert reading(ROWS, BF16, 0.0, 0.0) == (
        "output error 0: the policy computes the outputs exactly as the program as written"
    )
    assert reading(ROWS, BF16, None, None) == ""


def test_a_non_finite_output_names_the_overflows_first():
    rows = [*ROWS, _row(4, "dot_general", math.inf, "ff/wo", 'overrides={"ff/wo": "float32"}')]
    text = reading(rows, BF16, math.inf, 1e-3)
    assert "not finite; the ops adding the most error (those with a fix first): #4 dot_general (ff/wo, added inf, error inf)" in text


def test_explain_reports_each_outputs_error_and_baseline():
    def f(x):
        return {"logits": jnp.sin(x @ x.T * 5.0), "hidden": jnp.tanh(x)}

    x = jnp.linspace(-3.0, 3.0, 64).reshape(8, 8)
    rep = fmp.explain(f, "mixed_bfloat16", compare=True)(x)
    assert set(rep.output_error) == set(rep.baseline_error) == {"['hidden']", "['logits']"}
    assert rep.output_error["['hidden']"] == 0.0  # tanh runs as written: float32 on the float32 input
    # the float32 program itself moves with its input rounded to bfloat16; the matmul adds more
    want = jnp.sin(x @ x.T * 5.0)
    moved = jnp.sin(x.astype(jnp.bfloat16).astype(jnp.float32) @ x.astype(jnp.bfloat16).astype(jnp.float32).T * 5.0)
    base = float(jnp.linalg.norm(moved - want) / jnp.linalg.norm(want))
    assert rep.baseline_error["['logits']"] == pytest.approx(base, rel=1e-3)
    assert rep.output_error["['logits']"] > rep.baseline_error["['logits']"] > 0.01
    assert "(the worst output's)" in rep.verdict.splitlines()[2]
    assert rep.to_dict()["output_error"] == rep.output_error
    assert fmp.explain(f, "mixed_bfloat16")(x).output_error is None  # nothing runs without compare=True
