"""Every primitive of the installed JAX that carries a sub-jaxpr is rewritten, kept as written, or refused by name."""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import ad, batching, mlir
from jax._src.interpreters import partial_eval as pe
from jax.extend.core import ClosedJaxpr, Jaxpr, jaxprs_in_params

import fmp
from fmp._autocast._engine import _jax_internals
from fmp._autocast._engine._interp import OPAQUE
from fmp._autocast._hops import _calls
from fmp._autocast._hops._control import HANDLERS

BF16 = jnp.dtype(jnp.bfloat16)
# parameter names of a primitive's rules that hold a sub-jaxpr (or a thunk that makes one)
_JAXPR_WORDS = ("jaxpr", "branches", "computation")


def _param_names(fn) -> set[str]:
    out: set[str] = set()
    for _ in range(5):
        if not isinstance(fn, functools.partial):
            break
        out |= set(fn.keywords)
        fn = fn.func
    fn = getattr(fn, "lowering", fn)
    try:
        out |= set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        pass
    return out


def _rule(table, prim):
    try:
        return table[prim]
    except (KeyError, TypeError):
        return None


def _statically_higher_order(prims) -> set[str]:
    """Primitives whose impl / abstract eval / lowering / jvp / batching / transpose rule takes a sub-jaxpr
    parameter, or that JAX's own registries of higher-order primitives (dce, custom typecheck, partial eval)
    or its CallPrimitive class name."""
    out = set()
    tables = [mlir._lowerings, ad.primitive_jvps, ad.primitive_transposes, batching.primitive_batchers]
    tables += list(mlir._platform_specific_lowerings.values())
    for name, prim in prims.items():
        fns = [getattr(prim, "impl", None), getattr(prim, "abstract_eval", None)]
        fns += [_rule(t, prim) for t in tables]
        names = set().union(*(_param_names(f) for f in fns if f is not None))
        if any(w in n for n in names for w in _JAXPR_WORDS):
            out.add(name)
    registries = [jax._src.core.custom_typechecks, pe.dce_rules, pe.partial_eval_jaxpr_custom_rules]
    for reg in registries:  # a primitive JAX's autodiff makes at run time (jax 0.12's vjp_node[...], the backward
        # half of a linearized call inside its own linear jaxprs) is no module's attribute: not a user's
        out |= {p.name for p in reg if p.name in prims}
    call_cls = getattr(jax._src.core, "CallPrimitive", ())  # jax 0.10; later releases' calls share eval_jaxpr's rules
    out |= {n for n, p in prims.items() if isinstance(p, call_cls)}
    # registries also hold first-order primitives (state refs, callbacks, shapes): keep those that are
    # higher-order by the signature test or by a sub-jaxpr in a real program (the corpus below)
    return out


def _closed_call(closed, *args):
    prim = jax.extend.core.primitives.closed_call_p
    return prim.bind(*args, **prim.get_bind_params({"call_jaxpr": closed}))


def _corpus_programs():
    """Public JAX APIs that take a function, traced on small inputs."""
    x = jnp.ones((3, 3))
    v = jnp.ones(3)

    @jax.custom_jvp
    def cj(a):
        return jnp.sin(a)

    cj.defjvp(lambda p, t: (jnp.sin(p[0]), jnp.cos(p[0]) * t[0]))

    @jax.custom_vjp
    def cv(a):
        return jnp.sin(a)

    cv.defvjp(lambda a: (jnp.sin(a), a), lambda a, g: (g * jnp.cos(a),))
    cvm = jax.custom_batching.custom_vmap(jnp.sin)
    cvm.def_vmap(lambda size, batched, a: (jnp.sin(a), batched[0]))
    progs = {
        "cond": lambda: jax.lax.cond(True, jnp.sin, jnp.cos, x),
        "switch": lambda: jax.lax.switch(1, [jnp.sin, jnp.cos], x),
        "scan": lambda: jax.lax.scan(lambda c, a: (c + a, a), v, x),
        "while": lambda: jax.lax.while_loop(lambda c: c[0] < 3, lambda c: c + 1, v),
        "fori": lambda: jax.lax.fori_loop(0, 3, lambda i, c: c * 2, v),
        "map": lambda: jax.lax.map(jnp.sum, x),
        "jit": lambda: jax.jit(jnp.sin)(x),
        "checkpoint": lambda: jax.checkpoint(jnp.sin)(x),
        "custom_jvp": lambda: cj(x),
        "custom_vjp": lambda: cv(x),
        "solve": lambda: jnp.linalg.solve(x + 3 * jnp.eye(3), v),
        "custom_root": lambda: jax.lax.custom_root(lambda y: y - 1.0, 0.0, lambda g, y: y - g(y), lambda g, y: y),
        "closed_call": lambda: _closed_call(jax.make_jaxpr(jnp.sin)(v), v),
        "composite": lambda: jax.lax.composite(lambda a: jnp.sin(a), name="my.sin")(x),
        "reduce": lambda: jax.lax.reduce(x, 0.0, jax.lax.add, (0,)),
        "reduce_window": lambda: jax.lax.reduce_window(x, 0.0, lambda a, b: a * b, (2, 2), (1, 1), "VALID"),
        "scatter": lambda: x.at[0].set(v),
        "sort": lambda: jax.lax.sort(v),
        "custom_vmap": lambda: cvm(v),
        "linear_call": lambda: jax.custom_derivatives.linear_call(lambda _, a: 2 * a, lambda _, a: 2 * a, (), v),
        "pure_callback": lambda: jax.pure_callback(np.sin, jax.ShapeDtypeStruct((3,), jnp.float32), v),
    }
    return progs


def _hops_in(closed) -> set[str]:
    found = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            subs = list(jaxprs_in_params(eqn.params))
            for value in eqn.params.values():  # custom_linear_solve holds its jaxprs in a NamedTuple
                if isinstance(value, tuple):
                    subs += [j for j in value if isinstance(j, ClosedJaxpr | Jaxpr)]
            if subs:
                found.add(eqn.primitive.name)
            for sub in subs:
                walk(sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub)

    walk(closed.jaxpr)
    return found


def _covered(name: str, prims) -> bool:
    prim = prims.get(name)
    return name in OPAQUE or (prim is not None and prim in HANDLERS)


def test_every_higher_order_primitive_of_jax_is_covered() -> None:
    prims = _jax_internals.primitives_by_name()
    static = _statically_higher_order(prims)
    closed_call = _jax_internals.closed_call_p.name  # "closed_call" on jax 0.10, "eval_jaxpr" on 0.11 and 0.12
    for must in ("cond", "scan", "while", "jit", "custom_linear_solve", closed_call, "reduce", "shard_map"):
        assert must in static, f"the enumeration misses {must}: it is broken"
    dynamic = set()
    for prog in _corpus_programs().values():
        dynamic |= _hops_in(jax.make_jaxpr(prog)())
    assert {"cond", "scan", "while", "custom_linear_solve", closed_call, "composite"} <= dynamic
    # a first-order primitive in the registries (a state ref, a callback) passes through fine, so the
    # static set is narrowed to those whose rules take a sub-jaxpr or that carry one in a real program
    first_order = {n for n in static - dynamic if not _takes_jaxpr(prims[n])}
    missing = sorted(n for n in (static - first_order) | dynamic if not _covered(n, prims))
    assert not missing, f"higher-order primitives neither rewritten, kept as written nor refused: {missing}"


def _takes_jaxpr(prim) -> bool:
    tables = [mlir._lowerings, ad.primitive_jvps, ad.primitive_transposes, batching.primitive_batchers]
    fns = [getattr(prim, "impl", None), getattr(prim, "abstract_eval", None)] + [_rule(t, prim) for t in tables]
    names = set().union(*(_param_names(f) for f in fns if f is not None))
    return any(w in n for n in names for w in _JAXPR_WORDS) or prim.name in {
        p.name for p in list(pe.dce_rules) + list(jax._src.core.custom_typechecks) if p.name not in _FIRST_ORDER
    }


# first-order primitives JAX registers dce / typecheck / partial-eval rules for (refs, shapes, callbacks)
_FIRST_ORDER = {
    "broadcast_in_dim",
    "dynamic_slice",
    "iota",
    "reshape",
    "free_ref",
    "addupdate",
    "get",
    "swap",
    "new_ref",
    "debug_callback",
    "debug_print",
}


@pytest.mark.parametrize("name", sorted(_calls.REFUSED))
def test_refusal_names_the_primitive(name: str) -> None:
    assert len(_calls.REFUSED[name]) > 10  # the error gives a reason
    prim = _jax_internals.primitives_by_name().get(name)
    if prim is not None:
        assert HANDLERS[prim] is _calls._refuse


@pytest.mark.parametrize("api", ["custom_vmap", "linear_call"])
def test_refused_primitives_raise_a_clear_error(api: str) -> None:
    prog = _corpus_programs()[api]
    closed = jax.make_jaxpr(prog)()
    name = {"custom_vmap": "custom_vmap_call", "linear_call": "linear_call"}[api]
    with pytest.raises(NotImplementedError, match=rf"primitive '{name}'.*enabled=False"):
        fmp.autocast_jaxpr(closed)


def test_closed_call_body_is_rewritten() -> None:
    x, w = jnp.ones((2, 3)), jnp.full((3, 4), 0.1)
    body = jax.make_jaxpr(lambda a, b: jnp.tanh(a @ b))(x, w)

    def f(x, w):
        return _closed_call(body, x, w)[0]

    new = fmp.autocast_jaxpr(jax.make_jaxpr(f)(x, w))
    (call,) = [e for e in new.eqns if e.primitive is _jax_internals.closed_call_p]
    dots = [e for e in call.params["call_jaxpr"].eqns if e.primitive.name == "dot_general"]
    assert [d.invars[0].aval.dtype for d in dots] == [BF16]
    hand = jnp.tanh(x.astype(BF16) @ w.astype(BF16))
    np.testing.assert_array_equal(np.asarray(fmp.autocast(f)(x, w)), np.asarray(hand.astype(jnp.float32)))
    g = jax.grad(lambda w: jnp.sum(fmp.autocast(f)(x, w)))(w)
    gh = jax.grad(lambda w: jnp.sum(jnp.tanh(x.astype(BF16) @ w.astype(BF16)).astype(jnp.float32)))(w)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(gh))


def test_composite_decomposition_is_rewritten_with_its_boundary_kept() -> None:
    x, w = jnp.ones((2, 3)), jnp.full((3, 4), 0.1)
    comp = jax.lax.composite(lambda a, b: jnp.tanh(a @ b), name="my.dense")
    new = fmp.autocast_jaxpr(jax.make_jaxpr(comp)(x, w))
    (eqn,) = [e for e in new.eqns if e.primitive.name == "composite"]
    inner = eqn.params[_jax_internals.body_param(eqn.params)]  # "jaxpr" on jax 0.10, "call_jaxpr" later
    assert [a.dtype for a in inner.in_avals] == [jnp.float32, jnp.float32]
    assert [e.invars[0].aval.dtype for e in inner.eqns if e.primitive.name == "dot_general"] == [BF16]
    out = fmp.autocast(comp)(x, w)
    np.testing.assert_allclose(np.asarray(out), np.asarray(comp(x, w)), rtol=1e-2)


def test_a_call_with_params_of_its_own_keeps_them() -> None:
    """jax 0.11+'s xla_metadata_call: the body is rewritten like a plain call's, the metadata kept."""
    xla_metadata = pytest.importorskip("jax.experimental.xla_metadata")
    if not hasattr(xla_metadata, "xla_metadata_call"):
        pytest.skip("xla_metadata_call: jax 0.11 and later")
    x, w = jnp.ones((2, 3)), jnp.full((3, 4), 0.1)
    f = xla_metadata.xla_metadata_call(group="g1")(lambda a, b: jnp.tanh(a @ b))
    new = fmp.autocast_jaxpr(jax.make_jaxpr(f)(x, w))
    (eqn,) = [e for e in new.eqns if e.primitive.name == "xla_metadata_call"]
    assert eqn.params["xla_metadata"] == jax.make_jaxpr(f)(x, w).eqns[0].params["xla_metadata"]
    body = eqn.params[_jax_internals.body_param(eqn.params)]
    assert [e.invars[0].aval.dtype for e in body.eqns if e.primitive.name == "dot_general"] == [BF16]
    hand = jnp.tanh(x.astype(BF16) @ w.astype(BF16)).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(fmp.autocast(f)(x, w)), np.asarray(hand))
