"""Per-field dtypes for any optax state: e.g. Adam's ``mu`` in bfloat16 and ``nu`` in float32 between steps."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fmp._rounding import ROUNDED_DTYPES, round_stochastic
from fmp.optax._checks import check_inner, check_state, check_updates

_MSG_UNKNOWN = (
    "state_dtypes: no field named {} in the state of the wrapped transformation; its state has the fields {} "
    "(optax's state NamedTuples, e.g. optax.adam's ScaleByAdamState(count, mu, nu))"
)
_MSG_DTYPE = "state_dtypes: {}= must be a floating dtype such as 'bfloat16' or jnp.float32, got {!r}"
_MSG_ROUNDING = "state_dtypes: rounding must be 'nearest' or 'stochastic', got {!r}"


class StateDtypesState(NamedTuple):
    """State of `state_dtypes`.

    Attributes:
      inner_state: The wrapped transformation's state, its named fields stored in the requested dtypes.
      key: With ``rounding="stochastic"``, the raw PRNG key (uint32, shape ``(2,)``) of the next step's
        rounding; None with ``rounding="nearest"``.

    Examples:
      >>> import optax, fmp.optax
      >>> opt = fmp.optax.state_dtypes(optax.rmsprop(1e-3), nu="bfloat16")
      >>> state = opt.init({"w": jnp.zeros(2)})
      >>> type(state).__name__, state.inner_state[0].nu["w"].dtype, state.key
      ('StateDtypesState', dtype(bfloat16), None)
    """

    inner_state: optax.OptState
    key: jax.Array | None


def _is_nt(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _map_fields(tree: Any, fn: Any) -> Any:
    """``fn(name, value)`` for every field of every NamedTuple in ``tree`` (nested ones too, via ``fn``)."""

    def visit(x: Any) -> Any:
        if _is_nt(x):
            return type(x)(*(fn(name, visit(v)) for name, v in zip(x._fields, x, strict=True)))
        return jax.tree.map(lambda y: visit(y) if _is_nt(y) else y, x, is_leaf=_is_nt)

    return visit(tree)


def field_names(tree: Any) -> list[str]:
    """The field names of every NamedTuple inside ``tree`` (an optax state), sorted."""
    names: set[str] = set()

    def collect(name: str, value: Any) -> Any:
        names.add(name)
        return value

    _map_fields(tree, collect)
    return sorted(names)


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and bool(jnp.issubdtype(x.dtype, jnp.floating))


def _widened(x: Any) -> Any:
    return x.astype(jnp.float32) if _is_float(x) and x.dtype.itemsize < 4 else x


def _parse_dtype(name: str, dtype: Any) -> np.dtype:
    try:
        out = np.dtype(dtype) if dtype is not None else None
    except TypeError:
        out = None
    if out is None or not jnp.issubdtype(out, jnp.floating):
        raise TypeError(_MSG_DTYPE.format(name, dtype))
    return out


def state_dtypes(
    inner: optax.GradientTransformation, *, rounding: str = "nearest", seed: int = 0, **fields: Any
) -> optax.GradientTransformationExtraArgs:
    """Stores named fields of ``inner``'s state in the dtypes you give; computes in at least float32.

    ``state_dtypes(optax.adam(1e-3), mu="bfloat16", nu="float32")`` keeps Adam's first moment in bfloat16
    (2 bytes per parameter instead of 4) and its second in float32, whatever the params' dtype. Fields are
    matched by name in optax's state NamedTuples, also nested in chains and wrappers (every field of that
    name gets the dtype). Each update widens every bfloat16/float16 state leaf, gradient and param to float32,
    runs ``inner``, and stores each state leaf back in its dtype: the requested one for named fields, the one
    ``inner.init`` gave for the others. The updates come back in the gradients' dtype.

    With ``rounding="stochastic"`` the narrowing of bfloat16/float16 state leaves rounds stochastically
    (unbiased) instead of to nearest. It matters for slow averages: Adam's ``nu`` with ``b2=0.999`` changes
    by 0.1% a step, under half of bfloat16's relative spacing, so to nearest it cannot decay.

    Put `stochastic_round` or `kahan` after it, not inside it (inside, they would see float32 params).

    Args:
      inner: Any optax transformation.
      rounding: ``"nearest"`` (default) or ``"stochastic"``.
      seed: The PRNG seed for ``rounding="stochastic"``.
      **fields: Field name to dtype, e.g. ``mu="bfloat16"``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a `StateDtypesState`.

    Raises:
      TypeError: ``inner`` is not a transformation, a dtype is not floating, or ``seed`` is not an int.
      ValueError: ``rounding`` is unknown; from ``init``: a field name the state does not have (the message
        lists the ones it has).

    Examples:
      >>> import optax
      >>> import fmp.optax
      >>> opt = fmp.optax.state_dtypes(optax.rmsprop(1e-3, momentum=0.9), trace="bfloat16", nu="float32")
      >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
      >>> state = opt.init(params)
      >>> updates, state = opt.update({"w": jnp.ones(3, jnp.bfloat16)}, state, params)
      >>> rms, _, trace = state.inner_state
      >>> rms.nu["w"].dtype, trace.trace["w"].dtype, updates["w"].dtype
      (dtype('float32'), dtype(bfloat16), dtype(bfloat16))
      >>> fmp.optax.state_dtypes(optax.rmsprop(1e-3), mu="bfloat16").init(params)
      Traceback (most recent call last):
      ...
      ValueError: state_dtypes: no field named mu in the state of the wrapped transformation; its state has the fields nu (...)
    """
    check_inner(inner, "state_dtypes")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(_MSG_ROUNDING.format(rounding))
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"state_dtypes: seed must be an int, got {seed!r}")
    dtypes = {name: _parse_dtype(name, d) for name, d in fields.items()}
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: optax.Params) -> StateDtypesState:
        state = inner.init(params)
        have = field_names(state)
        unknown = sorted(set(dtypes) - set(have))
        if unknown:
            raise ValueError(_MSG_UNKNOWN.format(", ".join(unknown), ", ".join(have) or "(none)"))

        def cast(name: str, value: Any) -> Any:
            if name not in dtypes:
                return value
            return jax.tree.map(lambda x: x.astype(dtypes[name]) if _is_float(x) else x, value)

        key = jax.random.PRNGKey(seed) if rounding == "stochastic" else None
        return StateDtypesState(_map_fields(state, cast), key)

    def update_fn(updates, state, params=None, **extra_args):
        check_state(state, StateDtypesState, "state_dtypes.update")
        updates = check_updates(updates, params, "state_dtypes.update")
        wide = jax.tree.map(_widened, state.inner_state)
        new_updates, new_inner = inner.update(
            jax.tree.map(_widened, updates), wide, jax.tree.map(_widened, params), **extra_args
        )
        flat_new, treedef = jax.tree.flatten(new_inner)
        flat_old = jax.tree.leaves(state.inner_state)
        key = state.key
        if key is not None:
            key, sub = jax.random.split(key)
        out = []
        for i, (new, old) in enumerate(zip(flat_new, flat_old, strict=True)):
            if not hasattr(old, "dtype") or new.dtype == old.dtype:
                out.append(new)
            elif key is not None and np.dtype(old.dtype) in ROUNDED_DTYPES and _is_float(new):
                bits = jax.random.bits(jax.random.fold_in(sub, i), new.shape, jnp.uint32)
                out.append(round_stochastic(new, old.dtype, bits))
            else:
                out.append(new.astype(old.dtype))
        new_updates = jax.tree.map(lambda u, g: u.astype(g.dtype), new_updates, updates)
        return new_updates, StateDtypesState(jax.tree.unflatten(treedef, out), key)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
