"""Report.plot: a compared report's errors along the program and its worst ops, drawn with matplotlib."""

import math
import sys

import jax
import jax.numpy as jnp
import pytest
from _helpers.common import near_tied_router

import fmp

matplotlib = pytest.importorskip("matplotlib")
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

K = jax.random.split(jax.random.key(0), 3)
W = jax.random.normal(K[1], (32, 32)) / 6
RULES = fmp.DEFAULT_RULES.derive(lower_precision=["exp"])  # a planted mistake: exp of large values in bfloat16
pytestmark = pytest.mark.xdist_group("report_plot")  # its module fixtures once (tests/conftest.py)


def planted(x, w):
    with jax.named_scope("head"):
        big = jnp.exp(x).sum()
    return big + jnp.tanh(x @ w).sum()


@pytest.fixture(scope="module")
def report():
    x = jax.random.uniform(K[2], (8, 32), maxval=60.0)
    return fmp.explain(planted, rules=RULES, compare=True)(x, W)


def _texts(ax: Axes) -> list[str]:
    return [t.get_text() for t in ax.texts]


def test_plot_draws_the_errors_along_the_program_and_the_worst_ops(report, tmp_path):
    fig = report.plot(k=3, ax=Figure().subplots(1, 2), path=tmp_path / "report.png")
    assert isinstance(fig, Figure) and (tmp_path / "report.png").stat().st_size > 5_000
    program, worst = fig.axes
    compared = [r for r in report.records if r.error is not None]
    lines = {line.get_label(): line for line in program.get_lines()}
    assert list(lines["error (accumulated)"].get_xdata()) == [r.index for r in compared]
    own = lines["added_error (own)"].get_ydata()
    assert [x for x in own if not math.isnan(x)] == [r.added_error for r in compared if r.added_error > 0]
    assert program.get_yscale() == "log"
    assert "bfloat16 unit roundoff" in _texts(program)
    top = report.worst(1)[0]
    assert top.op == "exp" and top.suggestion  # the planted op, and the only one labelled: it needs a fix
    assert [t for t in _texts(program) if t.startswith("#")] == [f"#{top.index} exp head"]
    # the bars: the worst op at the top (matplotlib counts from the bottom), its own error as the width
    labels = [t.get_text() for t in worst.get_yticklabels()]
    assert labels[-1] == f"#{top.index} exp head" and len(labels) == 3
    assert worst.patches[-1].get_width() == pytest.approx(top.added_error)
    assert worst.get_xscale() == "log"


def test_plot_default_figure_and_one_axes(report):
    plt = pytest.importorskip("matplotlib.pyplot")
    fig = report.plot()
    try:
        assert len(fig.axes) == 2 and fig in map(plt.figure, plt.get_fignums())  # plt.show() shows it
    finally:
        plt.close(fig)
    ax = Figure().subplots()
    assert report.plot(ax=ax) is ax.figure and len(ax.figure.axes) == 1 and ax.get_lines()
    with pytest.raises(TypeError, match=r"Report.plot\(ax=...\) expects a matplotlib Axes or a pair"):
        report.plot(ax="left")


def test_plot_marks_an_overflow():
    x = jax.random.uniform(K[0], (8, 16), minval=1.0, maxval=2.0)
    w = jnp.full((16, 16), 20.0)

    def f(x, w):
        h = x @ w
        return jnp.sqrt(h * h + 1.0).mean()  # h*h overflows float16

    rep = fmp.explain(f, "mixed_float16", compare=True)(x, w)
    fig = rep.plot(k=2, ax=Figure().subplots(1, 2))
    program, worst = fig.axes
    (marks,) = [line for line in program.get_lines() if line.get_label() == "non-finite (overflow)"]
    assert list(marks.get_xdata()) == [r.index for r in rep.records if r.nonfinite]
    top = rep.worst(1)[0]
    assert top.nonfinite and worst.patches[-1].get_hatch() == "//"
    assert f"#{top.index} mul" in _texts(program)


def test_plot_needs_compare():
    with pytest.raises(ValueError, match="compare=True"):
        fmp.explain(planted, rules=RULES)(jnp.ones((8, 32)), W).plot()


def test_plot_without_matplotlib_says_how_to_install_it(report, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ModuleNotFoundError
    with pytest.raises(ModuleNotFoundError, match=r"Report.plot needs matplotlib.*pip install 'jax-fmp\[plot\]'"):
        report.plot()


def test_plot_marks_changed_discrete_outputs():
    route, x, w = near_tied_router()
    rep = fmp.explain(route, compare=True)(x, w)
    (top_k,) = [r for r in rep.records if r.op == "top_k"]
    assert top_k.flips > 0  # marked above the errors: flips have no place on the log axis
    program, worst = rep.plot(k=2, ax=Figure().subplots(1, 2)).axes
    (marks,) = [line for line in program.get_lines() if line.get_label().startswith("flips")]
    assert list(marks.get_xdata()) == [top_k.index] and f"#{top_k.index} top_k" in _texts(program)
    assert f"#{top_k.index} top_k ({top_k.flips} flips)" in [t.get_text() for t in worst.get_yticklabels()]
