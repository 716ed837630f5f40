"""The rewrite's cost is linear in the size of the program.

Every analysis the rewrite makes of the original program (a constant's bound, where a value comes from,
whether an operand is a weight, whether a helper call can stay a call) walks values of that program;
each answer is kept, so a value is walked a bounded number of times however long the program is. The
walks count their steps (``_provenance.STEPS``): an unrolled MLP four times as deep takes about four
times the steps, where a walk back through the whole program per equation (a bound of every helper's
operands found anew at every call) would take sixteen times as many.
"""

from __future__ import annotations

import gc
import os
import sys
import weakref

import jax
import jax.numpy as jnp
import pytest

import fmp
from fmp._autocast._engine import _jax_internals
from fmp._autocast._engine._frames import Frame
from fmp._autocast._engine._lru import LRU
from fmp._autocast._engine._provenance import STEPS

D = 8


def _params(layers: int) -> list[dict[str, jax.Array]]:
    ones, zeros = jnp.ones((D,)), jnp.zeros((D,))
    w1, w2 = jnp.full((D, 2 * D), 0.1), jnp.full((2 * D, D), 0.1)
    return [{"g": ones, "b": zeros, "w1": w1, "b1": jnp.zeros((2 * D,)), "w2": w2, "b2": zeros}] * layers


def _mlp(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    """Pre-LN MLP blocks, unrolled: layernorm, a Dense layer, gelu, a Dense layer, the residual add."""
    for p in params:
        m = x.mean(-1, keepdims=True)
        h = (x - m) * jax.lax.rsqrt(jnp.square(x - m).mean(-1, keepdims=True) + 1e-5) * p["g"] + p["b"]
        x = x + jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    return jnp.mean(x**2)


def _steps(layers: int, policy: str) -> int:
    STEPS.clear()
    jax.make_jaxpr(fmp.autocast(_mlp, policy))(_params(layers), jnp.ones((2, D)))
    return sum(STEPS.values())


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float8"])
def test_walk_steps_grow_linearly_with_depth(policy):
    shallow, deep = _steps(64, policy), _steps(256, policy)
    assert shallow > 64  # the walks ran (a counter nobody increments would pass any ratio)
    assert deep / shallow < 5.0, (shallow, deep)  # linear: ~4x; quadratic: ~16x


_FMP = os.path.dirname(fmp.__file__) + os.sep


def _fmp_lines(layers: int, policy: str) -> int:
    """Lines of fmp's own code the rewrite runs (a loop's every turn counts: ``sys.settrace`` line events,
    traced in fmp's frames only)."""
    args, count = (_params(layers), jnp.ones((2, D))), [0]

    def in_fmp(frame, event, arg):
        count[0] += 1
        return in_fmp

    def enter(frame, event, arg):
        return in_fmp if frame.f_code.co_filename.startswith(_FMP) else None

    sys.settrace(enter)
    try:
        jax.make_jaxpr(fmp.autocast(_mlp, policy))(*args)
    finally:
        sys.settrace(None)
    return count[0]


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float8"])
def test_lines_run_in_fmp_grow_linearly_with_depth(policy):
    """All of the rewrite, walks or not: a pass over all the program's weights per float8 operand (asking
    whether the operand comes from a custom_jvp rule's tangents) once made this 5.5x for 4x the layers."""
    shallow, deep = _fmp_lines(8, policy), _fmp_lines(32, policy)
    assert shallow > 8 * 1000, shallow  # the trace saw the rewrite
    assert deep / shallow < 4.5, (shallow, deep)  # linear: 3.6-3.8x


def test_no_frame_of_a_rewrite_is_left_for_the_garbage_collector():
    # the frames the walks keep refer to their parents; once a rewrite returns, all are freed at once (no
    # reference cycle left for the collector's full passes, which a deep program makes long)
    gc.collect()
    gc.disable()
    try:
        jax.make_jaxpr(jax.grad(fmp.autocast(_mlp)))(_params(4), jnp.ones((2, D)))
        left = [o for o in gc.get_objects() if type(o) is Frame]
    finally:
        gc.enable()
    assert not left, f"{len(left)} frames of the walks outlived the rewrite"


def _rewrite_once() -> tuple[weakref.ref, weakref.ref]:
    big = jnp.full((64, D), 3.0)  # closed over: a constant of the program, measured for its bound

    def f(x):
        return jnp.sum((x @ big.T) * big[0, 0])

    closed = jax.make_jaxpr(f)(jnp.ones((2, D)))
    assert any(c is big for c in closed.consts)
    rewritten = fmp.autocast_jaxpr(closed, "mixed_bfloat16")
    assert any(e.primitive.name == "dot_general" for e in rewritten.jaxpr.eqns)
    return weakref.ref(closed.jaxpr), weakref.ref(big)


def test_the_caches_keep_neither_the_program_nor_its_constants_alive():
    program, constant = _rewrite_once()
    gc.collect()
    assert program() is None, "the traced program is still held after its rewrite"
    assert constant() is None, "a closed-over array is still held after its rewrite"


def test_a_cache_entry_goes_with_its_object_and_an_id_reused_is_not_a_hit():
    cache, made = LRU(8), []

    class Body:  # stands for a jaxpr: weakly referable
        pass

    def make(tag):
        made.append(tag)
        return tag

    a = Body()
    assert cache.of(a, id(a), lambda: make("a")) == "a"
    assert cache.of(a, id(a), lambda: make("again")) == "a"  # a hit
    key = id(a)
    del a
    gc.collect()
    assert len(cache) == 0  # the entry went with its object
    b = Body()
    assert cache.of(b, key, lambda: make("b")) == "b"  # even under the same key, a new object is made anew
    held = [1, 2]  # a tuple takes no weak reference: held by the entry, still correct
    assert cache.of(tuple(held), 99, lambda: make("t")) == "t"
    assert made == ["a", "b", "t"]


def _bounds(program, made_from=None) -> list:
    """``_constants.bound`` of every value of ``program``'s top level, in a fresh frame; ``made_from``
    replaces the per-body summary the walk consults before going into a helper's body."""
    from fmp._autocast._engine import _constants
    from fmp._autocast._engine._frames import frame_of

    saved = _constants._made_from
    if made_from is not None:
        _constants._made_from = made_from
    try:
        frame = frame_of(program.jaxpr)
        return [_constants.bound(v, frame) for e in program.jaxpr.eqns for v in e.outvars]
    finally:
        _constants._made_from = saved


class _AlwaysGoIn(dict):
    """Every output of every body may be known, with no input checked first: the walk goes into each body."""

    def get(self, key, default=None):
        return ()


def _with_inline_calls(program):
    """``program`` with its ``jit`` calls marked as JAX marks jnp's helpers (inlined when staged), so that the
    walks go into their bodies as into a helper's."""
    eqns = [
        e.replace(params=dict(e.params, inline=_jax_internals.INLINE_WHEN_STAGED)) if e.primitive.name == "jit" else e
        for e in program.jaxpr.eqns
    ]
    return program.replace(jaxpr=program.jaxpr.replace(eqns=eqns))


def test_a_walk_skips_a_helper_body_only_where_going_in_would_find_a_runtime_value():
    big = float(jnp.finfo(jnp.float32).max)

    @jax.jit
    def helper(mask, i, a, b, x):
        return [
            jax.lax.select_n(mask, a, b),  # a runtime predicate, constant values: known
            jax.lax.dynamic_slice(a, (i,), (2,)),  # a runtime index: known
            a * 0.5 + b,  # arithmetic on constants: known
            jnp.concatenate([a, b]),  # known
            jnp.sum(a),  # a reduction: unknown whatever its operand
            x - a,  # a runtime value: unknown
            jax.lax.select_n(mask, x, b),  # unknown: x is among the values
        ]

    def f(x, mask, i):
        outs = helper(mask, i, jnp.full((4,), -big), jnp.ones(4), x)
        return [*outs, jnp.full((4,), big) * 2.0]  # an inline helper at the top level too (jnp's multiply)

    with _jax_internals.keep_inline_calls():
        program = _with_inline_calls(jax.make_jaxpr(f)(jnp.ones(4), jnp.ones(4, bool), 1))
    fast, walked = _bounds(program), _bounds(program, lambda body: _AlwaysGoIn())
    assert fast == walked
    known = [b for b in fast if b is not None]
    assert len(known) >= 5 and max(known) >= big and None in fast, fast  # both kinds are among them
    STEPS.clear()
    _bounds(program)
    fast_steps = sum(STEPS.values())
    STEPS.clear()
    _bounds(program, lambda body: _AlwaysGoIn())
    assert fast_steps < sum(STEPS.values())  # and it did skip some


def test_helper_bodies_nested_deeper_than_the_recursion_limit_are_read_with_a_stack():
    from fmp._autocast._engine import _constants

    program = _with_inline_calls(jax.make_jaxpr(lambda a: jax.jit(lambda b: -b)(a))(jnp.ones(4)))
    call = program.jaxpr.eqns[0]
    for _ in range(sys.getrecursionlimit()):  # the body becomes a call of the previous body, over and over
        body = call.replace(params=dict(call.params, jaxpr=program))
        program = program.replace(jaxpr=program.jaxpr.replace(eqns=[body]))
    # the output is the input negated, through every level (a recursive reading took 4 frames per level)
    assert _constants._made_from(program.jaxpr.eqns[0].params["jaxpr"].jaxpr) == {0: frozenset({0})}
