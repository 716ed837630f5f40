"""Runs the full fault-injection plan of tests/reliability and prints (or writes) the counts table.

    python bench/reliability_report.py                 # print the table (about 10,500 steps)
    python bench/reliability_report.py --write         # also rewrite the table in docs/reliability.md
    python bench/reliability_report.py --scale 0.05    # a quick smoke run of the same plan

The plan, the seeds and the checks are the ones ``tests/reliability/test_fault_injection.py::
test_full_fault_injection_run`` asserts on, so the figures are reproducible bit for bit.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "reliability")]

import jax  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402
from _reliability_jax import KINDS  # noqa: E402
from _reliability_suite import FULL_PLAN, P_FAULT, run_plan  # noqa: E402

BEGIN, END = "<!-- reliability-table:begin -->", "<!-- reliability-table:end -->"


def table(results, seconds: float) -> str:
    head = "| path | steps | injected | " + " | ".join(KINDS) + " | skipped | of which injected | corruptions |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in results:
        torch_path = c.path.startswith(("torch", "fp16"))
        kinds = " | ".join("n/a" if torch_path and k == "aux_nan" else str(c.injected_by_kind[k]) for k in KINDS)
        lines.append(
            f"| `{c.path}` | {c.steps} | {c.injected} | {kinds} | {c.skipped} | {c.expected_skips} | {c.corruptions} |"
        )
    tot = {f: sum(getattr(c, f) for c in results) for f in ("steps", "injected", "skipped", "expected_skips")}
    kinds = " | ".join(str(sum(c.injected_by_kind.get(k, 0) for c in results)) for k in KINDS)
    corr = sum(c.corruptions for c in results)
    lines.append(
        f"| **total** | {tot['steps']} | {tot['injected']} | {kinds} | {tot['skipped']} | {tot['expected_skips']} | "
        f"**{corr}** |"
    )
    env = (
        f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC in {seconds:.0f} s on "
        f"{platform.machine()} CPU ({platform.system()}), Python {platform.python_version()}, jax {jax.__version__}, "
        f"optax {optax.__version__}, torch {torch.__version__}; fault probability {P_FAULT} per (micro-)step."
    )
    return "\n".join(lines) + "\n\n" + env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="rewrite the table in docs/reliability.md")
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the full plan's steps to run")
    args = parser.parse_args(argv)
    plan = {path: max(8, int(steps * args.scale)) for path, steps in FULL_PLAN.items()}
    results, seconds = run_plan(plan)
    text = table(results, seconds)
    print(text)
    for c in results:
        for note in c.notes:
            print(f"{c.path}: {note}")
    if args.write:
        if args.scale != 1.0:
            parser.error("--write needs the full plan (--scale 1)")
        doc = ROOT / "docs" / "reliability.md"
        body = doc.read_text()
        new = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), f"{BEGIN}\n{text}\n{END}", body, flags=re.S)
        doc.write_text(new)
        print(f"wrote {doc}")
    return 0 if all(c.corruptions == 0 for c in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
