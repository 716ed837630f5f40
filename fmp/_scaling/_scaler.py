"""GradScaler: the dynamic loss scale as an immutable pytree, and its math (scale, unscale, update).

Every operation here is pure and jit-safe. The update rule itself lives in ``fmp._core._scaler_rule`` and is
shared with the torch facade; the checkpoint methods (``state_dict``, ``from_state_dict``, flax) come from
``fmp._scaling._checkpoint``, the finite check of a gradient tree from ``fmp._scaling._finite``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import jax
import jax.numpy as jnp

from fmp._arrays import check_value
from fmp._core import _scaler_rule
from fmp._core._dtypes import INIT_SCALE
from fmp._float8._state import Float8State
from fmp._scaling._checkpoint import ScalerCheckpoint, register_flax
from fmp._scaling._finite import check_flag
from fmp._scaling._ops import JaxOps, reciprocal_f64, scale_leaf, unscale_leaf

_UNSET: Any = object()  # sentinel: "build the arrays from init_scale"

_MSG_DEVICE_ARG = (
    "init_scale must be a Python number, got the device string {got!r}: fmp.GradScaler is the JAX scaler and "
    "takes no device (JAX places its arrays). For torch tensors use fmp.torch.GradScaler({got!r}) "
    "(torch.amp.GradScaler's API); for JAX write fmp.GradScaler() or fmp.GradScaler(init_scale=2.0**16)."
)


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
class GradScaler(ScalerCheckpoint):
    """Loss scale for mixed-precision training, as an immutable pytree (torch.amp.GradScaler's rule).

    The array leaves are ``loss_scale`` (float32 scalar; the method `GradScaler.scale` multiplies by it) and ``growth_tracker`` (int32 scalar, consecutive
    finite steps); everything else is a static field, so stepping a scaler under ``jax.jit`` never
    retraces. Methods return new scalers; nothing syncs to the host except `GradScaler.state_dict`.

    The schedule is torch's, bit for bit: a non-finite step multiplies the scale by
    ``backoff_factor`` and resets the tracker; the ``growth_interval``-th consecutive finite step
    multiplies it by ``growth_factor`` (unless that overflows) and resets the tracker. Products are
    rounded through float64 like torch's kernels. One known difference: XLA on CPU flushes float32
    denormals to zero and torch does not, so scales below ~1.2e-38 differ, and above ~8.5e37 the
    reciprocal used by `GradScaler.unscale` is a denormal that XLA CPU flushes to zero.

    Three modes: dynamic (default); static (``dynamic=False`` or `GradScaler.static`: a fixed
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
        `GradScaler.overflow_alarm`
        (an int >= 1, default 32). Only a report: the schedule is unchanged.
      loss_scale: The float32 scale array; leave it unset to start from ``init_scale`` (it is set
        when JAX rebuilds the pytree).
      growth_tracker: The int32 count of consecutive finite steps; leave it unset to start from 0.
      consecutive_overflows: The int32 count of non-finite steps in a row (saturating); leave it
        unset to start from 0. Not part of `GradScaler.state_dict` (torch's five keys): a scaler
        loaded from one starts the count at 0.

    Raises:
      ValueError: a hyper-parameter is out of range (the message names it).
      TypeError: a hyper-parameter has the wrong type; a string as ``init_scale`` (torch's device
        argument, ``GradScaler("cuda")``) points to ``fmp.torch.GradScaler``.

    Examples:
      >>> scaler = fmp.GradScaler(init_scale=8.0, growth_interval=2)
      >>> scaler.scale(jnp.float16(3.0))
      Array(24., dtype=float32)
      >>> scaler = jax.jit(fmp.GradScaler.update)(scaler, jnp.array(False))
      >>> scaler.loss_scale, scaler.growth_tracker
      (Array(4., dtype=float32), Array(0, dtype=int32))
    """

    init_scale: float = INIT_SCALE  # 2**16, as torch.amp.GradScaler
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
        if isinstance(self.init_scale, str) and re.fullmatch(r"[a-z]+(:\d+)?", self.init_scale):
            # torch's first argument is a device: GradScaler("cuda")
            raise TypeError(_MSG_DEVICE_ARG.format(got=self.init_scale))
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
        return jax.tree_util.tree_map_with_path(lambda p, x: scale_leaf(p, x, self.loss_scale), tree)

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
        inv = reciprocal_f64(self.loss_scale)
        # a Float8State's "gradient" is its next amax history, not a gradient: it is not divided by the scale
        return jax.tree_util.tree_map_with_path(
            lambda p, g: g if isinstance(g, Float8State) else unscale_leaf(p, g, inv),
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
        ``consecutive_overflows`` counts that run and `GradScaler.overflow_alarm` reports it, and
        ``min_scale`` bounds it.

        Args:
          finite: Bool scalar, False if this step's gradients held an inf/NaN.
          new_scale: If given, the new scale is set to it (as float32) and the tracker and the
            overflow count are left as they are, like ``torch.amp.GradScaler.update(new_scale)``;
            ``finite`` is then ignored. A Python number must be finite and > 0 (torch accepts
            anything). An array is only checked for shape and dtype: its value may be a tracer, so
            a non-finite or non-positive array is stored as given and
            `fmp.check_scaler_health`
            reports it; ``value_and_grad`` and ``loss_scaled`` then skip every step.

        Returns:
          A new scaler. A disabled scaler returns itself; a static one keeps its scale (and still
          counts ``consecutive_overflows``).

        Raises:
          TypeError: ``finite`` is not a bool scalar, or ``new_scale`` is not a float scalar, or either
            is another framework's array (a torch tensor: use ``fmp.torch.GradScaler``).
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
            check_value(new_scale, "GradScaler.update", "new_scale")
            _scaler_rule.check_new_scale(new_scale)
            ns = jnp.asarray(float(new_scale) if isinstance(new_scale, int) else new_scale)
            if ns.shape != () or not jnp.issubdtype(ns.dtype, jnp.floating):
                raise TypeError(f"new_scale must be a float scalar, got {ns.dtype}{list(ns.shape)}")
            return dataclasses.replace(self, loss_scale=ns.astype(jnp.float32))
        if finite is None:
            raise TypeError("update() needs finite (a bool scalar, e.g. fmp.all_finite(grads)) or new_scale")
        finite = check_flag(finite, "finite", "GradScaler.update")
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
            ops=JaxOps,
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
        `fmp.check_scaler_health` turns it into a warning.

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
        return jnp.isfinite(reciprocal_f64(self.loss_scale))


register_flax(GradScaler)
