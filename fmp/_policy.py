"""Policy: the param / compute / output dtypes of a mixed-precision program."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from fmp._core import _dtypes
from fmp._core._renamed import NOT_GIVEN, renamed_argument, warn_renamed
from fmp._float8._recipe import SCALING_ALIASES, SCALINGS, Float8Recipe, as_recipe, recipe_from_spec

T = TypeVar("T")

PRESETS: dict[str, tuple[str, str, str]] = {
    "mixed_bfloat16": ("float32", "bfloat16", "float32"),
    "mixed_float16": ("float32", "float16", "float32"),
    "float32": ("float32", "float32", "float32"),
}

# presets with a float8 recipe: (param, compute, output, float8 scaling)
FLOAT8_PRESETS: dict[str, tuple[str, str, str, str]] = {
    "mixed_float8": ("float32", "bfloat16", "float32", "tensorwise"),
    # block-scaled formats (emulated where the device has no MX tensor cores; see fmp.quantize)
    "mixed_mxfp8": ("float32", "bfloat16", "float32", "mxfp8"),
    "mixed_mxfp4": ("float32", "bfloat16", "float32", "mxfp4"),
    "mixed_nvfp4": ("float32", "bfloat16", "float32", "nvfp4"),
}

# the keys of a key=dtype spec, per field: a long name and jmp's short form (jmp's own spellings); nothing else
# is taken, so a near miss ("param=", "outputs=") is an error that names the key it meant
_KEY_SPELLINGS = {
    "param": ("params", "p"),
    "compute": ("compute", "c"),
    "output": ("output", "o"),
    "float8": ("float8",),
}
_KEYS = {key: field for field, keys in _KEY_SPELLINGS.items() for key in keys}
_OLD_FLOAT8_KEY = "fp8"  # the deprecated spelling of float8= (one release)
_ACCEPTED_KEYS = ", ".join("|".join(keys) for keys in _KEY_SPELLINGS.values())

_MSG_SPEC_FORMAT = (
    "A policy spec is a preset ({presets}), a single dtype (all three fields), or comma-separated "
    "key=dtype pairs with keys {keys}, e.g. 'params=float32,compute=bfloat16,output=float32' "
    "or 'p=f32,c=bf16,o=f32' (add float8=tensorwise|rowwise|blockwise|delayed|mxfp8|mxfp4|nvfp4 for float8 or "
    "block-scaled matmuls, with recipe options in parentheses: float8=delayed(history_len=1024,margin=1)). "
    "Accepted dtypes: {dtypes}."
)
_MSG_UNKNOWN_KEY = "get_policy(spec): unknown key {key!r} in {token!r}{hint}; the accepted keys are {keys}. {help}"


def _spec_help() -> str:
    presets = ", ".join([*PRESETS, *FLOAT8_PRESETS])
    return _MSG_SPEC_FORMAT.format(presets=presets, keys=_ACCEPTED_KEYS, dtypes=_dtypes.accepted_spellings())


def _unknown_key(key: str, token: str) -> str:
    near = difflib.get_close_matches(key.lower(), list(_KEYS), n=1, cutoff=0.6)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return _MSG_UNKNOWN_KEY.format(key=key, token=token, hint=hint, keys=_ACCEPTED_KEYS, help=_spec_help())


def _to_name(value: Any, field: str) -> str:
    """Canonical float dtype name of ``value``, or a ValueError/TypeError naming ``field``."""
    if value is None:
        # np.dtype(None) is float64: never let a missing dtype become a silent float64
        raise TypeError(f"Policy {field} must be a floating dtype (jnp.float32, 'bf16', ...), got None")
    if isinstance(value, str):
        name = _dtypes.canonical_name(value)
        if name is None:
            raise ValueError(f"Policy {field}: unknown dtype {value!r}. Accepted: {_dtypes.accepted_spellings()}.")
        return name
    try:
        dt = np.dtype(value)
    except TypeError:
        raise TypeError(
            f"Policy {field} must be a floating dtype (jnp.float32, 'bf16', ...), got {value!r} of type "
            f"{type(value).__name__}"
        ) from None
    if dt.name not in _dtypes.FLOAT_ALIASES:
        raise ValueError(
            f"Policy {field} must be a floating dtype (float16, bfloat16, float32 or float64), got {dt.name}. "
            "Integer, boolean and complex values are never cast by a policy."
        )
    return dt.name


@dataclasses.dataclass(frozen=True, init=False)  # __init__ takes the deprecated fp8= too
class Policy:
    """The dtypes of a mixed-precision program: parameters, computation and outputs.

    A ``Policy`` is immutable and hashable, so it can be a static argument of
    ``jax.jit``. Fields accept any dtype-like (``jnp.bfloat16``, ``"bf16"``,
    ``np.dtype("float32")``) and are stored as ``numpy.dtype``.

    Args:
      param_dtype: dtype parameters are stored in.
      compute_dtype: dtype matrix products and convolutions run in.
      output_dtype: dtype of the outputs of a policy-wrapped function.
      float8: Optional float8 recipe (a ``fmp.Float8Recipe``, a scaling name
        such as ``"tensorwise"``, or a recipe's string form such as ``"rowwise(pow2_scales=false)"``):
        matmuls and convolutions (the rule table's ``float8`` category) then run in float8, everything
        else as without it. ``str(policy)`` names every recipe option that differs from its defaults.
      fp8: Deprecated name of ``float8`` (warns; removed in the next release).

    Raises:
      ValueError: a field is not a floating dtype.
      TypeError: a field is not dtype-like at all.

    Examples:
      >>> p = fmp.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
      >>> str(p)
      'params=float32,compute=bfloat16,output=float32'
      >>> p.cast_to_compute({"w": jnp.ones(2), "step": jnp.int32(3)})["w"].dtype
      dtype(bfloat16)
      >>> fmp.Policy("f32", "bf16", "f32", float8="rowwise") == fmp.get_policy("p=f32,c=bf16,o=f32,float8=rowwise")
      True
      >>> str(fmp.Policy("f32", "bf16", "f32", float8=fmp.Float8Recipe("delayed", margin=1)))
      'params=float32,compute=bfloat16,output=float32,float8=delayed(margin=1)'
    """

    param_dtype: Any
    compute_dtype: Any
    output_dtype: Any
    float8: Float8Recipe | None = None

    def __init__(
        self,
        param_dtype: Any,
        compute_dtype: Any,
        output_dtype: Any,
        float8: Float8Recipe | str | None = None,
        *,
        fp8: Any = NOT_GIVEN,
    ) -> None:
        float8 = renamed_argument(float8, fp8, "Policy(fp8=...)", "Policy(float8=...)")
        dtypes = {"param_dtype": param_dtype, "compute_dtype": compute_dtype, "output_dtype": output_dtype}
        for field, value in dtypes.items():
            object.__setattr__(self, field, jnp.dtype(_to_name(value, field)))
        object.__setattr__(self, "float8", as_recipe(float8))

    @property
    def fp8(self) -> Float8Recipe | None:
        """Deprecated name of ``float8`` (warns; removed in the next release)."""
        warn_renamed("Policy.fp8", "Policy.float8")
        return self.float8

    def __str__(self) -> str:
        out = f"params={self.param_dtype.name},compute={self.compute_dtype.name},output={self.output_dtype.name}"
        return out if self.float8 is None else f"{out},float8={self.float8}"

    def with_param_dtype(self, dtype: Any) -> Policy:
        """A copy with another ``param_dtype``."""
        return dataclasses.replace(self, param_dtype=dtype)

    def with_compute_dtype(self, dtype: Any) -> Policy:
        """A copy with another ``compute_dtype``."""
        return dataclasses.replace(self, compute_dtype=dtype)

    def with_output_dtype(self, dtype: Any) -> Policy:
        """A copy with another ``output_dtype``."""
        return dataclasses.replace(self, output_dtype=dtype)

    def cast_to_param(self, tree: T) -> T:
        """Casts the floating leaves of ``tree`` to ``param_dtype`` (see `cast_tree`)."""
        return cast_tree(tree, self.param_dtype)

    def cast_to_compute(self, tree: T) -> T:
        """Casts the floating leaves of ``tree`` to ``compute_dtype`` (see `cast_tree`)."""
        return cast_tree(tree, self.compute_dtype)

    def cast_to_output(self, tree: T) -> T:
        """Casts the floating leaves of ``tree`` to ``output_dtype`` (see `cast_tree`)."""
        return cast_tree(tree, self.output_dtype)


def _cast_leaf(x: Any, dtype: np.dtype) -> Any:
    if isinstance(x, jax.Array):
        return x.astype(dtype) if x.dtype.name in _dtypes.CASTABLE and x.dtype != dtype else x
    if isinstance(x, np.ndarray | np.generic):
        return x.astype(dtype) if x.dtype.name in _dtypes.CASTABLE and x.dtype != dtype else x
    return x


def cast_tree(tree: T, dtype: Any) -> T:
    """Casts every float16/bfloat16/float32 array leaf of ``tree`` to ``dtype``.

    Integer, boolean and PRNG-key arrays, float64 arrays, ``None`` and non-array
    leaves (Python numbers, strings) are returned untouched, so optimizer step
    counters and random keys survive. NumPy arrays stay NumPy arrays.

    Args:
      tree: Any pytree.
      dtype: Target floating dtype (anything `Policy` accepts).

    Returns:
      A tree of the same structure.

    Examples:
      >>> t = fmp.cast_tree({"a": jnp.ones(2), "n": jnp.arange(2), "s": 1.5}, "bf16")
      >>> t["a"].dtype, t["n"].dtype, t["s"]
      (dtype(bfloat16), dtype('int32'), 1.5)
    """
    target = jnp.dtype(_to_name(dtype, "dtype"))
    return jax.tree_util.tree_map(lambda x: _cast_leaf(x, target), tree)


def get_policy(spec: str | Policy) -> Policy:
    """Builds a `Policy` from a string spec (or returns a ``Policy`` as is).

    Accepted specs:

    * presets ``"mixed_bfloat16"`` (f32 params, bf16 compute, f32 output),
      ``"mixed_float16"`` and ``"float32"``;
    * a single dtype such as ``"bf16"``: all three fields;
    * comma-separated ``key=dtype`` pairs, keys ``params``/``p``,
      ``compute``/``c``, ``output``/``o`` (jmp's; no other spelling); dtypes
      ``float16``/``f16``/``half``, ``bfloat16``/``bf16``, ``float32``/``f32``/``full``, ``float64``/``f64``;
      and ``float8=<scaling>`` (``tensorwise``, ``rowwise``, ``blockwise``,
      ``delayed``, ``mxfp8``, ``mxfp4``, ``nvfp4``) for float8 or block-scaled matmuls, with any
      `fmp.Float8Recipe` options in parentheses (``float8=rowwise(pow2_scales=false)``);
    * ``"mixed_float8"``: the ``mixed_bfloat16`` dtypes with tensorwise float8
      matmuls (see ``fmp.Float8Recipe``); ``"mixed_mxfp8"``, ``"mixed_mxfp4"`` and ``"mixed_nvfp4"``:
      the same with matmuls in a block-scaled format (``float8=mxfp8`` ...; see `fmp.quantize`).

    Unspecified fields: ``params`` defaults to float32, ``compute`` to
    ``params``, and ``output`` to ``params`` (outputs return to the full type).
    ``str(policy)`` gives a spec that parses back to an equal policy (a recipe's options included).

    Raises:
      ValueError: naming the bad token and listing what is accepted.
      TypeError: ``spec`` is neither a string nor a ``Policy``.

    Examples:
      >>> fmp.get_policy("p=f32,c=bf16")
      Policy(param_dtype=dtype('float32'), compute_dtype=dtype(bfloat16), output_dtype=dtype('float32'), float8=None)
      >>> fmp.get_policy(str(fmp.get_policy("mixed_float16"))) == fmp.get_policy("mixed_float16")
      True
      >>> fmp.get_policy("p=f32,c=bf16,float8=delayed(history_len=1024,pow2_scales=false)").float8
      Float8Recipe(scaling='delayed', pow2_scales=False, history_len=1024)
    """
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"get_policy(spec) expects a str or a Policy, got {type(spec).__name__}. {_spec_help()}")
    text = spec.strip()
    if not text:
        raise ValueError(f"get_policy(spec): the spec is empty. {_spec_help()}")
    preset = PRESETS.get(text.lower())
    if preset is not None:
        return Policy(*preset)
    float8_preset = FLOAT8_PRESETS.get(text.lower())
    if float8_preset is not None:
        return Policy(*float8_preset[:3], float8=float8_preset[3])
    if "=" not in text and "," not in text:
        name = _dtypes.canonical_name(text)
        if name is None:
            raise ValueError(f"get_policy(spec): unknown preset or dtype {text!r}. {_spec_help()}")
        return Policy(name, name, name)
    fields: dict[str, str] = {}
    recipes: dict[str, Float8Recipe] = {}
    for token in _entries(text):
        token = token.strip()
        if not token:
            raise ValueError(f"get_policy(spec): empty entry in {spec!r} (check the commas). {_spec_help()}")
        key, sep, value = token.partition("=")
        if not sep:
            raise ValueError(f"get_policy(spec): entry {token!r} is not of the form key=dtype. {_spec_help()}")
        field = _KEYS.get(key.strip().lower())
        if field is None and key.strip().lower() == _OLD_FLOAT8_KEY:
            warn_renamed(f"The policy key {_OLD_FLOAT8_KEY}= (in {spec!r})", "float8=")
            field = "float8"
        if field is None:
            raise ValueError(_unknown_key(key.strip(), token))
        if field in fields or field in recipes:
            keys = _KEY_SPELLINGS[field]  # the public spellings: the field name "param" is not a key
            spelled = repr(keys[0]) + (f" (or {keys[1]!r})" if len(keys) > 1 else "")
            raise ValueError(f"get_policy(spec): {spelled} is given twice (in {token!r}). {_spec_help()}")
        if field == "float8":
            scaling = value.partition("(")[0].strip().lower()
            if scaling not in (*SCALINGS, *SCALING_ALIASES):
                raise ValueError(
                    f"get_policy(spec): unknown float8 scaling {scaling!r} in {token!r} "
                    f"(accepted: {', '.join(SCALINGS)}). {_spec_help()}"
                )
            try:
                recipes[field] = recipe_from_spec(value)
            except ValueError as err:
                raise ValueError(f"get_policy(spec): {err} (in {token!r})") from None
            continue
        name = _dtypes.canonical_name(value)
        if name is None:
            raise ValueError(f"get_policy(spec): unknown dtype {value.strip()!r} in {token!r}. {_spec_help()}")
        fields[field] = name
    param = fields.get("param", "float32")
    compute = fields.get("compute", param)
    output = fields.get("output", param)
    return Policy(param, compute, output, float8=recipes.get("float8"))


def _entries(text: str) -> list[str]:
    """A spec's comma-separated entries; a float8 recipe's options (``float8=delayed(margin=1,...)``) keep
    their commas."""
    entries, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            entries.append(text[start:i])
            start = i + 1
    return [*entries, text[start:]]
