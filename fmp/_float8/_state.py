"""Delayed scaling: ``Float8State``, an immutable pytree of amax histories, one row per matmul site.

The forward scales of a site come from the largest amax in its history (the
current amax while the history is still empty), the output gradient's scale
likewise. The new amaxes reach the state through the gradient: the site's
``custom_vjp`` returns, as the "cotangent" of its history, the history rolled
by one step with this step's three amaxes (forward operands and output
gradient) in front. ``jax.grad`` of the loss with respect to the state is
therefore the next state's history (flax's ``OVERWRITE_WITH_GRADIENT`` idea):
``Float8State.update`` takes it, inside ``jit``, with no host sync.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from fmp import _flax_serialization
from fmp._float8 import _dot, _quant
from fmp._float8._recipe import Float8Recipe

_F32 = jnp.dtype(jnp.float32)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["amax_history"], meta_fields=["sites", "recipe"])
@dataclasses.dataclass(frozen=True)
class Float8State:
    """Amax histories of the float8 matmul sites of one function (delayed scaling).

    ``amax_history[i, j, t]`` is site ``i``'s amax ``t`` steps ago for its lhs
    (``j = 0``), rhs (``j = 1``) and output gradient (``j = 2``). Sites are the
    ``dot_general`` equations of the function in program order, those in
    ``jit``, ``checkpoint`` and ``cond`` bodies included; a ``scan`` body's
    sites have one row per iteration (``name[0]``, ``name[1]``, ...: per layer of
    a layer-scanned model), numbered as the unrolled loop would number them.
    ``sites`` names them (primitive and name scope). Build it with
    ``fmp.float8_state``, pass it to ``fmp.autocast(..., float8_state=state)``
    inside the loss (one call per state), differentiate the loss with respect
    to it, and call ``update`` (or ``fmp.optax.float8_step``) with that gradient.

    It is a pytree (``jit``, ``lax.cond``), pickles, and checkpoints with orbax
    or ``flax.serialization`` like any array tree.

    Examples:
      >>> st = fmp.Float8State.zeros(["dot_general@dense"], fmp.Float8Recipe("delayed", history_len=4))
      >>> st.amax_history.shape
      (1, 3, 4)
    """

    amax_history: jax.Array
    sites: tuple[str, ...] = ()
    recipe: Float8Recipe = Float8Recipe("delayed")

    @classmethod
    def zeros(cls, sites: Any, recipe: Float8Recipe) -> Float8State:
        """An empty history (every step then starts from current scaling) for ``sites``."""
        sites = tuple(str(s) for s in sites)
        if recipe.scaling != "delayed":
            raise ValueError(f"Float8State needs a 'delayed' recipe, got {recipe.scaling!r}")
        return cls(jnp.zeros((len(sites), 3, recipe.history_len), _F32), sites, recipe)

    def update(self, history_grad: Float8State) -> Float8State:
        """The next state from the gradient of the loss with respect to this one.

        Sites the step did not run (their gradient is all zero) keep their history, and so do sites whose new
        history holds an inf or NaN (an overflowing step, e.g. one a loss scaler skips): a non-finite amax would
        otherwise stay in the history for its whole length.
        """
        new = history_grad.amax_history.astype(_F32)
        ran = jnp.any(new != 0, axis=(1, 2), keepdims=True) & jnp.all(jnp.isfinite(new), axis=(1, 2), keepdims=True)
        return dataclasses.replace(self, amax_history=jnp.where(ran, new, self.amax_history))

    def scales(self) -> jax.Array:
        """The current scales ``[sites, 3]`` (lhs, rhs, gradient); 1 where the history is empty."""
        amax = history_amax(self.amax_history, self.recipe)
        kinds = (_quant.E4M3, _quant.E4M3, jnp.dtype(self.recipe.grad_dtype))
        return jnp.stack(
            [
                _quant.scale_from_amax(amax[:, j], d, pow2=self.recipe.pow2_scales, margin=self.recipe.margin)
                for j, d in enumerate(kinds)
            ],
            axis=1,
        )

    @classmethod
    def register_flax_serialization(cls) -> None:
        """Registers ``Float8State`` with ``flax.serialization`` now (imports flax).

        Not needed: ``import fmp`` arranges for the registration to happen whenever flax is imported,
        before or after fmp. Kept for code that calls it; calling it again is harmless.
        """
        _flax_serialization.register_now(cls)


def _flax_state(s: Float8State) -> dict[str, Any]:
    return {"amax_history": s.amax_history}


def _from_flax_state(target: Float8State, state: dict[str, Any]) -> Float8State:
    return dataclasses.replace(target, amax_history=jnp.asarray(state["amax_history"], _F32))


_flax_serialization.register_type(
    Float8State,
    _flax_state,
    _from_flax_state,
    "Save the state with orbax or pickle instead, or report this flax version.",
)


class SiteFeeder:
    """Hands the interpreter one history row per float8 site, in program order.

    The top-level feeder reads ``state`` (``None``: it only collects the labels, for
    ``fmp.float8_state``). A body (``scan``, ``cond``, ``jit``, ``checkpoint``) takes a block
    of consecutive rows for all its sites at once (``take_block``: a scan body's block has one
    row per site and iteration, iteration-major, as the unrolled program would number them) and
    hands them into the body as an input; the body's own feeder (``child``) reads from it.
    """

    def __init__(
        self, state: Float8State | None, rows: jax.Array | None = None, expected: tuple[str, ...] | None = None
    ) -> None:
        self.state = state
        self.rows = state.amax_history if state is not None else rows
        self.expected = state.sites if state is not None else expected
        self.labels: list[str] = []

    def child(self, rows: jax.Array | None, expected: list[str]) -> SiteFeeder:
        """The feeder of a body whose sites (``expected``) read ``rows`` (a body input)."""
        return SiteFeeder(None, rows, tuple(expected))

    def take_block(self, labels: list[str]) -> jax.Array | None:
        """The rows ``[len(labels), 3, history_len]`` of the next sites, named ``labels`` (None: no state)."""
        i = len(self.labels)
        for label in labels:
            self._check(len(self.labels), label)
            self.labels.append(label)
        return None if self.rows is None else self.rows[i : i + len(labels)]

    def take(self, label: str) -> jax.Array | None:
        """The history row ``[3, history_len]`` of the next site (None: no state)."""
        block = self.take_block([label])
        return None if block is None else block[0]

    def _check(self, i: int, label: str) -> None:
        if self.expected is None:
            return
        n = len(self.expected)
        if i >= n:
            raise ValueError(
                f"float8_state has {n} float8 sites but the function runs more float8 matmuls (site {i}: {label}). "
                "Build the state from the same function and arguments with fmp.float8_state."
            )
        if self.expected[i] != label:
            raise ValueError(
                f"float8_state belongs to another function: its site {i} is {self.expected[i]!r}, this function's "
                f"is {label!r}. Build the state from the same function and arguments with fmp.float8_state."
            )

    def finish(self) -> None:
        """Raises if the function ran fewer float8 sites than the state has."""
        if self.expected is not None and len(self.labels) < len(self.expected):
            raise ValueError(
                f"float8_state has {len(self.expected)} float8 sites but the function runs {len(self.labels)} "
                f"(the first without a match: {self.expected[len(self.labels)]!r}). Build the state from the same "
                "function and arguments with fmp.float8_state."
            )


def history_amax(history: jax.Array, recipe: Float8Recipe) -> jax.Array:
    """The amax a delayed scale comes from (last axis: steps, newest first): their max or the newest one."""
    if recipe.amax_compute_algo == "most_recent":
        return history[..., 0]
    return jax.lax.reduce_max(history, (history.ndim - 1,))


def _current_or_history(x: jax.Array, hist_row: jax.Array, dtype: Any, recipe: Float8Recipe, mapped: tuple):
    now = _global_max(_quant.abs_max(x), mapped)
    past = history_amax(hist_row, recipe)
    amax = jax.lax.select(jax.lax.gt(past, _quant.F32(0.0)), past, now)
    scale = _quant.scale_from_amax(amax, dtype, pow2=recipe.pow2_scales, margin=recipe.margin)
    return _quant.keep_non_finite(scale, now), now  # an inf operand is not saturated by a past scale


def mapped_axes() -> tuple:
    """``(axes, checked)``: the manual mesh axes being traced over (inside ``shard_map``) and whether JAX tracks
    which values vary over them (``check_vma``); ``()`` outside ``shard_map``."""
    axes = tuple(jax.sharding.get_abstract_mesh().manual_axes)
    if not axes:
        return ()
    return axes, bool(_varying(jax.lax.axis_index(axes)))


def _varying(v: jax.Array) -> frozenset:
    """The manual axes ``v`` varies over (empty where JAX does not track them: ``check_vma=False``)."""
    aval = jax.typeof(v)
    mat = getattr(aval, "mat", None)  # JAX 0.10; older versions call it ``vma``
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def _global_max(v: jax.Array, mapped: tuple) -> jax.Array:
    """``v`` reduced by max over the mapped axes: every shard takes the same scale from the global amax."""
    if not mapped:
        return v
    axes, checked = mapped
    if checked:  # only the axes v varies over (the result is then invariant, like the history it goes into)
        axes = tuple(a for a in axes if a in _varying(v))
    return jax.lax.pmax(v, axes) if axes else v


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _delayed_matmul(a, b, hist, recipe, out_dtype, mapped):
    sa, _ = _current_or_history(a, hist[0], _quant.E4M3, recipe, mapped)
    sb, _ = _current_or_history(b, hist[1], _quant.E4M3, recipe, mapped)
    e4m3, gemm = _quant.E4M3, _dot.use_gemm(recipe)
    return _quant.scaled_matmul(a, sa, e4m3, b, sb, e4m3, gemm).astype(out_dtype)


def _delayed_fwd(a, b, hist, recipe, out_dtype, mapped):
    sa, amax_a = _current_or_history(a, hist[0], _quant.E4M3, recipe, mapped)
    sb, amax_b = _current_or_history(b, hist[1], _quant.E4M3, recipe, mapped)
    e4m3, gemm = _quant.E4M3, _dot.use_gemm(recipe)
    out = _quant.scaled_matmul(a, sa, e4m3, b, sb, e4m3, gemm).astype(out_dtype)
    return out, (a, b, hist, sa, sb, amax_a, amax_b)


def _delayed_bwd(recipe, out_dtype, mapped, res, g):
    a, b, hist, sa, sb, amax_a, amax_b = res
    gdt, e4m3, gemm = jnp.dtype(recipe.grad_dtype), _quant.E4M3, _dot.use_gemm(recipe)
    sg, amax_g = _current_or_history(g, hist[2], gdt, recipe, mapped)
    da = _quant.scaled_matmul(g, sg, gdt, jnp.swapaxes(b, 1, 2), sb, e4m3, gemm)
    db = _quant.scaled_matmul(jnp.swapaxes(a, 1, 2), sa, e4m3, g, sg, gdt, gemm)
    new = jnp.roll(hist, 1, axis=-1).at[:, 0].set(jnp.stack([amax_a, amax_b, amax_g]))
    if mapped and not mapped[1]:
        # unchecked shard_map sums a replicated input's cotangent over the shards: one shard returns it
        first = functools.reduce(jnp.logical_and, [jax.lax.axis_index(ax) == 0 for ax in mapped[0]])
        new = jnp.where(first, new, jnp.zeros_like(new))
    return da.astype(a.dtype), db.astype(b.dtype), new


_delayed_matmul.defvjp(_delayed_fwd, _delayed_bwd)


def delayed_dot_general(
    lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, history: jax.Array, recipe: Float8Recipe, out_dtype: Any
) -> jax.Array:
    """``dot_general`` in float8 with per-tensor scales from ``history`` (``[3, history_len]``).

    Inside ``shard_map`` every amax is the global one (a max-reduction over the mapped axes), so every
    shard takes the same scales and records the same history, with ``check_vma`` on or off.
    """
    lperm, rperm, ashape, bshape, oshape = _dot.canonical(lhs.shape, rhs.shape, dimension_numbers)
    a = jnp.transpose(lhs, lperm).reshape(ashape)
    b = jnp.transpose(rhs, rperm).reshape(bshape)
    return _delayed_matmul(a, b, history, recipe, jnp.dtype(out_dtype), mapped_axes()).reshape(oshape)
