"""GradScaler: the dynamic loss scale as an immutable pytree, and the tree helpers it needs.

Every operation is pure and jit-safe: nothing here syncs to the host except
[`GradScaler.state_dict`][fmp.GradScaler.state_dict] and [`nonfinite_leaves`][fmp.nonfinite_leaves], which are meant for
checkpoints and diagnosis, off the hot path. The update rule itself lives in
``fmp._core._scaler_rule`` and is shared with the torch facade.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fmp._arrays import check_leaf
from fmp._core import _scaler_rule
from fmp._fp8._state import Float8State

_UNSET: Any = object()  # sentinel: "build the arrays from init_scale"

_MSG_FINITE = (
    "finite must be a bool scalar (the flag returned by fmp.all_finite or fmp.value_and_grad), got {got}. "
    "Pass finite=fmp.all_finite(grads)."
)


# --- float64 scalar arithmetic, as torch does it --------------------------------------------------------------------
def _f64(fn):
    """Runs ``fn`` with float64 enabled, so scalar products round like torch's ``double`` kernels.

    torch computes ``float32(float64(scale) * factor)`` and ``float32(1 / float64(scale))``; a float32
    product of a non-power-of-two factor (1.1, 0.3) gives different bits. The float64 work is on scalars only.
    """

    @functools.wraps(fn)
    def wrapper(*args):
        with jax.enable_x64(True):
            return fn(*args)

    return wrapper


@_f64
def _mul_f64(scale: jax.Array, factor: float) -> jax.Array:
    return (jnp.asarray(scale).astype(jnp.float64) * factor).astype(jnp.float32)


@_f64
def _reciprocal_f64(scale: jax.Array) -> jax.Array:
    return (1.0 / jnp.asarray(scale).astype(jnp.float64)).astype(jnp.float32)


class _JaxOps:
    """The array namespace ``fmp._core._scaler_rule.update_scale`` runs on."""

    where = staticmethod(jnp.where)
    isfinite = staticmethod(jnp.isfinite)
    minimum = staticmethod(jnp.minimum)
    maximum = staticmethod(jnp.maximum)
    mul_f64 = staticmethod(_mul_f64)


# --- tree helpers ---------------------------------------------------------------------------------------------------
def _checked_leaves(tree: Any, where: str) -> list[tuple[Any, jax.Array]]:
    """``(path, leaf)`` for every leaf that can hold an inf/NaN: float and complex arrays, Python floats.

    Integer and bool leaves (arrays or Python numbers) cannot, and are left out.

    Raises:
      TypeError: a leaf is neither an array nor a number (a string, an object), or is another
        framework's array (a torch tensor).
    """
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        check_leaf(x, where, path)
        if isinstance(x, float | complex):
            x = jnp.asarray(x)
        elif not hasattr(x, "dtype"):
            if isinstance(x, int):  # bool included
                continue
            raise TypeError(
                f"{where}: every leaf must be an array or a number, got {type(x).__name__} at "
                f"{jax.tree_util.keystr(path) or 'the root'}"
            )
        if jnp.issubdtype(x.dtype, jnp.inexact):
            out.append((path, x))
    return out


_SMALL_LEAF = 1 << 14  # elements


def _groupable(x: Any) -> bool:
    """Small, non-empty, and not explicitly sharded (ravelling an explicitly sharded array is an error)."""
    if not 0 < x.size <= _SMALL_LEAF:
        return False
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    return spec is None or all(axis is None for axis in spec)


def _apart_from_unscale(x: jax.Array) -> jax.Array:
    # A 16-bit leaf is summed in float32; XLA CSE would merge that convert with the one in `unscale` and
    # materialise the shared convert: a float32 copy of the whole gradient tree. The barrier keeps the
    # two apart.
    return jax.lax.optimization_barrier(x) if x.dtype.itemsize < 4 else x


def _leaf_sum_finite(x: jax.Array) -> jax.Array:
    """isfinite(sum(x)): True proves every element finite; False may be an overflow of the sum."""
    if x.size == 0:
        return jnp.array(True)
    if x.dtype == jnp.float16:
        return _leaf_finite(x)  # a float16 sum overflows at 65504: use the exact check directly
    acc = jnp.float32 if x.dtype.itemsize < 4 else None
    return jnp.isfinite(jnp.sum(_apart_from_unscale(x), dtype=acc))


def _leaf_finite(x: jax.Array) -> jax.Array:
    # sum(x - x) is 0 when every element is finite and NaN otherwise (inf - inf is NaN, and a sum
    # cannot drop a NaN): one read of the leaf and a sum-reduction, which XLA CPU vectorises and splits
    # over threads. No constant operand (x * 0 would be: XLA shares one broadcast zero array between
    # equal-shaped leaves and materialises it, a tree-sized read more). Not max(|x|): XLA CPU's max-reduction of 16384+ elements (the YNNPACK path) drops
    # NaN, so a NaN gradient would pass as finite (jax 0.10.2).
    if x.size == 0:
        return jnp.array(True)
    x = _apart_from_unscale(x)
    if x.dtype == jnp.float16:
        # XLA CPU computes float16 arithmetic in float32 and would materialise x - x as a float32 copy
        # before the sum; a bool and-reduction of isfinite fuses with the read instead
        return jnp.all(jnp.isfinite(x))
    acc = jnp.float32 if x.dtype.itemsize <= 4 else x.dtype
    return jnp.sum(x - x, dtype=acc) == 0


def all_finite(tree: Any, axis_name: Any = None) -> jax.Array:
    """Returns True if no floating leaf of ``tree`` holds an inf or NaN.

    One read of every leaf, combined on device into one bool scalar: no host sync, so it is cheap
    inside ``jax.jit``. The read is a plain sum per leaf (the fastest reduction XLA has): a sum cannot
    hide an inf or NaN, so finite sums prove a finite tree. Finite values whose sum overflows make it
    look non-finite; only then (a ``lax.cond``, not taken on normal steps) an exact element-wise check
    decides, so the answer is always exact, as torch's. Float and complex leaves are checked (Python
    floats too); integer and bool leaves are ignored (they cannot be inf/NaN). An empty tree
    (``None``, ``{}``) is finite.

    Args:
      tree: Any pytree of arrays (typically gradients).
      axis_name: Inside ``shard_map``/``pmap``, the mapped axis (or tuple of axes) to all-reduce the
        flag over, so every device agrees and all skip together. Leave it None under plain ``jit``
        with sharded arrays: the reduction is already global there.

    Returns:
      A bool scalar array.

    Raises:
      TypeError: a leaf is neither an array nor a number.

    Examples:
      >>> fmp.all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])})
      Array(False, dtype=bool)
      >>> fmp.all_finite([jnp.zeros(2), jnp.arange(3)])
      Array(True, dtype=bool)
    """
    leaves = [x for _, x in _checked_leaves(tree, "all_finite(tree)")]
    big = [x for x in leaves if not _groupable(x)]
    small: dict[Any, list[jax.Array]] = {}
    for x in leaves:
        if _groupable(x):
            small.setdefault(x.dtype, []).append(jnp.ravel(x))
    # Small leaves (biases, norms) are checked together: one kernel per dtype instead of one per leaf,
    # for the price of copying a few kilobytes.
    groups = [xs[0] if len(xs) == 1 else jnp.concatenate(xs) for xs in small.values()]
    # Fast path: a plain sum of each big leaf (0.72 bandwidth units for 25M float32 elements on the
    # 2-core CPU against 0.96 for sum(g - g)). A sum of finite values can overflow (falsely "not
    # finite") but can never hide an inf or NaN, so when every sum is finite the tree is; otherwise the
    # exact check runs in a cond. The small groups keep the exact check (XLA splits a plain sum of a
    # concatenation back into two tiny kernels per leaf; they are a few kilobytes).
    flags = [_leaf_sum_finite(x) for x in big] + [_leaf_finite(x) for x in groups]
    fast = functools.reduce(jnp.logical_and, flags, jnp.array(True))
    # The slow branch takes the leaves, not the groups (XLA would keep the concatenation alive for it
    # and split the groups' sums again). The fast branch returns the flag itself (True there) so both
    # branches carry the same varying-axes type under shard_map.
    finite = jax.lax.cond(
        fast,
        lambda flag, xs: flag,
        lambda flag, xs: functools.reduce(jnp.logical_and, [_leaf_finite(x) for x in xs], jnp.array(True)),
        fast,
        leaves,
    )
    if axis_name is not None:
        finite = jax.lax.psum(jnp.logical_not(finite).astype(jnp.int32), axis_name) == 0
    return finite


def select_tree(pred: jax.typing.ArrayLike, a: Any, b: Any) -> Any:
    """Picks ``a`` where ``pred`` is True, else ``b``, leaf by leaf (``jnp.where`` on every leaf).

    Args:
      pred: Bool scalar.
      a: Pytree picked where ``pred`` is True.
      b: Pytree with the same structure, shapes and dtypes as ``a``.

    Returns:
      A pytree like ``a``. Skipping a step is ``select_tree(finite, new_params, params)``: the
      kept leaves are bit-identical to ``b``.

    Raises:
      ValueError: ``a`` and ``b`` differ in structure, or two leaves differ in shape.
      TypeError: ``pred`` is not a bool scalar, or two leaves differ in dtype.

    Examples:
      >>> fmp.select_tree(jnp.array(False), {"w": jnp.ones(2)}, {"w": jnp.zeros(2)})
      {'w': Array([0., 0.], dtype=float32)}
    """
    pred = _check_flag(pred, "pred")
    ta, tb = jax.tree.structure(a), jax.tree.structure(b)
    if ta != tb:
        raise ValueError(f"select_tree: a and b must have the same tree structure, got {ta} and {tb}")

    def pick(path, x, y):
        check_leaf(x, "select_tree(a)", path)
        check_leaf(y, "select_tree(b)", path)
        x, y = jnp.asarray(x), jnp.asarray(y)
        if x.dtype != y.dtype:
            raise TypeError(f"select_tree: leaves of a and b must have the same dtype, got {x.dtype} and {y.dtype}")
        if x.shape != y.shape:
            # jnp.where would broadcast them: a step that changes a shape is a bug, not a select
            raise ValueError(f"select_tree: leaves of a and b must have the same shape, got {x.shape} and {y.shape}")
        return jnp.where(pred, x, y)

    return jax.tree_util.tree_map_with_path(pick, a, b)


# one jitted function for every call (a lambda jitted per call would retrace and recompile each time)
_leaf_flags = jax.jit(lambda xs: [_leaf_finite(x) for x in xs])


def nonfinite_leaves(grads: Any) -> list[str]:
    """Lists the tree paths of the leaves of ``grads`` that hold an inf or NaN (a host-side diagnostic).

    Computes one flag per leaf on device and fetches them in one transfer; call it outside ``jit``,
    for example after a step reported ``finite == False``. Float and complex leaves (arrays or Python
    floats) are checked; integer and bool leaves cannot hold inf/NaN and are never listed.

    Args:
      grads: A pytree of arrays.

    Returns:
      The ``jax.tree_util.keystr`` of each offending leaf, in tree order.

    Examples:
      >>> fmp.nonfinite_leaves({"a": jnp.ones(2), "b": {"c": jnp.array([jnp.nan])}})
      ["['b']['c']"]
    """
    paths, leaves = [], []
    for path, leaf in _checked_leaves(grads, "nonfinite_leaves(grads)"):
        paths.append(jax.tree_util.keystr(path))
        leaves.append(leaf)
    flags = jax.device_get(_leaf_flags(leaves))
    return [p for p, ok in zip(paths, flags, strict=True) if not bool(ok)]


def _check_flag(flag: Any, name: str) -> jax.Array:
    if not (hasattr(flag, "dtype") or isinstance(flag, bool | int | float)):
        raise TypeError(_MSG_FINITE.replace("finite", name, 1).format(got=type(flag).__name__))
    flag = jnp.asarray(flag)
    if flag.dtype != jnp.bool_ or flag.shape != ():
        raise TypeError(_MSG_FINITE.replace("finite", name, 1).format(got=f"{flag.dtype}{list(flag.shape)}"))
    return flag


def _scale_leaf(path: Any, x: Any, s: jax.Array) -> Any:
    check_leaf(x, "GradScaler.scale", path)
    if not (hasattr(x, "dtype") or isinstance(x, int | float)):
        raise TypeError(f"GradScaler.scale: tree leaves must be float or integer arrays, got {type(x).__name__}")
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.floating):
        if x.dtype == jnp.float64:
            return x * s.astype(jnp.float64)
        return x.astype(jnp.float32) * s
    if jnp.issubdtype(x.dtype, jnp.integer):
        return x.astype(jnp.float32) * s
    raise TypeError(f"GradScaler.scale: tree leaves must be float or integer arrays, got {x.dtype}")


# --- the scaler -----------------------------------------------------------------------------------------------------
@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["loss_scale", "growth_tracker", "consecutive_overflows"],
    meta_fields=[
        "init_scale",
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "enabled",
        "min_scale",
        "max_scale",
        "dynamic",
        "max_consecutive_overflows",
    ],
)
@dataclasses.dataclass(frozen=True, eq=False)
class GradScaler:
    """Loss scale for mixed-precision training, as an immutable pytree (torch.amp.GradScaler's rule).

    The array leaves are ``loss_scale`` (float32 scalar; the method [`scale`][fmp.GradScaler.scale] multiplies by it) and ``growth_tracker`` (int32 scalar, consecutive
    finite steps); everything else is a static field, so stepping a scaler under ``jax.jit`` never
    retraces. Methods return new scalers; nothing syncs to the host except [`state_dict`][fmp.GradScaler.state_dict].

    The schedule is torch's, bit for bit: a non-finite step multiplies the scale by
    ``backoff_factor`` and resets the tracker; the ``growth_interval``-th consecutive finite step
    multiplies it by ``growth_factor`` (unless that overflows) and resets the tracker. Products are
    rounded through float64 like torch's kernels. One known difference: XLA on CPU flushes float32
    denormals to zero and torch does not, so scales below ~1.2e-38 differ, and above ~8.5e37 the
    reciprocal used by [`unscale`][fmp.GradScaler.unscale] is a denormal that XLA CPU flushes to zero.

    Three modes: dynamic (default); static (``dynamic=False`` or [`GradScaler.static`][fmp.GradScaler.static]: a fixed
    scale that still reports non-finite steps so they can be skipped); disabled (``enabled=False``: a
    transparent pass-through, ``scale``/``unscale`` return their input and ``update`` returns the same
    scaler).

    Args:
      init_scale: Initial scale, a finite number > 0.
      growth_factor: Multiplier after ``growth_interval`` consecutive finite steps, > 1.
      backoff_factor: Multiplier after a non-finite step, in (0, 1).
      growth_interval: Consecutive finite steps before growing, an int >= 1.
      enabled: False gives a pass-through scaler.
      min_scale: Optional lower clamp on the scale (off by default, like torch).
      max_scale: Optional upper clamp on the scale (off by default, like torch).
      dynamic: False keeps the scale fixed (a static scaler).
      max_consecutive_overflows: How many non-finite steps in a row raise
        [`overflow_alarm`][fmp.GradScaler.overflow_alarm]
        (an int >= 1, default 32). Only a report: the schedule is unchanged.
      loss_scale: The float32 scale array; leave it unset to start from ``init_scale`` (it is set
        when JAX rebuilds the pytree).
      growth_tracker: The int32 count of consecutive finite steps; leave it unset to start from 0.
      consecutive_overflows: The int32 count of non-finite steps in a row (saturating); leave it
        unset to start from 0. Not part of [`state_dict`][fmp.GradScaler.state_dict] (torch's five keys): a scaler
        loaded from one starts the count at 0.

    Raises:
      ValueError: a hyper-parameter is out of range (the message names it).
      TypeError: a hyper-parameter has the wrong type.

    Examples:
      >>> scaler = fmp.GradScaler(init_scale=8.0, growth_interval=2)
      >>> scaler.scale(jnp.float16(3.0))
      Array(24., dtype=float32)
      >>> scaler = jax.jit(fmp.GradScaler.update)(scaler, jnp.array(False))
      >>> scaler.loss_scale, scaler.growth_tracker
      (Array(4., dtype=float32), Array(0, dtype=int32))
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True
    min_scale: float | None = None
    max_scale: float | None = None
    dynamic: bool = True
    max_consecutive_overflows: int = _scaler_rule.DEFAULT_MAX_CONSECUTIVE_OVERFLOWS
    loss_scale: jax.Array = dataclasses.field(default=_UNSET, kw_only=True)
    growth_tracker: jax.Array = dataclasses.field(default=_UNSET, kw_only=True)
    consecutive_overflows: jax.Array = dataclasses.field(default=_UNSET, kw_only=True)

    def __post_init__(self):
        # JAX rebuilds the pytree with the leaves set (possibly to tracers or placeholders): touch
        # nothing then. Only a user-built scaler (no leaves given) is validated and initialised.
        leaves = (self.loss_scale, self.growth_tracker, self.consecutive_overflows)
        if all(x is not _UNSET for x in leaves):
            return
        if not isinstance(self.enabled, bool):
            raise TypeError(f"enabled must be a bool, got {self.enabled!r}")
        if not isinstance(self.dynamic, bool):
            raise TypeError(f"dynamic must be a bool, got {self.dynamic!r}")
        _scaler_rule.check_hparams(
            init_scale=self.init_scale,
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval,
            min_scale=self.min_scale,
            max_scale=self.max_scale,
        )
        _scaler_rule.check_limit(self.max_consecutive_overflows, "max_consecutive_overflows")
        if self.loss_scale is _UNSET:
            object.__setattr__(self, "loss_scale", jnp.asarray(self.init_scale, jnp.float32))
        if self.growth_tracker is _UNSET:
            object.__setattr__(self, "growth_tracker", jnp.asarray(0, jnp.int32))
        if self.consecutive_overflows is _UNSET:
            object.__setattr__(self, "consecutive_overflows", jnp.asarray(0, jnp.int32))

    @classmethod
    def static(cls, scale: float) -> GradScaler:
        """A fixed loss scale that still detects non-finite steps (so they can be skipped).

        Examples:
          >>> s = fmp.GradScaler.static(128.0)
          >>> s.update(jnp.array(False)).loss_scale
          Array(128., dtype=float32)
        """
        return cls(init_scale=scale, dynamic=False)

    # -- hot path ----------------------------------------------------------------------------------------------------
    def scale(self, tree: Any) -> Any:
        """Multiplies every leaf of ``tree`` (a loss, or model outputs) by the scale, in float32.

        float16/bfloat16/integer leaves come back as **float32** (so a float16 loss cannot overflow just
        because it was scaled; torch keeps the input dtype here), float32 stays float32 and float64
        stays float64. A disabled scaler returns ``tree`` itself.

        Raises:
          TypeError: a leaf is neither a float nor an integer array, or is another framework's array
            (a torch tensor: use ``fmp.torch.GradScaler`` there).

        Examples:
          >>> fmp.GradScaler(init_scale=2.0**16).scale(jnp.float16(2.0))
          Array(131072., dtype=float32)
        """
        if not self.enabled:
            return tree
        return jax.tree_util.tree_map_with_path(lambda p, x: _scale_leaf(p, x, self.loss_scale), tree)

    def unscale(self, grads: Any) -> Any:
        """Multiplies every float leaf by the float32 reciprocal of the scale, computed as torch does.

        The reciprocal is ``float32(1 / float64(scale))``. float32 leaves are multiplied in float32;
        float16/bfloat16 leaves are multiplied in float32 and rounded back to their dtype (torch's
        opmath); float64 and complex leaves are multiplied in their own dtype. Python floats become
        arrays. Integer and bool leaves pass through, and so does an ``fmp.Float8State`` (the gradient of a
        delayed-scaling state is its next amax history, in the units the next step's float8 matmuls see:
        the gradient-side amax is that of the scaled gradient they quantise). A disabled scaler returns
        ``grads`` unchanged.

        Raises:
          TypeError: a leaf is another framework's array (a torch tensor: use ``fmp.torch.GradScaler``).

        Examples:
          >>> fmp.GradScaler(init_scale=4.0).unscale({"w": jnp.array([2.0, 8.0])})
          {'w': Array([0.5, 2. ], dtype=float32)}
        """
        if not self.enabled:
            return grads
        inv = _reciprocal_f64(self.loss_scale)

        def leaf(path, g):
            check_leaf(g, "GradScaler.unscale", path)
            if isinstance(g, float | complex):
                g = jnp.asarray(g)  # a Python float is a gradient too; canonical dtype (float32 without x64)
            if not hasattr(g, "dtype") or not jnp.issubdtype(g.dtype, jnp.inexact):
                return g
            g = jnp.asarray(g)  # numpy float64 becomes float32 without x64, as everywhere in JAX
            if jnp.issubdtype(g.dtype, jnp.complexfloating):
                # part by part: a complex product would turn inf * (0.25 + 0j) into inf + NaN j
                part = inv.astype(g.real.dtype)
                return jax.lax.complex(g.real * part, g.imag * part)
            if g.dtype == jnp.float64:
                return g * inv.astype(g.dtype)
            return (g.astype(jnp.float32) * inv).astype(g.dtype)

        # a Float8State's "gradient" is its next amax history, not a gradient: it is not divided by the scale
        return jax.tree_util.tree_map_with_path(
            lambda p, g: g if isinstance(g, Float8State) else leaf(p, g),
            grads,
            is_leaf=lambda g: isinstance(g, Float8State),
        )

    def update(
        self, finite: jax.typing.ArrayLike | None = None, new_scale: jax.typing.ArrayLike | None = None
    ) -> GradScaler:
        """Returns the scaler for the next step.

        Whatever ``finite`` says, the scale stays a finite float32 > 0 if it was one: a backoff is a
        multiplication by a factor in (0, 1) and a growth that would overflow is not taken. What it
        can do after a very long run of non-finite steps is shrink towards 0 (float32 underflow);
        ``consecutive_overflows`` counts that run and [`overflow_alarm`][fmp.GradScaler.overflow_alarm] reports it, and
        ``min_scale`` bounds it.

        Args:
          finite: Bool scalar, False if this step's gradients held an inf/NaN.
          new_scale: If given, the new scale is set to it (as float32) and the tracker and the
            overflow count are left as they are, like ``torch.amp.GradScaler.update(new_scale)``;
            ``finite`` is then ignored. A Python number must be finite and > 0 (torch accepts
            anything). An array is only checked for shape and dtype: its value may be a tracer, so
            a non-finite or non-positive array is stored as given and
            [`fmp.check_scaler_health`][fmp.check_scaler_health]
            reports it; ``value_and_grad`` and ``loss_scaled`` then skip every step.

        Returns:
          A new scaler. A disabled scaler returns itself; a static one keeps its scale (and still
          counts ``consecutive_overflows``).

        Raises:
          TypeError: ``finite`` is not a bool scalar, or ``new_scale`` is not a float scalar.
          ValueError: ``new_scale`` is a Python number that is not finite and > 0.

        Examples:
          >>> s = fmp.GradScaler(init_scale=8.0, max_consecutive_overflows=2)
          >>> s = s.update(jnp.array(False)).update(jnp.array(False))
          >>> s.loss_scale, s.consecutive_overflows, s.overflow_alarm
          (Array(2., dtype=float32), Array(2, dtype=int32), Array(True, dtype=bool))
          >>> s.update(new_scale=0.0)
          Traceback (most recent call last):
          ...
          ValueError: new_scale must be a finite number > 0, got 0.0
        """
        if not self.enabled:
            return self
        if new_scale is not None:
            _scaler_rule.check_new_scale(new_scale)
            ns = jnp.asarray(float(new_scale) if isinstance(new_scale, int) else new_scale)
            if ns.shape != () or not jnp.issubdtype(ns.dtype, jnp.floating):
                raise TypeError(f"new_scale must be a float scalar, got {ns.dtype}{list(ns.shape)}")
            return dataclasses.replace(self, loss_scale=ns.astype(jnp.float32))
        if finite is None:
            raise TypeError("update() needs finite (a bool scalar, e.g. fmp.all_finite(grads)) or new_scale")
        finite = _check_flag(finite, "finite")
        run = self.consecutive_overflows
        run = jnp.where(finite, jnp.zeros_like(run), jnp.minimum(run, _scaler_rule.INT32_MAX - 1) + 1)
        if not self.dynamic:
            return dataclasses.replace(self, consecutive_overflows=run.astype(jnp.int32))
        scale, tracker = _scaler_rule.update_scale(
            self.loss_scale,
            self.growth_tracker,
            jnp.logical_not(finite),
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval,
            ops=_JaxOps,
            min_scale=self.min_scale,
            max_scale=self.max_scale,
        )
        return dataclasses.replace(
            self,
            loss_scale=scale.astype(jnp.float32),
            growth_tracker=tracker.astype(jnp.int32),
            consecutive_overflows=run.astype(jnp.int32),
        )

    @property
    def overflow_alarm(self) -> jax.Array:
        """Bool scalar: ``consecutive_overflows >= max_consecutive_overflows`` (readable inside ``jit``).

        True means a run of non-finite steps too long to be ordinary float16 overflow; every one of
        them was skipped and the scale shrank each time. Outside ``jit``,
        [`fmp.check_scaler_health`][fmp.check_scaler_health] turns it into a warning.

        Examples:
          >>> fmp.GradScaler().overflow_alarm
          Array(False, dtype=bool)
        """
        return self.consecutive_overflows >= self.max_consecutive_overflows

    def _usable(self) -> jax.Array:
        """Bool scalar: the scale has a finite float32 reciprocal (it is finite, > 0, not a denormal).

        ``value_and_grad`` and ``loss_scaled`` and it into the finite flag: with a scale of 0 the scaled
        gradients are finite zeros but unscaling them gives 0 * inf = NaN.
        """
        return jnp.isfinite(_reciprocal_f64(self.loss_scale))

    # -- checkpoints -------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's five-key checkpoint: ``scale``, ``growth_factor``, ``backoff_factor`` (float),
        ``growth_interval``, ``_growth_tracker`` (int). Empty for a disabled scaler, like torch.

        Reads the arrays to the host: call it outside ``jit``.

        Examples:
          >>> fmp.GradScaler(init_scale=1024.0).state_dict()["scale"]
          1024.0
        """
        if not self.enabled:
            return {}
        return _scaler_rule.make_state_dict(
            scale=float(jax.device_get(self.loss_scale)),
            growth_tracker=int(jax.device_get(self.growth_tracker)),
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval,
        )

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, Any], **overrides: Any) -> GradScaler:
        """Builds a scaler from a five-key dict written by fmp or by ``torch.amp.GradScaler.state_dict()``.

        Args:
          state_dict: The checkpoint.
          **overrides: Constructor arguments to set or replace (``min_scale``, ``dynamic``, ...).

        Raises:
          ValueError: the dict is empty (saved from a disabled scaler) or lacks a key.

        Examples:
          >>> d = {"scale": 512.0, "growth_factor": 2.0, "backoff_factor": 0.5,
          ...      "growth_interval": 100, "_growth_tracker": 7}
          >>> s = fmp.GradScaler.from_state_dict(d)
          >>> s.loss_scale, s.growth_tracker, s.growth_interval
          (Array(512., dtype=float32), Array(7, dtype=int32), 100)
        """
        values = _scaler_rule.parse_state_dict(state_dict)
        kwargs: dict[str, Any] = {
            "init_scale": values["scale"],
            "growth_factor": values["growth_factor"],
            "backoff_factor": values["backoff_factor"],
            "growth_interval": values["growth_interval"],
        }
        kwargs.update(overrides)
        scaler = cls(**kwargs)
        tracker = np.int32(min(max(values["_growth_tracker"], 0), _scaler_rule.INT32_MAX))
        return dataclasses.replace(scaler, growth_tracker=jnp.asarray(tracker, jnp.int32))

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> GradScaler:
        """Returns a new scaler holding ``state_dict``'s state (torch's name; nothing is mutated).

        The hyper-parameters come from the dict, like torch; ``enabled``, ``min_scale``,
        ``max_scale``, ``dynamic`` and ``max_consecutive_overflows`` are kept from ``self``. A disabled scaler returns itself.
        """
        if not self.enabled:
            return self
        return type(self).from_state_dict(
            state_dict,
            min_scale=self.min_scale,
            max_scale=self.max_scale,
            dynamic=self.dynamic,
            max_consecutive_overflows=self.max_consecutive_overflows,
        )

    @staticmethod
    def register_flax_serialization() -> None:
        """Registers GradScaler with ``flax.serialization`` now (imports flax).

        Not needed: ``import fmp`` arranges for the registration to happen whenever flax is imported,
        before or after fmp, so ``flax.serialization.to_state_dict(scaler)`` and ``to_bytes`` work as they
        are. Kept for code that calls it; calling it again is harmless.
        """
        from flax import serialization

        from fmp import _flax_serialization

        _flax_serialization.register(serialization)
