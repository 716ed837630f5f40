"""fmp's one change to a JAX rule (keeping jnp's inline helpers as calls) waits for the first autocast trace:
importing fmp changes no JAX rule, and installing the rule late caches nothing wrongly."""

from __future__ import annotations

import ast
import json

import pytest
from _helpers.common import ROOT, run_python

from fmp._autocast._engine import _jax_internals

_RULES = """
    from jax._src.interpreters import partial_eval as pe
    from jax.extend.core.primitives import jit_p

    before = dict(pe.custom_staging_rules)

    def unchanged():
        return dict(pe.custom_staging_rules) == before
"""


def test_import_fmp_leaves_jax_staging_rules_untouched():
    out = run_python(
        _RULES
        + """
    import fmp
    print(unchanged())
    import jax.numpy as jnp
    fmp.autocast(lambda x: jnp.var(x) * x)(jnp.ones(3))  # the first autocast trace installs the rule
    print(unchanged(), pe.custom_staging_rules[jit_p].__module__, pe.custom_staging_rules[jit_p] is before[jit_p])
    """
    )
    assert out.split() == ["True", "False", "fmp._autocast._engine._jax_internals._staging", "False"]


def test_import_fmp_torch_leaves_jax_staging_rules_untouched():
    pytest.importorskip("torch")
    out = run_python(_RULES + "\n    import fmp.torch\n    print(unchanged())\n")
    assert out.split() == ["True"]


_ORDER = """
    import json
    import jax, jax.numpy as jnp, numpy as np
    import fmp

    traces = []

    @jax.jit
    def inner(x):  # a user's jitted function with jnp helpers inside: its body is traced once and cached
        traces.append(1)
        return jax.nn.softmax(x, axis=-1) @ x.T

    user_inline = jax.jit(lambda x: jnp.tanh(x) * 2.0, inline=True)  # a user's inline function

    def f(x, w):
        h = user_inline(x @ w)
        return jnp.var(inner(h)) + jnp.sum(jax.nn.gelu(h))

    x = jnp.linspace(-1.0, 1.0, 32, dtype=jnp.float32).reshape(4, 8)
    w = jnp.linspace(-0.5, 0.7, 64, dtype=jnp.float32).reshape(8, 8)
    jitted = jax.jit(f)

    def plain():
        return [str(jax.make_jaxpr(f)(x, w)), np.asarray(jitted(x, w)).tobytes().hex()]

    def cast():
        g = fmp.autocast(f)
        return [str(jax.make_jaxpr(g)(x, w)), np.asarray(g(x, w)).tobytes().hex(),
                np.asarray(jax.jit(g)(x, w)).tobytes().hex()]

    if FIRST == "jit-first":
        seen = {"plain": plain(), "cast": cast(), "plain again": plain()}
    else:
        seen = {"cast": cast(), "plain": plain(), "plain again": plain()}
    seen["inner traced"] = len(traces)
    print(json.dumps(seen))
"""


def _order(first: str) -> dict:
    """What the program above saw, run in a fresh process with ``first`` done first."""
    return json.loads(run_python(_ORDER.replace("FIRST", repr(first))).strip().splitlines()[-1])


def test_jit_traced_before_and_after_the_first_autocast_is_staged_alike():
    """A program jitted before the first autocast (JAX's rule then) and again after it (fmp's rule installed)
    traces to the same jaxpr and value, and autocast gives bit for bit what it gives when it runs first: the
    late install cached nothing wrongly, on either side."""
    jit_first, autocast_first = _order("jit-first"), _order("autocast-first")
    assert jit_first["plain"] == jit_first["plain again"] == autocast_first["plain"]
    assert jit_first["cast"] == autocast_first["cast"]
    assert jit_first["cast"][0] != jit_first["plain"][0]  # autocast did rewrite the program
    assert "jit" in jit_first["cast"][0]  # a jnp helper kept as a call (the installed rule at work)
    assert jit_first["inner traced"] == autocast_first["inner traced"] == 1  # its cached body serves both


def test_all_names_what_other_files_use():
    """The room's ``__all__`` is true: every name another module of fmp (or a test) reads from it is listed,
    and every listed name exists."""
    room = ROOT / "fmp" / "_autocast" / "_engine" / "_jax_internals"
    used = set()
    for path in [*(ROOT / "fmp").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]:
        if room in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id == "_jax_internals" and node.attr != "__all__":
                    used.add(node.attr)
            elif isinstance(node, ast.ImportFrom) and node.module == "fmp._autocast._engine._jax_internals":
                used.update(a.name for a in node.names if not a.name.startswith("_"))
    assert used, "no use found: the walk is broken"
    assert used <= set(_jax_internals.__all__), sorted(used - set(_jax_internals.__all__))
    assert all(hasattr(_jax_internals, name) for name in _jax_internals.__all__)
    assert _jax_internals.__all__ == sorted(_jax_internals.__all__)
