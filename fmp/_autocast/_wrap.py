"""``fmp.autocast``: run a function under a mixed-precision policy."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax

from fmp._autocast._args import graph_nodes, trace, trace_with_graph_state
from fmp._autocast._checks import check_args, warn_no_effect
from fmp._autocast._engine._context import REGION_SCOPE
from fmp._autocast._float8_checks import check_key, check_state, claim
from fmp._autocast._hops._custom_bwd import BWD_AS_WRITTEN
from fmp._autocast._transform import configure, make_context, rewrite_top, run_top
from fmp._core._renamed import NOT_GIVEN, renamed_argument
from fmp._core._rules import RuleSet
from fmp._float8._state import Float8State, SiteFeeder
from fmp._policy import Policy
from fmp._resolved import ResolvedPolicy

_MSG_POLICY_FIRST = (
    "fmp.autocast(fn, policy) is a function transform and takes the function first, got the policy {got!r}: "
    "write fmp.autocast(fn, {got!r}), or @fmp.autocast(policy={got!r}) on a def. It is not a context manager "
    "(`with fmp.autocast(...)`); for torch code the context manager is fmp.torch.autocast: "
    "with fmp.torch.autocast('cpu', policy={got!r}): (or 'cuda')."
)


def autocast(
    fn: Callable[..., Any] | None = None,
    policy: str | Policy = "mixed_bfloat16",
    *,
    rules: RuleSet | None = None,
    enabled: bool = True,
    overrides: Mapping[str, Any] | None = None,
    float8_state: Float8State | None = None,
    key: jax.Array | None = None,
    fp8_state: Any = NOT_GIVEN,
) -> Any:
    """Runs ``fn`` under a mixed-precision policy, op by op, like ``torch.autocast``.

    ``fn`` is traced to a jaxpr and its rewrite (the program
    `fmp.autocast_jaxpr` returns) is evaluated in the caller's trace, so the result composes with ``jax.jit``,
    ``jax.grad``, ``jax.vmap`` and ``lax.scan``. Matmuls and convolutions run in
    the policy's compute dtype, exponentials, logarithms, powers and sums in
    float32, multi-input elementwise ops in their widest input, except that a
    bias along the output features added to a linear layer's or convolution's
    result is added in the compute dtype, as torch's ``linear`` does (the rule
    table ``fmp.DEFAULT_RULES``, ``RuleSet.jax_epilogue``); an outer or
    batch-only product runs in its inputs' dtype (``RuleSet.jax_uncontracted``),
    and no constant is cast into a dtype that cannot hold it; float64, integer
    and boolean values are never cast.

    Dtypes: array arguments are not cast (parameters stay float32 and are cast
    where an op uses them, so the gradients of float32 parameters are float32).
    Outputs that ``fn`` returns in float32 come back in the policy's
    ``output_dtype`` (float32 for the presets); all other outputs keep the dtype
    ``fn`` gives them. Non-array arguments (Python numbers, strings) are static.

    Nesting: an inner ``autocast(g, ...)`` (another policy, or
    ``enabled=False``) keeps its own choice inside an outer one.

    Args:
      fn: The function; omit it to use ``autocast(policy=...)`` as a decorator.
      policy: A policy spec (``"mixed_bfloat16"``, ``"mixed_float16"``,
        ``"float32"``, ``"p=f32,c=bf16"``) or an `fmp.Policy`.
      rules: A `fmp.RuleSet`; ``None`` means ``fmp.DEFAULT_RULES``.
      enabled: ``False`` runs ``fn`` exactly as written, also inside an outer autocast.
      overrides: ``{scope_substring: policy}``: ops under a ``jax.named_scope``
        (flax linen opens one per module; a submodule of an nnx module passed as
        an argument runs under its attribute path, ``blocks/0/attn``) whose path contains the key run
        under that policy, e.g. ``{"LayerNorm": "float32"}``. Matching is
        case-sensitive on the scopes opened inside ``fn``, never inside a number (``"blocks/1"`` does not
        select ``blocks/10``); the innermost wins. A key that names a source location
        (``"model.py:12"``, ``"src/model.py:12:8"``: a path's tail, a line, a column) selects the ops of
        that line instead, before any scope key (what `fmp.explain` suggests for an op outside any scope).
        An override to ``"mixed_bfloat16"`` keeps a layer out of float8.
      float8_state: For a policy with ``float8="delayed"``: the ``fmp.Float8State``
        the scales come from (see `fmp.float8_state`). Differentiate with
        respect to it to get the next state's amax history. One state feeds one call.
      key: A ``jax.random`` key for stochastic rounding: under ``"mixed_nvfp4"`` (an ``nvfp4`` recipe) the
        gradients of every NVFP4 matmul are rounded stochastically from it (each matmul folds in its own
        number), so the same key replays the same bits; pass a new key each step. Without it they round
        to nearest.
      fp8_state: Deprecated name of ``float8_state`` (warns; removed in the next release).

    Returns:
      A function with ``fn``'s signature.

    Warns:
      UserWarning: a ``key`` under a policy with no NVFP4 recipe (nothing rounds stochastically); the
        policy changes nothing in ``fn`` (it computes no float16, bfloat16 or float32
        value: a float64 model, an integer-only function), or an ``overrides`` key matches no scope;
        a delayed float8 policy without ``float8_state`` (it runs current scaling), or float8 matmuls in a
        ``while_loop`` or custom-derivative body under delayed scaling (they run current scaling).

    Raises:
      TypeError: ``fn`` is not callable (a policy given first, as in
        ``with fmp.autocast("mixed_bfloat16"):``, says to write ``fmp.autocast(fn, policy)``, or
        ``fmp.torch.autocast`` for the context-manager form), or ``rules``/``overrides`` have the wrong
        type; an argument is another framework's array (a torch tensor), which autocast cannot see.
      ValueError: an unknown policy spec; a banned op under a float16 policy; a ``float8_state`` under a
        policy without delayed scaling, with another history length, built for another function (other
        float8 sites), or already used by another call in the same differentiated function.

    Examples:
      >>> f = fmp.autocast(lambda x, w: x @ w)
      >>> f(jnp.ones((2, 3)), jnp.ones((3, 2))).dtype
      dtype('float32')
      >>> @fmp.autocast(policy="p=f32,c=bf16,o=bf16")
      ... def g(x):
      ...     return x @ x
      >>> g(jnp.ones((2, 2))).dtype
      dtype(bfloat16)
    """
    float8_state = renamed_argument(float8_state, fp8_state, "autocast(fp8_state=...)", "autocast(float8_state=...)")
    if fn is None:
        return functools.partial(
            autocast, policy=policy, rules=rules, enabled=enabled, overrides=overrides, float8_state=float8_state,
            key=key,
        )  # fmt: skip
    if isinstance(fn, str | Policy):
        raise TypeError(_MSG_POLICY_FIRST.format(got=fn if isinstance(fn, str) else str(fn)))
    if not callable(fn):
        raise TypeError(
            f"autocast(fn) expects a callable, got {type(fn).__name__}; "
            "to set the policy of a decorator write @fmp.autocast(policy=...)"
        )
    if not isinstance(enabled, bool):
        raise TypeError(f"autocast(enabled=...) expects a bool, got {type(enabled).__name__}")
    config = configure(policy, rules, overrides)
    if enabled:
        check_state(float8_state, config.policy, config.overrides, config.label)
        check_key(key, config.policy, config.overrides)
    return autocast_resolved(fn, config, enabled, float8_state, key)


def autocast_resolved(
    fn: Callable[..., Any],
    config: ResolvedPolicy,
    enabled: bool = True,
    float8_state: Float8State | None = None,
    key: jax.Array | None = None,
) -> Callable[..., Any]:
    """``autocast(fn, ...)`` of a policy already resolved (``float8_state`` and ``key`` already checked against
    it)."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not enabled:
            with jax.named_scope(REGION_SCOPE):
                return fn(*args, **kwargs)
        check_args(args, kwargs)
        sites = None
        if float8_state is not None:
            claim(float8_state)
            sites = SiteFeeder(float8_state)
        ctx = make_context(config, fp8_sites=sites, key=key)
        graph = graph_nodes(args, kwargs)
        if graph is not None:
            closed, arrays, finish = trace_with_graph_state(fn, args, kwargs, graph)
        else:
            closed, arrays, out_tree = trace(fn, args, kwargs)
            finish = functools.partial(jax.tree_util.tree_unflatten, out_tree)
        warn_no_effect(closed, config.policy, config.overrides, config.label)
        with jax.named_scope(REGION_SCOPE):
            outs = run_top(closed, arrays, ctx)
        if sites is not None:
            sites.finish()
        return finish(outs)

    return wrapped


def float8_state(
    fn: Callable[..., Any],
    policy: str | Policy = "p=f32,c=bf16,o=f32,float8=delayed",
    *,
    rules: RuleSet | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Callable[..., Float8State]:
    """Builds the ``fmp.Float8State`` of ``fn`` under a delayed-scaling policy.

    Returns a function of ``fn``'s arguments; it traces and rewrites ``fn``
    (nothing is computed) and returns a state with one empty amax history per
    float8 ``dot_general`` site: one per matmul of the program, in ``jit``,
    ``checkpoint`` and ``cond`` bodies too (every branch's), and one per matmul
    and iteration of a ``scan`` body (per layer of a layer-scanned model). A
    ``while_loop`` or custom-derivative body's matmuls have none (they run
    current scaling, with a warning).

    Examples:
      >>> f = lambda x, w: jnp.tanh(x @ w) @ w.T
      >>> st = fmp.float8_state(f)(jnp.ones((2, 3)), jnp.ones((3, 3)))
      >>> st.amax_history.shape, st.recipe.scaling
      ((2, 3, 16), 'delayed')
    """
    config = configure(policy, rules, overrides)
    if config.policy.float8 is None or config.policy.float8.scaling != "delayed":
        raise ValueError(f"float8_state needs a policy with float8=delayed, got {str(config.policy)!r}")

    def build(*args: Any, **kwargs: Any) -> Float8State:
        closed, _, _ = trace(fn, args, kwargs)
        sites = SiteFeeder(None)
        rewrite_top(closed, make_context(config, fp8_sites=sites))
        return Float8State.zeros(sites.labels, config.policy.float8)

    return build


def bwd_as_written(bwd: Callable[..., Any]) -> Callable[..., Any]:
    """Marks a ``jax.custom_vjp`` backward rule to run exactly as written under autocast.

    By default `fmp.autocast` runs a custom_vjp's backward rule under the
    policy of its forward call, as ``torch.amp.custom_bwd`` does for a custom
    autograd Function: a matmul in the rule runs in the compute dtype, an
    ``exp`` in float32, and the cotangents it returns keep the dtypes the rule
    gives them. A rule marked with this decorator runs as written instead
    (every op in the dtypes it is given), e.g. a hand-tuned rule that manages
    its own precision.

    Args:
      bwd: The backward rule passed to ``defvjp``.

    Returns:
      ``bwd`` itself, marked.

    Examples:
      >>> @jax.custom_vjp
      ... def scale(x):
      ...     return 2.0 * x
      >>> scale.defvjp(lambda x: (2.0 * x, None), fmp.bwd_as_written(lambda _, g: (2.0 * g,)))
      >>> jax.grad(lambda x: fmp.autocast(scale)(x))(1.0)
      Array(2., dtype=float32, weak_type=True)
    """
    if not callable(bwd):
        raise TypeError(f"bwd_as_written(bwd) expects the backward rule (a callable), got {type(bwd).__name__}")
    setattr(bwd, BWD_AS_WRITTEN, True)
    return bwd
