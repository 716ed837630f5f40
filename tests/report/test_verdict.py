"""The verdict of a compared report: ``Report.needs_fix`` and the line ``str(report)`` opens with."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import fmp


def _block():
    """A small pre-norm transformer block (flax linen) on healthy data."""
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=2)(h, h)
            h = nn.Dense(64)(nn.LayerNorm()(x))
            x = x + nn.Dense(32)(nn.gelu(h))
            return jax.nn.log_softmax(x, -1)

    x = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 32))
    model = Block()
    return model, model.init(jax.random.PRNGKey(0), x), x


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_a_healthy_model_needs_no_fix(policy):
    model, params, x = _block()
    rep = fmp.explain(model.apply, policy, compare=True)(params, x)
    assert rep.needs_fix == []
    name = policy.removeprefix("mixed_")
    u = {"bfloat16": 2.0**-8, "float16": 2.0**-11}[name]
    first = str(rep).split("\n\n")[0]  # the verdict, wrapped at 100 columns
    assert first == rep.verdict and max(len(line) for line in first.splitlines()) <= 100
    assert first.startswith(f"no op needs a fix ({name} unit roundoff u = {u:.1e};")
    assert f"4u = {4 * u:.1e}" in first
    # the healthy rows still have errors of the dtype's rounding
    assert max(r.added_error or 0.0 for r in rep.records) > u / 16


def test_planted_ops_are_counted_worst_first_overflows_first():
    rules = fmp.DEFAULT_RULES.derive(lower_precision=["exp", "sin"])

    def fn(x):
        return jnp.sum(jnp.sin(x * 1000.0)) + jnp.sum(jnp.exp(x * 12.0))  # exp(12) > float16 max

    rep = fmp.explain(fn, "mixed_float16", rules=rules, compare=True)(jnp.linspace(0.0, 1.0, 64))
    ops = [r.op for r in rep.needs_fix]
    assert ops == ["exp", "sin"]  # the overflow first, though it comes later in the program
    assert rep.needs_fix[0].nonfinite
    assert str(rep).startswith("2 ops need a fix (float16 unit roundoff")
    one = fmp.explain(lambda x: jnp.sum(jnp.sin(x * 1000.0)), "mixed_float16", rules=rules, compare=True)
    assert str(one(jnp.linspace(0.0, 1.0, 64))).startswith("1 op needs a fix (float16")


def test_needs_fix_needs_compare():
    rep = fmp.explain(jnp.sin)(jnp.ones(3))
    with pytest.raises(ValueError, match="compare=True"):
        _ = rep.needs_fix
    assert not str(rep).startswith("no op")


def test_the_full_table_has_error_columns_short_rules_and_lines_inside_jnp_helpers():
    def f(x, w):
        return jnp.mean(jax.nn.log_softmax(x @ w, -1))

    x, w = jnp.linspace(-1.0, 1.0, 64).reshape(8, 8), jnp.eye(8)
    rep = fmp.explain(f, "mixed_float16", compare=True)(x, w)
    table = str(rep).split("\n\nfmp precision report", 1)[1]
    header = table.splitlines()[1].split()
    assert header[header.index("after", 8) + 1 : header.index("after", 8) + 3] == ["added", "error"]
    plain = str(fmp.explain(f, "mixed_float16")(x, w))
    assert " added " not in plain.splitlines()[1]
    # the rows inside jax.nn.log_softmax (a jit of jax's own) name the user's line that calls it
    inside = [r for r in rep.records if r.op in ("reduce_max", "exp", "log")]
    assert len(inside) == 3 and all(r.source.startswith("tests/report/test_verdict.py:") for r in inside)
    assert len({r.source for r in inside}) == 1
    # the rule summary lines fit 100 columns
    summary = table.split("\n\n", 1)[1].splitlines()
    assert summary and all(len(line) <= 100 for line in summary)


def test_a_long_rule_text_is_cut_in_the_table_but_kept_in_the_row():
    from fmp._report._records import OpRecord
    from fmp._report._text import RULE_WIDTH, format_table

    why = "activation x activation (neither operand is a weight of the module): runs in the compute dtype"
    row = OpRecord(
        0,
        "dot_general",
        "",
        "",
        "float8",
        ("float32",) * 2,
        ("bfloat16",) * 2,
        ("float32",),
        ("bfloat16",),
        detail="tensorwise",
        why=why,
    )
    line = format_table([row], {}, title="t").splitlines()[3]
    cell = "float8:tensorwise [activation x..."  # cut after a word
    assert f"  {cell}  " in line and len(cell) <= RULE_WIDTH and why not in line and row.why == why


def test_the_worst_ops_leave_out_ops_that_changed_nothing():
    # a rotary embedding whose angle product sums one element per output: fmp keeps it exact in float32
    def rotary(x, positions):
        inv_freq = 1.0 / 10000 ** (jnp.arange(0, x.shape[-1], 2) / x.shape[-1])
        angles = positions[:, None] @ inv_freq[None, :]
        x1, x2 = jnp.split(x, 2, axis=-1)
        return jnp.concatenate([x1 * jnp.cos(angles) - x2 * jnp.sin(angles), x2], axis=-1)

    x, positions = jax.random.normal(jax.random.PRNGKey(0), (64, 16)), jnp.arange(64.0)
    rep = fmp.explain(rotary, "mixed_bfloat16", compare=True)(x, positions)
    assert rep.needs_fix == [] and all(r.error == 0.0 for r in rep.records if r.error is not None)
    worst = str(rep).split("\n\n")[1]
    assert worst.splitlines()[1] == "(none: every op computed exactly what the program as written computes)"
    # a model that rounds lists only the ops that changed something
    model, params, xb = _block()
    text = str(fmp.explain(model.apply, "mixed_bfloat16", compare=True)(params, xb)).split("\n\n")[1]
    assert "added 0.00e+00, error 0.00e+00" not in text and text.count("\n#") >= 3
