"""Float8 in reports and checkpoints: explain counts only matmuls that really run in float8, and Float8State
checkpoints with flax.serialization whichever of fmp and flax is imported first."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers.common import run_python

import fmp


def _mlp(x, w):
    return jnp.tanh(x @ w) @ w.T


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16", "mixed_float8"])
def test_float64_program_reports_no_float8_flops(policy):
    with jax.enable_x64(True):
        x, w = jnp.ones((4, 8), jnp.float64), jnp.ones((8, 8), jnp.float64)
        rep = fmp.explain(_mlp, policy)(x, w)
    dots = [r for r in rep.records if r.op == "dot_general"]
    assert [(r.category, r.out_after) for r in dots] == [("lower_precision", ("float64",))] * 2
    assert rep.summary["float8_flops"] == 0 and rep.summary["float8_flop_share"] == 0.0
    assert "in float8" not in str(rep)


def test_float8_flop_share_counts_the_float8_matmuls_only():
    x, w = jnp.ones((4, 8), jnp.float32), jnp.ones((8, 8), jnp.float32)
    assert fmp.explain(_mlp, "mixed_bfloat16")(x, w).summary["float8_flop_share"] == 0.0
    rep = fmp.explain(_mlp, "mixed_float8")(x, w)
    assert rep.summary["float8_flop_share"] == pytest.approx(
        sum(r.flops for r in rep.records if r.op == "dot_general") / rep.summary["flops"]
    )
    assert {r.category for r in rep.records if r.op == "dot_general"} == {"float8"}


_ROUND_TRIP = """
import jax.numpy as jnp
import fmp
st = fmp.Float8State.zeros(["dot_general@a"], fmp.Float8Recipe("delayed", history_len=2))
st = st.update(type(st)(jnp.full_like(st.amax_history, 3.0), st.sites, st.recipe))
d = ser.to_state_dict({"fp8": st})
back = ser.from_bytes(fmp.Float8State.zeros(st.sites, st.recipe), ser.to_bytes(st))
print(sorted(d["fp8"]), float(back.amax_history.sum()))
"""


@pytest.mark.parametrize("flax_first", [True, False])
def test_float8_state_flax_serialization_in_either_import_order(flax_first):
    # a fresh process each, nobody calls Float8State.register_flax_serialization()
    imp = "import flax.serialization as ser\n"
    src = imp + _ROUND_TRIP if flax_first else _ROUND_TRIP.replace("import fmp\n", "import fmp\n" + imp)
    assert run_python(src).strip() == "['amax_history'] 18.0"


def test_register_call_is_still_harmless():
    from flax import serialization

    st = fmp.Float8State.zeros(["a"], fmp.Float8Recipe("delayed", history_len=2))
    fmp.Float8State.register_flax_serialization()
    back = serialization.from_state_dict(st, serialization.to_state_dict(st))
    np.testing.assert_array_equal(np.asarray(back.amax_history), np.asarray(st.amax_history))
