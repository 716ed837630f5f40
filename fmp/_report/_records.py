"""The per-operation precision report shared by ``fmp.explain`` (JAX) and the torch FX explain.

Framework-neutral: a report is a list of ``OpRecord`` rows plus a summary,
so a user can put the JAX and the torch precision maps side by side.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import textwrap
from typing import Any

from fmp._core._dtypes import LOW_PRECISION
from fmp._report._fixes import combined, localised
from fmp._report._float8_choice import small_fixes
from fmp._report._grads import GradReport, format_grads
from fmp._report._row import OpRecord
from fmp._report._text import format_table, format_worst, inherited, inherits, worst_rows
from fmp._report._verdict import fix_rows, reading, verdict

_ISLAND = ("float32", "override")  # the rules whose float32 rows make a float32 island (the rule's or a fix's)
_LOCATION = re.compile(r"(?P<path>.+?)(?P<rest>:\d+.*)")


def short_source(full: str, root: str | None = None) -> str:
    """``full`` (``"/path/to/model.py:12:8 (forward)"``) with a short path.

    The path becomes relative to ``root`` (default: the working directory) when the file lies inside it,
    and the bare file name otherwise (a library in site-packages); anything that is not an absolute
    path (``"<stdin>:1 (<module>)"``) is returned as is.
    """
    return _short(full, root, os.getcwd())  # every row of a report asks: the same few lines, many times


@functools.lru_cache(maxsize=4096)
def _short(full: str, root: str | None, cwd: str) -> str:
    m = _LOCATION.fullmatch(full)
    if m is None or not os.path.isabs(m["path"]):
        return full
    path, root = os.path.normpath(m["path"]), os.path.abspath(root or cwd)
    try:
        inside = os.path.commonpath([path, root]) == root
    except ValueError:  # another drive
        inside = False
    return (os.path.relpath(path, root) if inside else os.path.basename(path)) + m["rest"]


@dataclasses.dataclass(frozen=True)
class Report:
    """A precision report: every operation's dtypes after the rewrite, and a summary.

    ``str(report)`` is a readable table; ``report.to_dict()`` a JSON-ready dict.
    ``compared``: the rows carry errors against the program as written
    (``fmp.explain(..., compare=True)``); the table then starts with the worst ops.
    ``grads``: the backward comparison (``grads=True``), else ``None``.
    ``output_error``: with ``compare=True``, the relative L2 error of the outputs under the policy against the
    program as written (a float for one floating output; for several, a dict by each output's key path).
    ``baseline_error``: the same of the program as written run on its floating inputs and parameters rounded
    to the policy's compute dtype: how much the model itself moves at that precision. The verdict's second
    line reads the two.
    """

    records: tuple[OpRecord, ...]
    policy: str
    framework: str
    compared: bool = False
    grads: GradReport | None = None
    output_error: float | dict[str, float] | None = None
    baseline_error: float | dict[str, float] | None = None

    def __post_init__(self) -> None:
        if self.compared:  # each fix moves its culprits and no matmul beside them
            object.__setattr__(self, "records", localised(self.records))

    def worst(self, k: int = 10, *, grads: bool = False) -> tuple[OpRecord, ...]:
        """The ``k`` worst compared rows: rows with non-finite values first, then rows with a suggested fix,
        each group by decreasing ``added_error`` (then flips, then error) (``grads=True``: of the backward
        rows)."""
        if not self.compared:
            raise ValueError("Report.worst needs errors: call fmp.explain(fn, policy, compare=True)(*args)")
        return worst_rows(self.grad_rows if grads else self.records, k)

    @property
    def needs_fix(self) -> list[OpRecord]:
        """The compared rows with a suggestion, worst first: overflows first, then by decreasing
        ``added_error`` (then flips, then error); ``[]`` when no op needs a fix (a healthy model).

        Under a float8 policy it also holds each float8 matmul whose own error stands out from the others':
        above 3x the median ``added_error`` of the report's other float8 matmuls and above e4m3's unit
        roundoff (``added_vs_float8_median``, ``fmp._report._float8_choice``); a float8 culprit's fix keeps it
        in the compute dtype (``overrides={"lm_head": "mixed_bfloat16"}``), not float32.

        Raises:
          ValueError: The report has no errors (``compare=True`` missing).
        """
        if not self.compared:
            raise ValueError("Report.needs_fix needs errors: call fmp.explain(fn, policy, compare=True)(*args)")
        return fix_rows(self.records)

    @property
    def verdict(self) -> str:
        """What ``str(report)`` opens with: ``no op needs a fix`` or ``N op(s) need(s) a fix``, with the unit
        roundoff of the policy's compute dtype and the threshold an op's own error is held to; then a second
        line that reads ``output_error`` against ``baseline_error``: within 4x of the baseline, the error is
        the model's own sensitivity at the compute dtype (what helps: float32 for the inputs, the embedding or
        a norm); above it, the three ops that add the most error, whether or not they need a fix.

        Raises:
          ValueError: The report has no errors (``compare=True`` missing).

        Examples:
          >>> rep = fmp.explain(lambda x: jnp.tanh(x @ x.T), "mixed_bfloat16", compare=True)(jnp.ones((4, 8)))
          >>> print(rep.verdict)
          no op needs a fix (bfloat16 unit roundoff u = 3.9e-03; a fix is due where an op overflows, flips
            discrete outputs or adds an error above 4u = 1.6e-02)
          output error 0: the policy computes the outputs exactly as the program as written
          >>> x = jnp.linspace(-3.0, 3.0, 64).reshape(8, 8)
          >>> print(fmp.explain(lambda x: jax.nn.softmax(x @ x.T), "mixed_bfloat16", compare=True)(x).verdict)
          no op needs a fix (...)
          output error 6.1e-04 vs float32; baseline 4.9e-04 (the float32 program with its inputs and
            parameters rounded to bfloat16): below bfloat16's unit roundoff u = 3.9e-03: the rounding the
            policy asks for
        """
        if not self.compared:
            raise ValueError("Report.verdict needs errors: call fmp.explain(fn, policy, compare=True)(*args)")
        second = reading(self.records, self.policy, self.output_error, self.baseline_error)
        head = verdict(self.records, self.policy)
        return f"{head}\n{textwrap.fill(second, 100, subsequent_indent='  ')}" if second else head

    def suggested(self, *, small_float8: bool = False) -> dict[str, Any]:
        """The keyword arguments (``overrides=``, ``rules=``) that apply every suggestion of ``needs_fix`` at
        once; ``{}`` when no op needs a fix. A ``rules=`` entry holds the rules the report ran under (spelled
        from ``fmp.DEFAULT_RULES``) with the ops it names moved to float32: pass it instead of your own.

        Args:
          small_float8: Also keep in the compute dtype every float8 matmul marked ``float8_too_small`` (below
            the size where float8 pays on a GPU): a speed choice, not an accuracy fix, so off by default; it
            needs no ``compare=True``.

        Raises:
          ValueError: The report has no errors (``compare=True`` missing), unless ``small_float8=True``.

        Examples:
          >>> def f(x):
          ...     return jnp.sum(x @ x.T)
          >>> x = jnp.linspace(-1.0, 1.0, 32).reshape(4, 8) * 1e3
          >>> rep = fmp.explain(f, "mixed_float16", compare=True)(x)
          >>> [r.op for r in rep.needs_fix], sorted(rep.suggested())
          (['dot_general'], ['overrides'])
          >>> fmp.explain(f, "mixed_float16", compare=True, **rep.suggested())(x).needs_fix
          []
        """
        fixes = [r.suggestion for r in self.needs_fix] if self.compared or not small_float8 else []
        return combined([*fixes, *(small_fixes(self.records) if small_float8 else [])])

    @property
    def grad_errors(self) -> dict[str, Any]:
        """Key path of each gradient leaf -> its ``GradError`` (``grads=True``)."""
        return dict(self._grads().errors)

    @property
    def grad_rows(self) -> tuple[OpRecord, ...]:
        """One compared row per backward operation (``grads=True``)."""
        return self._grads().rows

    def _grads(self) -> GradReport:
        if self.grads is None:
            raise ValueError("the report has no gradients: call fmp.explain(loss, policy, compare=True, grads=True)")
        return self.grads

    def plot(self, k: int = 10, *, ax: Any = None, path: Any = None) -> Any:
        """Draws the errors along the program and the ``k`` worst ops (needs matplotlib: the ``plot`` extra).

        Left: every compared op in program order, its ``error`` and ``added_error`` on a log scale, with the
        unit roundoff of the low-precision dtypes and the worst ops labelled by position, op and scope.
        Right: the worst ops' ``added_error`` as bars (red where the row has a suggestion).

        Args:
          k: How many of the worst ops to label and draw as bars.
          ax: A matplotlib ``Axes`` (the left panel only) or a pair of them; default: a new pyplot
            figure with both panels (``plt.show()`` shows it).
          path: Where to save the figure (anything ``Figure.savefig`` takes).

        Returns:
          The matplotlib ``Figure``.

        Raises:
          ValueError: The report has no errors (``compare=True`` missing).
          ModuleNotFoundError: matplotlib is not installed; the message says how to install it.

        Examples:
          >>> from matplotlib.figure import Figure
          >>> rules = fmp.DEFAULT_RULES.derive(lower_precision=["exp"])
          >>> x = jnp.linspace(0.0, 80.0, 64)
          >>> rep = fmp.explain(lambda x: jnp.exp(x).sum(), rules=rules, compare=True)(x)
          >>> fig = rep.plot(k=2, ax=Figure().subplots(1, 2))
          >>> [t.get_text() for t in fig.axes[1].get_yticklabels()]
          ['#1 exp']
        """
        title = f"fmp precision report ({self.framework}, {self.policy})"
        from fmp._report import _plot  # drawing code (and matplotlib) only when a plot is asked for

        return _plot.plot(self.records, self.worst(k), title=title, ax=ax, path=path)

    @property
    def summary(self) -> dict[str, Any]:
        """Totals of what ran: FLOPs and the share of them whose outputs are low-precision, casts inserted, and
        float32 islands (runs of ops that the rule table or an override put in float32, casts between them
        aside)."""
        total = sum(r.flops for r in self.records)
        low = sum(r.flops for r in self.records if any(d in LOW_PRECISION for d in r.out_after))
        float8 = sum(r.flops for r in self.records if r.category == "float8")
        casts = sum(1 for r in self.records if r.category == "cast")
        islands = 0
        inside = False
        for r in self.records:
            is_f32 = r.category in _ISLAND and "float32" in r.out_after and not set(r.out_after) & LOW_PRECISION
            if is_f32 and not inside:
                islands += 1
            if r.category != "cast":
                inside = is_f32
        return {
            "ops": len(self.records),
            "flops": total,
            "low_precision_flops": low,
            "low_precision_flop_share": (low / total) if total else 0.0,
            "float8_flops": float8,
            "float8_flop_share": (float8 / total) if total else 0.0,
            "casts_inserted": casts,
            "float32_islands": islands,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "framework": self.framework,
            "policy": self.policy,
            "compared": self.compared,
            "output_error": self.output_error,
            "baseline_error": self.baseline_error,
            "records": [r.to_dict() for r in self.records],
            "summary": self.summary,
            **({"grads": self.grads.to_dict()} if self.grads is not None else {}),
        }

    def filter(self, *, op: str | None = None, category: str | None = None) -> Report:
        """The rows of one op name and/or one category."""
        rows = tuple(
            r for r in self.records if (op is None or r.op == op) and (category is None or r.category == category)
        )
        return dataclasses.replace(self, records=rows)

    def __str__(self) -> str:
        table = format_table(
            self.records,
            self.summary,
            title=f"fmp precision report ({self.framework}, {self.policy})",
            compared=self.compared,
        )
        if not self.compared:
            return table
        head = self.verdict
        down = inherited(self.records)
        # rows folded into their culprits, and rows that changed nothing (exact), are left out of the worst ops
        own = [
            r
            for r in self.records
            if not (down and inherits(r)) and (r.error or r.added_error or r.flips or r.nonfinite)
        ]
        text = f"{head}\n\n{format_worst(worst_rows(own, 10), downstream=down)}\n\n{table}"
        if self.grads is not None:
            text += f"\n\n{format_grads(self.grads)}"
            if self.grads.rows:
                back = format_worst(
                    worst_rows(self.grads.rows, 10), title="worst backward ops (vs the lifted backward)"
                )
                text += f"\n\n{back}"
        return text
