"""The table's rule column is cut after a word, its whole text kept in the row, and every marker the table
shows is named in one line under it."""

from __future__ import annotations

import math

from fmp._report._records import OpRecord, Report

POLICY = "params=float32,compute=float16,output=float32"


def _row(i, category, detail="", added=None, suggestion=None, error=None):
    return OpRecord(
        i, "dot_general", "m.py:1:1 (f)", "blk", category, ("float16",), ("float16",), ("float32",),
        ("float16",), detail=detail, added_error=added, error=error, suggestion=suggestion,
    )  # fmt: skip


def _table(rows, compared=True):
    return str(Report(tuple(rows), POLICY, "jax", compared=compared)).split("fmp precision report")[-1]


def test_the_rule_column_is_cut_after_a_word_and_the_row_keeps_the_whole_text():
    detail = "no epilogue: the other operand is not a bias along the output features"
    rep = Report((_row(0, "promote", detail),), POLICY, "jax")
    (line,) = [x for x in str(rep).splitlines() if x.startswith("0 ")]
    assert "  promote:no epilogue: the other...  " in line and rep.records[0].detail == detail
    assert "markers: ... = the rule's text is cut (row.detail and row.why hold it)" in str(rep)


def test_each_marker_shown_has_its_line_and_only_those():
    fix = 'overrides={"blk": "float32"}'
    table = _table([_row(0, "lower_precision", added=math.inf, suggestion=fix, error=math.inf), _row(1, "cast")])
    (legend,) = [x for x in table.splitlines() if x.startswith("markers: ")]
    assert (
        legend == "markers: ! = a fix is due (row.suggestion); inf = not finite (in added: the op overflows by itself)"
    )
    plain = _table([_row(0, "lower_precision", added=1e-4, error=1e-4)])
    assert "markers:" not in plain
