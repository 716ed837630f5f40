"""Which layers to keep out of float8, from measurements: ``fmp.explain(..., compare=True)`` under a float8
policy on the precision-loss page's small language model, with a planted massive channel before the LM head.

docs/guides/float8.md ("Keeping layers out of float8") shows this file's sections and the report text it
writes (tests check both):

    python examples/float8_choice.py [--out docs/assets]
"""

from __future__ import annotations

import argparse
import runpy
from pathlib import Path

import jax

import fmp

# the precision-loss page's language model (examples/precision_loss.py): its loss, parameters and tokens
LM = runpy.run_path(str(Path(__file__).with_name("precision_loss.py")), run_name="precision_loss")
head, loss_fn, params, tokens = LM["head"], LM["loss_fn"], LM["params"], LM["tokens"]


def planted(params, big=5e4):
    """The final norm gives channel 0 ``big`` times the others' scale, and the head's weights for it are ``big``
    times smaller: the model computes the same logits, but the head's float8 scale is set by that channel."""
    p = jax.tree_util.tree_map(lambda x: x, params)  # a copy
    p["params"]["RMSNorm_0"]["scale"] = p["params"]["RMSNorm_0"]["scale"].at[0].multiply(big)
    p["params"]["Dense_0"]["kernel"] = p["params"]["Dense_0"]["kernel"].at[0].divide(big)
    return p


def size_line(report) -> str:
    """The report's line on the float8 matmuls' sizes."""
    lines = str(report).splitlines()
    start = next(i for i, line in enumerate(lines) if "float8 matmuls are below the size" in line)
    end = next(i for i in range(start + 1, len(lines) + 1) if i == len(lines) or not lines[i].startswith(" "))
    return "\n".join(lines[start:end])


def run(out: Path | None = None) -> dict:
    """Runs the page's steps; returns what the page claims (and writes the report heads to ``out``)."""
    massive = planted(params)
    # --8<-- [start:choose]
    report = fmp.explain(loss_fn, "mixed_float8", compare=True)(massive, tokens)
    print(report)  # the verdict, the worst ops (the head first, with its fix), every op, the size line
    print(report.suggested())  # {'overrides': {'LM/Dense_0': 'mixed_bfloat16'}}
    fixed = fmp.explain(loss_fn, "mixed_float8", compare=True, **report.suggested())(massive, tokens)
    assert fixed.needs_fix == []  # the head runs in bfloat16, the 12 other matmuls in float8
    # --8<-- [end:choose]
    # --8<-- [start:loss]
    exact, errors = loss_fn(massive, tokens), {}
    for name, policy, kwargs in (
        ("bfloat16", "mixed_bfloat16", {}),
        ("float8", "mixed_float8", {}),
        ("float8, head in bfloat16", "mixed_float8", report.suggested()),
    ):
        loss = jax.jit(fmp.autocast(loss_fn, policy, **kwargs))(massive, tokens)
        errors[name] = float(abs(loss - exact) / exact)
        print(f"{name}: loss relative error {errors[name]:.1e}")
    # --8<-- [end:loss]
    # --8<-- [start:size]
    speed = report.suggested(small_float8=True)  # a speed choice, asked for by name
    print(len(speed["overrides"]), "matmuls to keep in bfloat16 on a GPU")  # all 13 at this size
    # --8<-- [end:size]
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "float8_choice_report.txt").write_text(f"{head(report, ops=2)}\n...\n{size_line(report)}\n")
        losses = "".join(f"{name}: loss relative error {e:.1e}\n" for name, e in errors.items())
        (out / "float8_choice_fixed.txt").write_text(f"{losses}\n{head(fixed, ops=1)}\n")
    return {"report": report, "fixed": fixed, "loss_errors": errors, "speed": speed}


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description="Which layers to keep out of float8, from the report's numbers.")
    cli.add_argument("--out", type=Path, help="write the report heads the float8 guide shows here")
    run(cli.parse_args().out)
