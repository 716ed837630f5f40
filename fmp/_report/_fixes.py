"""The code a suggestion pastes, and every suggestion of a report applied at once (``Report.suggested``).

A fix changes the culprit and as little else as possible: the innermost named scope or module path of the
ops it runs in float32 (``overrides={"block/mlp": "float32"}``); for an op outside any scope, its source
location (``overrides={"model.py:12:8": "float32"}``); only where neither is known, a move of the
op in the rule table, spelled from ``fmp.DEFAULT_RULES`` with the rules the report ran under, so the code
names no variable the user may not have. A float8 matmul moves one step only: out of float8, into the compute
dtype (``overrides={"lm_head": "mixed_bfloat16"}``, ``keep_value``); where a key asks for both, float32 wins.

Framework-neutral: imports neither jax nor torch.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from fmp._core._rules import DEFAULT_RULES, Category, RuleSet
from fmp._core._scopes import is_location
from fmp._report._row import OpRecord


def location_key(row: OpRecord) -> str:
    """The source-location ``overrides`` key of a row (``"model.py:12:8"``), ``""`` when it has none."""
    where = row.source.split(" (", 1)[0]
    return where if is_location(where) else ""


def _diff(rules: RuleSet, framework: str, device: str | None) -> dict[str, list[str]]:
    """The moves that make ``rules`` out of ``DEFAULT_RULES`` in one table: category -> ops."""
    mine, base = rules.table(framework, device), DEFAULT_RULES.table(framework, device)
    moves: dict[str, list[str]] = {}
    for op in sorted(set(mine) | set(base)):
        cat = mine.get(op, Category.UNLISTED)
        if cat != base.get(op, Category.UNLISTED):
            moves.setdefault(cat.value, []).append(op)
    return moves


def _call(moves: dict[str, list[str]], head: Sequence[str] = ()) -> str:
    args = [*head, *(f"{cat}=[{', '.join(f'{chr(34)}{op}{chr(34)}' for op in ops)}]" for cat, ops in moves.items())]
    return f".derive({', '.join(args)})"


def _with_float32(moves: dict[str, list[str]], ops: Sequence[str]) -> dict[str, list[str]]:
    out = {c: [o for o in v if o not in ops] for c, v in moves.items() if c != "float32"}
    out = {c: v for c, v in out.items() if v}
    return {**out, "float32": sorted(set(moves.get("float32", [])) | set(ops))}


def rules_code(rules: RuleSet, ops: Sequence[str], framework: str = "jax") -> str:
    """``rules=fmp.DEFAULT_RULES.derive(...)``: ``rules`` spelled from the default table, with ``ops`` moved to
    float32 (in JAX, also the ``epilogue``/``uncontracted`` sets where ``rules`` changes them)."""
    ops = list(dict.fromkeys(ops))
    if framework == "torch":
        cpu, cuda = _diff(rules, "torch", "cpu"), _diff(rules, "torch", "cuda")
        head = ('framework="torch"',)
        if cpu == cuda:
            calls = _call(_with_float32(cpu, ops), head)
        else:
            calls = "".join(_call(m, (*head, f'device="{d}"')) for d, m in (("cpu", cpu), ("cuda", cuda)) if m)
            calls += _call({"float32": ops}, head)
        return f"rules=fmp.DEFAULT_RULES{calls}"
    extra = [
        f"{name}=[{', '.join(f'{chr(34)}{o}{chr(34)}' for o in sorted(mine))}]"
        for name, mine, base in (
            ("epilogue", rules.jax_epilogue, DEFAULT_RULES.jax_epilogue),
            ("uncontracted", rules.jax_uncontracted, DEFAULT_RULES.jax_uncontracted),
        )
        if mine != base
    ]
    return f"rules=fmp.DEFAULT_RULES{_call(_with_float32(_diff(rules, 'jax', None), ops), extra)}"


def keep_value(row: OpRecord) -> str:
    """The ``overrides`` value that keeps ``row`` out of float8: the preset of its compute dtype
    (``"mixed_bfloat16"``; a float8 matmul returns the compute dtype), ``"float32"`` when its result is float32
    (a recipe with ``output="float32"``, whose compute dtype the row does not show)."""
    low = [n for n in row.out_after if n in ("bfloat16", "float16")]
    return f"mixed_{low[0]}" if low else "float32"


def _stronger(values: dict[str, str], key: str, value: str) -> None:
    """``values[key] = value`` unless ``values[key]`` is already float32 (the stronger fix)."""
    if values.get(key) != "float32":
        values[key] = value


def _fix_value(c: OpRecord) -> str:
    """What a fix runs culprit ``c`` in: float32, or, for a float8 matmul, its compute dtype."""
    return keep_value(c) if c.category == "float8" else "float32"


def _overrides_text(keys: dict[str, str]) -> str:
    return "overrides={" + ", ".join(f'"{k}": "{v}"' for k, v in keys.items()) + "}"


def fix_code(culprits: Sequence[OpRecord], rules: RuleSet, framework: str = "jax") -> str:
    """Code to paste that runs ``culprits`` in float32 (a float8 matmul: in its compute dtype, ``keep_value``):
    an override of each one's scope (or, outside any scope, of its source location); a rule-table move
    (``rules_code``) for the others."""
    keys: dict[str, str] = {}
    moved = []
    for c in culprits:
        key = c.scope or location_key(c)
        if key:
            _stronger(keys, key, _fix_value(c))
        else:
            moved.append(c.op)
    parts = []
    if keys:
        parts.append(_overrides_text(keys))
    if moved:
        parts.append(rules_code(rules, moved, framework))
    return ", ".join(parts)


def _rules_of(node: ast.expr) -> RuleSet:
    """The rule set of ``fmp.DEFAULT_RULES.derive(...).derive(...)`` (literal arguments only)."""
    calls = []
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "derive":
        calls.append({k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg})
        node = node.func.value
    if ast.unparse(node) != "fmp.DEFAULT_RULES":
        raise ValueError(f"not a suggestion fmp writes: {ast.unparse(node)}")
    rules = DEFAULT_RULES
    for kwargs in reversed(calls):
        rules = rules.derive(**kwargs)
    return rules


def parse(suggestion: str) -> dict[str, Any]:
    """The keyword arguments a suggestion names: ``{"overrides": {...}}`` and/or ``{"rules": RuleSet}``."""
    call = ast.parse(f"f({suggestion})", mode="eval").body
    if not isinstance(call, ast.Call):
        raise ValueError(f"not a suggestion fmp writes: {suggestion}")
    out: dict[str, Any] = {}
    for kw in call.keywords:
        out[kw.arg or ""] = ast.literal_eval(kw.value) if kw.arg == "overrides" else _rules_of(kw.value)
    return out


def _merge_rules(sets: Sequence[RuleSet]) -> RuleSet:
    """The first rule set with every op another one moved to float32 moved too."""
    merged = sets[0]
    for other in sets[1:]:
        for framework, device in (("jax", None), ("torch", "cpu"), ("torch", "cuda")):
            table, now = other.table(framework, device), merged.table(framework, device)
            ops = [o for o, c in table.items() if c is Category.FLOAT32 and now.get(o) is not Category.FLOAT32]
            if ops:
                merged = merged.derive(framework=framework, device=device, float32=ops)
    return merged


def combined(suggestions: Iterable[str]) -> dict[str, Any]:
    """The keyword arguments (``overrides=``, ``rules=``) that apply every suggestion at once."""
    overrides: dict[str, str] = {}
    rule_sets: list[RuleSet] = []
    for s in dict.fromkeys(suggestions):
        kwargs = parse(s)
        for key, value in kwargs.get("overrides", {}).items():
            _stronger(overrides, key, value)
        if "rules" in kwargs:
            rule_sets.append(kwargs["rules"])
    out: dict[str, Any] = {}
    if overrides:
        out["overrides"] = overrides
    if rule_sets:
        out["rules"] = _merge_rules(rule_sets)
    return out


def _under(scope: str, key: str) -> bool:
    """``scope`` is ``key`` or lies inside it (a JAX name scope ``a/b``, a torch module path ``a.b``)."""
    return scope == key or scope.startswith((f"{key}/", f"{key}."))


def _crowded(key: str, records: Sequence[OpRecord], culprits: set[int]) -> bool:
    """An override of scope ``key`` would also move a low-precision matmul or convolution that no fix names."""
    return any(
        r.index not in culprits
        and r.flops > 0
        and r.category not in ("cast", "user_cast")
        and any(n in ("bfloat16", "float16") or n.startswith("float8") for n in r.out_after + r.in_after)
        and _under(r.scope, key)
        for r in records
    )


def localised(records: Sequence[OpRecord]) -> tuple[OpRecord, ...]:
    """``records`` with each fix kept local: where a culprit's scope also holds a low-precision matmul or
    convolution that no fix of the report names (the scope is a whole model or block, ``"Attention"`` around
    its ``q``/``k``/``v`` layers), its override key becomes the culprit's source location, so the fix moves
    the culprit and not the matmuls beside it. Rows without a source location keep their scope."""
    index = {r.index: r for r in records}
    named = {i for r in records if r.suggestion for i in r.culprits}
    out = []
    for r in records:
        if not (r.suggestion and r.culprits and r.suggestion.startswith("overrides={")):
            out.append(r)
            continue
        keys: dict[str, str] = {}
        for c in (index[i] for i in r.culprits if i in index):
            key = c.scope or location_key(c)
            if c.scope and _crowded(c.scope, records, named) and location_key(c):
                key = location_key(c)
            if key:
                _stronger(keys, key, _fix_value(c))
        end = r.suggestion.index("}") + 1  # the overrides dict (keys hold no "}"), then any rules= part
        out.append(dataclasses.replace(r, suggestion=_overrides_text(keys) + r.suggestion[end:]) if keys else r)
    return tuple(out)
