"""Precision categories and `RuleSet`, the one rule table for both frameworks."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from fmp._core import _dtypes
from fmp._core import _rules_data as data


class Category(str, enum.Enum):
    """How an operation chooses the dtype it runs in.

    * ``LOWER_PRECISION``: floating inputs are cast to the policy's compute dtype.
    * ``FLOAT32``: floating inputs are cast to float32.
    * ``PROMOTE``: floating inputs are cast to the widest floating input dtype.
    * ``BANNED``: the op refuses to run under a float16 policy (torch: under any
      autocast); the error names the safe alternative.
    * ``UNLISTED``: the op runs in the dtypes it is given.
    * ``FLOAT8``: a matmul or convolution that runs in float8 under a policy with
      a ``float8`` recipe (``"mixed_float8"``) and exactly as ``LOWER_PRECISION``
      under any other policy.

    float64 values, integers and booleans are never cast by any category.

    Examples:
      >>> fmp.DEFAULT_RULES.category("exp")
      <Category.FLOAT32: 'float32'>
      >>> fmp.Category("lower_precision") is fmp.Category.LOWER_PRECISION
      True
    """

    LOWER_PRECISION = "lower_precision"
    FLOAT32 = "float32"
    PROMOTE = "promote"
    BANNED = "banned"
    UNLISTED = "unlisted"
    FLOAT8 = "float8"


FRAMEWORKS = ("jax", "torch")
TORCH_DEVICES = ("cpu", "cuda")

_MSG_BANNED_DEFAULT = (
    "{op} is unsafe to run in float16 under autocast. Compute it from logits in float32 "
    "(move it to the 'float32' category with RuleSet.derive) or use a bfloat16 policy."
)


def _freeze(mapping: Mapping[str, Category]) -> Mapping[str, Category]:
    return MappingProxyType(dict(sorted(mapping.items())))


def _table(**categories: Iterable[str]) -> dict[str, Category]:
    out: dict[str, Category] = {}
    for cat, names in categories.items():
        for name in names:
            if name in out:
                raise ValueError(f"op {name!r} is listed in two categories")
            out[name] = Category(cat)
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class RuleSet:
    """An immutable precision rule table for JAX primitives and torch ATen ops.

    ``RuleSet`` maps operation names to a `Category`. JAX primitives are
    keyed by primitive name (``"dot_general"``); torch ops by dispatcher name
    (``"aten::mm"``, ``"aten::pow.Tensor_Scalar"``), separately for the ``"cpu"``
    and ``"cuda"`` autocast registries because torch's two lists differ.
    An operation that is not in the table is ``UNLISTED``.

    Build a custom rule set with `RuleSet.derive`; the default one is
    ``fmp.DEFAULT_RULES``. A ``RuleSet`` is hashable, so it can be a static
    argument of ``jax.jit``.

    Examples:
      >>> rules = fmp.DEFAULT_RULES.derive(float32=["dot_general"])
      >>> rules.category("dot_general")
      <Category.FLOAT32: 'float32'>
      >>> fmp.DEFAULT_RULES.category("dot_general")
      <Category.FLOAT8: 'float8'>
      >>> fmp.DEFAULT_RULES.category("aten::softmax.int", framework="torch", device="cuda")
      <Category.FLOAT32: 'float32'>
    """

    jax: Mapping[str, Category]
    torch_cpu: Mapping[str, Category]
    torch_cuda: Mapping[str, Category]
    # torch CUDA float32 ops that pass dtype=float32 instead of casting: op -> variant
    torch_cuda_variants: Mapping[str, str] = dataclasses.field(default_factory=dict)
    banned_messages: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # JAX promote ops that take a bias into a lower_precision op's result (see ``derive(epilogue=...)``)
    jax_epilogue: frozenset[str] = frozenset()
    # JAX contractions decided as ``mul`` when they sum one element per output (see ``derive(uncontracted=...)``)
    jax_uncontracted: frozenset[str] = frozenset()
    # unlisted torch CPU ops whose kernels call listed ops through the dispatcher: eager autocast reaches
    # inside them, so the FX rewrite runs them in a one-op autocast region
    torch_cpu_autocast_inside: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        for field in ("jax", "torch_cpu", "torch_cuda"):
            table = {name: Category(cat) for name, cat in getattr(self, field).items()}
            object.__setattr__(self, field, _freeze(table))
        object.__setattr__(self, "torch_cuda_variants", MappingProxyType(dict(self.torch_cuda_variants)))
        object.__setattr__(self, "banned_messages", MappingProxyType(dict(self.banned_messages)))
        object.__setattr__(self, "jax_epilogue", frozenset(self.jax_epilogue))
        object.__setattr__(self, "jax_uncontracted", frozenset(self.jax_uncontracted))
        object.__setattr__(self, "torch_cpu_autocast_inside", frozenset(self.torch_cpu_autocast_inside))
        # the tables never change after this point: compute the key and hash once (autocast hashes the
        # rule set for its cache on every transformed jaxpr)
        object.__setattr__(self, "_cached_key", self._build_key())
        object.__setattr__(self, "_cached_hash", hash(self._cached_key))

    def _key(self) -> tuple:
        return self._cached_key

    def _build_key(self) -> tuple:
        return (
            tuple(self.jax.items()),
            tuple(self.torch_cpu.items()),
            tuple(self.torch_cuda.items()),
            tuple(sorted(self.torch_cuda_variants.items())),
            tuple(sorted(self.banned_messages.items())),
            tuple(sorted(self.jax_epilogue)),
            tuple(sorted(self.jax_uncontracted)),
            tuple(sorted(self.torch_cpu_autocast_inside)),
        )

    def __hash__(self) -> int:
        return self._cached_hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RuleSet) and self._key() == other._key()

    def __repr__(self) -> str:
        return (
            f"RuleSet(jax={len(self.jax)} ops, torch_cpu={len(self.torch_cpu)} ops, "
            f"torch_cuda={len(self.torch_cuda)} ops)"
        )

    def table(self, framework: str = "jax", device: str | None = None) -> Mapping[str, Category]:
        """The name -> category mapping of one framework (and torch device)."""
        framework = _check_framework(framework)
        if framework == "jax":
            return self.jax
        return self.torch_cuda if _check_device(device) == "cuda" else self.torch_cpu

    def category(self, name: str, framework: str = "jax", device: str | None = None) -> Category:
        """The category of op ``name``; ``UNLISTED`` when the table does not name it."""
        return self.table(framework, device).get(name, Category.UNLISTED)

    def ops(self, category: Category | str, framework: str = "jax", device: str | None = None) -> tuple[str, ...]:
        """The sorted names of every op in ``category``."""
        cat = _check_category(category)
        return tuple(n for n, c in self.table(framework, device).items() if c is cat)

    def banned_message(self, name: str) -> str:
        """The error raised when banned op ``name`` runs under autocast."""
        return self.banned_messages.get(name, _MSG_BANNED_DEFAULT.format(op=name))

    def derive(
        self,
        *,
        framework: str = "jax",
        device: str | None = None,
        banned_messages: Mapping[str, str] | None = None,
        epilogue: Iterable[str] | None = None,
        uncontracted: Iterable[str] | None = None,
        **moves: Iterable[str],
    ) -> RuleSet:
        """Returns a new rule set with ops moved between categories.

        Args:
          framework: ``"jax"`` (primitive names) or ``"torch"`` (``"aten::..."`` names).
          device: For torch, ``"cpu"`` or ``"cuda"``; ``None`` moves the op in both.
          banned_messages: Optional messages for ops moved to ``banned``.
          epilogue: Optional JAX primitive names that replace ``jax_epilogue``: the
            promote ops (default ``add``, ``sub``) that run in the compute dtype
            when they add a bias along the output features to the result of a
            linear layer's product or a convolution, as torch's ``linear`` and
            ``conv`` do. ``epilogue=[]`` turns the rule off. The torch tables
            are not affected.
          uncontracted: Optional JAX primitive names that replace
            ``jax_uncontracted``: the contractions (default ``dot_general``)
            decided as ``mul`` when they sum one element per output (an outer
            or batch-only product). ``uncontracted=[]`` runs them in the compute
            dtype. The torch tables are not affected.
          **moves: ``category_name=[op, ...]``, e.g. ``float32=["dot_general"]`` or
            ``unlisted=["exp"]``. An op may appear in one category only.

        Returns:
          A new `RuleSet`; ``self`` is not modified.

        Raises:
          ValueError: on an unknown category, framework or device, or an op named twice.
          TypeError: if a category is given a string instead of a list of names.

        Examples:
          >>> r = fmp.DEFAULT_RULES.derive(unlisted=["exp"], lower_precision=["tanh"])
          >>> r.category("exp"), r.category("tanh")
          (<Category.UNLISTED: 'unlisted'>, <Category.LOWER_PRECISION: 'lower_precision'>)
          >>> sorted(fmp.DEFAULT_RULES.jax_epilogue), fmp.DEFAULT_RULES.derive(epilogue=[]).jax_epilogue
          (['add', 'sub'], frozenset())
          >>> fmp.DEFAULT_RULES.derive(uncontracted=[]).jax_uncontracted
          frozenset()
        """
        framework = _check_framework(framework)
        epilogue = _primitive_names("epilogue", epilogue)
        uncontracted = _primitive_names("uncontracted", uncontracted)
        seen: dict[str, Category] = {}
        for cat_name, names in moves.items():
            cat = _check_category(cat_name)
            if isinstance(names, str):
                raise TypeError(
                    f"derive({cat_name}=...) expects a list of op names, got the string {names!r}; "
                    f"write {cat_name}=[{names!r}]"
                )
            for name in names:
                if not isinstance(name, str):
                    raise TypeError(f"derive({cat_name}=...) expects op names as str, got {name!r}")
                if name in seen and seen[name] is not cat:
                    raise ValueError(
                        f"op {name!r} is moved to both {seen[name].value!r} and {cat.value!r}; name it once"
                    )
                seen[name] = cat
        if framework == "jax":
            targets = ["jax"]
        elif device is None:
            targets = ["torch_cpu", "torch_cuda"]
        else:
            targets = ["torch_" + _check_device(device)]
        changes: dict[str, object] = {}
        for field in targets:
            table = dict(getattr(self, field))
            for name, cat in seen.items():
                if cat is Category.UNLISTED:
                    table.pop(name, None)
                else:
                    table[name] = cat
            changes[field] = table
        variants = dict(self.torch_cuda_variants)
        if "torch_cuda" in targets:
            variants = {k: v for k, v in variants.items() if seen.get(k, Category.FLOAT32) is Category.FLOAT32}
        messages = dict(self.banned_messages)
        messages.update(banned_messages or {})
        if epilogue is not None:
            changes["jax_epilogue"] = epilogue
        if uncontracted is not None:
            changes["jax_uncontracted"] = uncontracted
        return dataclasses.replace(self, torch_cuda_variants=variants, banned_messages=messages, **changes)  # type: ignore[arg-type]


def _primitive_names(arg: str, names: Iterable[str] | None) -> frozenset[str] | None:
    if isinstance(names, str):
        raise TypeError(f"derive({arg}=...) expects a list of JAX primitive names, got the string {names!r}")
    if names is None:
        return None
    names = frozenset(names)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"derive({arg}=...) expects primitive names as str, got {bad[0]!r}")
    return names


def _check_framework(framework: str) -> str:
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {FRAMEWORKS}, got {framework!r}")
    return framework


def _check_device(device: str | None) -> str:
    if device is None:
        return "cpu"
    if device not in TORCH_DEVICES:
        raise ValueError(f"device must be one of {TORCH_DEVICES} (or None for cpu), got {device!r}")
    return device


def _check_category(category: Category | str) -> Category:
    try:
        return Category(category)
    except ValueError:
        accepted = ", ".join(c.value for c in Category)
        raise ValueError(f"unknown precision category {category!r}; accepted: {accepted}") from None


def decide(
    category: Category,
    compute_dtype: str,
    float_input_dtypes: Iterable[str],
) -> str | None:
    """The dtype an op's castable floating inputs are cast to, or None to leave them.

    Framework-neutral: dtypes are canonical names (``"bfloat16"``). Inputs in
    float64 never take part and are never cast (as in torch, they are not
    "eligible"). ``BANNED`` ops are decided like ``UNLISTED``; raising is the
    caller's job because the message depends on the op.

    Examples:
      >>> from fmp._core._rules import decide, Category
      >>> decide(Category.PROMOTE, "bfloat16", ["bfloat16", "float32"])
      'float32'
      >>> decide(Category.LOWER_PRECISION, "float16", ["float32", "float64"])
      'float16'
    """
    eligible = [d for d in float_input_dtypes if d in _dtypes.CASTABLE]
    if not eligible:
        return None
    if category is Category.LOWER_PRECISION or category is Category.FLOAT8:
        return compute_dtype
    if category is Category.FLOAT32:
        return "float32"
    if category is Category.PROMOTE:
        return _dtypes.widest(eligible)
    return None


DEFAULT_RULES = RuleSet(
    jax=_table(
        lower_precision=data.JAX_LOWER_PRECISION,
        float8=data.JAX_FLOAT8,
        float32=data.JAX_FLOAT32,
        promote=data.JAX_PROMOTE,
        banned=data.JAX_BANNED,
    ),
    torch_cpu=_table(
        lower_precision=data.TORCH_CPU_LOWER_PRECISION,
        float32=data.TORCH_CPU_FLOAT32,
        promote=data.TORCH_CPU_PROMOTE,
    ),
    torch_cuda=_table(
        lower_precision=data.TORCH_CUDA_LOWER_PRECISION,
        float32=(
            data.TORCH_CUDA_FLOAT32 + data.TORCH_CUDA_FLOAT32_SET_OPT_DTYPE + data.TORCH_CUDA_FLOAT32_APPEND_DTYPE
        ),
        promote=data.TORCH_CUDA_PROMOTE,
        banned=data.TORCH_CUDA_BANNED,
    ),
    torch_cuda_variants={
        **dict.fromkeys(data.TORCH_CUDA_FLOAT32_SET_OPT_DTYPE, "set_opt_dtype"),
        **dict.fromkeys(data.TORCH_CUDA_FLOAT32_APPEND_DTYPE, "append_dtype"),
    },
    banned_messages=dict(data.TORCH_CUDA_BANNED),
    jax_epilogue=data.JAX_EPILOGUE,
    jax_uncontracted=data.JAX_UNCONTRACTED,
    torch_cpu_autocast_inside=data.TORCH_CPU_AUTOCAST_INSIDE,
)
"""The rule table fmp ships and uses by default: one `RuleSet` for both frameworks.

Its JAX table says which primitives run in the compute dtype (``float8``: ``dot_general`` and convolutions,
which run in float8 under a policy with a float8 recipe and in the compute dtype otherwise), which in float32
(exponentials, logarithms, powers, reductions, linear algebra, FFT) and which in their widest input; its torch
tables are torch's CPU and CUDA autocast op lists, the union over torch 2.13, 2.14 and 2.15 (an op only some of
them register, as ``aten::qr`` up to 2.13, is listed for all; no graph of another release holds it).

Examples:
  >>> fmp.DEFAULT_RULES.category("exp")
  <Category.FLOAT32: 'float32'>
  >>> fmp.DEFAULT_RULES.category("dot_general")
  <Category.FLOAT8: 'float8'>
  >>> fmp.DEFAULT_RULES.category("aten::mm", framework="torch", device="cpu")
  <Category.LOWER_PRECISION: 'lower_precision'>
"""


OVERRIDE = "override"  # the report's rule for an op that ``overrides`` or a moved rule decided (both frameworks)


def moved(rules: RuleSet, name: str, framework: str = "jax", device: str | None = None) -> str:
    """Why op ``name`` reads ``override`` in a report when ``rules`` moved it out of its default category
    (``"float32 by rules, default lower_precision"``), ``""`` where ``rules`` decides it as the default does."""
    if rules is DEFAULT_RULES:
        return ""
    mine, base = rules.category(name, framework, device), DEFAULT_RULES.category(name, framework, device)
    return "" if mine is base else f"{mine.value} by rules, default {base.value}"


def joined(*parts: str) -> str:
    """The non-empty ``parts`` of a row's detail, joined with ``"; "``."""
    return "; ".join(p for p in parts if p)
