"""What keeps a repeated ``fmp.explain(compare=True)`` cheap: a second call on arguments of the same shapes
compiles nothing (with ``grads=True`` too: the gradients' compilations are reused), gives the report a fresh
``explain`` gives on the same values, and the backward rows' statistics reach the host together, not once per
operation. The cost itself is measured by ``bench/explain.py``, never asserted here."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest

import fmp
from fmp._autocast._explain import _grads

_COMPILE = "/jax/core/compile/backend_compile_duration"


def _loss(p: dict, x: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(jnp.tanh(x @ p["w1"]) @ p["w2"]))


def _scaled(p: dict, x: jax.Array, k: float) -> jax.Array:
    return _loss(p, x * k)


def _args(seed: int) -> tuple[dict, jax.Array]:
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    params = {"w1": jax.random.normal(k1, (8, 16)) / 3, "w2": jax.random.normal(k2, (16, 4)) / 4}
    return params, jax.random.normal(k3, (4, 8))


def _compiles(call: Any) -> tuple[int, Any]:
    """How many XLA compilations ``call()`` runs, and what it returns."""
    seen: list[str] = []

    def listen(event: str, duration: float, **kwargs: Any) -> None:
        if event == _COMPILE:
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        out = call()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return len(seen), out


@pytest.mark.parametrize("grads", [False, True])
def test_a_repeated_call_compiles_nothing_and_reports_the_same(grads: bool) -> None:
    explain = fmp.explain(_loss, "mixed_float16", compare=True, grads=grads)
    first, _ = _compiles(lambda: explain(*_args(0)))
    again, rep = _compiles(lambda: explain(*_args(1)))  # new values, the same shapes
    assert again == 0, f"the repeated call compiled {again} programs (the first: {first})"
    fresh = fmp.explain(_loss, "mixed_float16", compare=True, grads=grads)(*_args(1))
    assert rep.to_dict() == fresh.to_dict()
    if grads:
        assert first >= 2  # the compiled reference and policy gradients, once
        assert rep.grad_rows and rep.grad_errors["['w1']"].error > 0


def test_other_shapes_or_static_values_are_traced_again() -> None:
    explain = fmp.explain(_scaled, compare=True, grads=True)
    params, x = _args(0)
    explain(params, x, 2.0)
    rep = explain(params, x, 3.0)  # a non-array argument is part of the program: not the one traced for 2.0
    assert rep.to_dict() == fmp.explain(_scaled, compare=True, grads=True)(params, x, 3.0).to_dict()
    assert explain(params, x[:2], 3.0).grad_errors.keys() == rep.grad_errors.keys()


def test_backward_statistics_reach_the_host_together(monkeypatch: pytest.MonkeyPatch) -> None:
    fetched: list[int] = []
    resolve = _grads.resolve

    def counted(deferred: Any) -> None:
        fetched.append(len(deferred))
        resolve(deferred)

    monkeypatch.setattr(_grads, "resolve", counted)
    rep = fmp.explain(_loss, compare=True, grads=True)(*_args(0))
    assert len(rep.grad_rows) > 10
    assert fetched == [2 * len(rep.grad_rows)]  # one transfer: every row's output and added-error statistics


def test_a_new_wrapper_of_the_same_function_reuses_the_compiled_comparison() -> None:
    fmp.explain(_loss, "mixed_float16", compare=True)(*_args(0))
    again, rep = _compiles(lambda: fmp.explain(_loss, "mixed_float16", compare=True)(*_args(1)))
    assert again == 0, f"a new explain wrapper compiled {again} programs"
    assert rep.output_error is not None
