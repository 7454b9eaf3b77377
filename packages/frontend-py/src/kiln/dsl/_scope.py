"""Dimensions of one module instance: which symbol a name stands for, its value, and conditions.

A module's IR uses one symbol per quantity. A config key with an alias (declared by
``self.C = Dim("d_model")``, by ``_dims_ = {"C": "d_model"}`` or by the conventional table below)
is written as the alias, and the alias goes into the module's config; expression aliases such as
``QKV`` are written out (``(Hq + 2 * Hkv) * D``). Conditions (``when=``) and ``_constraints_`` are
read by kiln-core's condition parser (``kiln.core.ir.parse_condition``), never by ``eval``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from kiln.core import DimError
from kiln.core.ir import ConditionError, Const, DimExpr, Sym, parse_condition, parse_dim
from kiln.dsl._errors import error

__all__ = [
    "CONVENTIONAL",
    "DERIVED",
    "Scope",
    "check_condition",
    "translate",
]

#: alias -> (config keys it may stand for, first present wins; fallback expression)
CONVENTIONAL: dict[str, tuple[tuple[str, ...], str | None]] = {
    "C": (("d_model", "hidden_size"), None),
    "Hq": (("num_query_heads", "num_heads", "num_attention_heads"), None),
    "Hkv": (("num_kv_heads", "num_key_value_heads"), "Hq"),
    "D": (("head_size", "head_dim"), "C // Hq"),
    "M": (("d_ff", "intermediate_size"), None),
    "MaxSeq": (("max_seq", "max_position_embeddings"), None),
    "E": (("num_experts",), None),
    "K": (("num_experts_per_tok", "top_k"), None),
    "MoeM": (("moe_d_ff", "moe_intermediate_size"), None),
    "SharedM": (("shared_d_ff", "shared_expert_intermediate_size"), None),
}
#: aliases written out as expressions wherever they appear
DERIVED: dict[str, str] = {"QKV": "(Hq + 2 * Hkv) * D", "AttnDim": "Hq * D", "MUp": "2 * M"}
_FIXED = ("B", "T")
_DIM_HINT = (
    'bind it with a constructor argument or an int attribute of that name, self.{0} = Dim("config_key"), '
    'or a class attribute _dims_ = {{"{0}": "expression"}}'
)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class Scope:
    """The dimension namespace of one module instance; ``canon`` maps any dim to its IR form."""

    def __init__(
        self,
        obj: Any,
        config: Mapping[str, Any],
        dims: Mapping[str, Any] | None = None,
        foreign: Mapping[str, DimExpr] | None = None,
    ) -> None:
        self.obj, self.config = obj, dict(config)
        self.dims = dict(dims or {})
        self.foreign = dict(foreign or {})  # config key -> the caller's dim it was given as
        self.extra: dict[str, int] = {}  # aliases added to the config
        self._memo: dict[str, DimExpr | None] = {}
        self._key_alias: dict[str, str] | None = None
        self._resolving: set[str] = set()

    # -- definitions --
    def _attr(self, name: str) -> Any:
        if name in self.foreign:
            return None
        return getattr(self.obj, "__dict__", {}).get(name)

    def int_key(self, name: str) -> int | None:
        """The value of ``name`` if it is an int config entry or int attribute."""
        v = self._attr(name)
        if _is_int(v):
            return v  # type: ignore[no-any-return]
        v = self.config.get(name)
        return v if _is_int(v) else None

    def key_alias(self) -> dict[str, str]:
        if self._key_alias is None:
            out: dict[str, str] = {}
            declared = [(a, d) for a, d in self.dims.items()]
            declared += [
                (a, v) for a, v in getattr(self.obj, "__dict__", {}).items() if a not in self.foreign
            ]
            for alias, d in declared:
                if isinstance(d, str) and re.fullmatch(r"[A-Za-z_]\w*", d):
                    d = Sym(d)
                if (
                    isinstance(d, Sym)
                    and d.name != alias
                    and self.int_key(alias) is None
                    and self.int_key(d.name) is not None
                ):
                    out.setdefault(d.name, alias)
            for alias, (keys, _) in CONVENTIONAL.items():
                if alias in self.dims or self.int_key(alias) is not None or alias in out.values():
                    continue
                key = next((k for k in keys if self.int_key(k) is not None), None)
                if key is not None:
                    out.setdefault(key, alias)
            self._key_alias = out
        return self._key_alias

    def _definition(self, name: str) -> tuple[str, Any] | None:
        if name in self.dims:
            d = self.dims[name]
            return ("int", d) if _is_int(d) else ("expr", parse_dim(d))
        v = self._attr(name)
        if _is_int(v):
            return ("int", v)
        if isinstance(v, DimExpr) and v != Sym(name):
            return ("expr", v)
        if self.int_key(name) is not None:
            return ("int", self.int_key(name))
        if name in CONVENTIONAL:
            keys, fallback = CONVENTIONAL[name]
            key = next((k for k in keys if self.int_key(k) is not None), None)
            if key is not None:
                return ("expr", Sym(key))
            if fallback is not None and all(
                self.try_resolve(s) is not None for s in parse_dim(fallback).free_symbols()
            ):
                return ("base", parse_dim(fallback))
        if name in DERIVED:
            return ("expr", parse_dim(DERIVED[name]))
        return None

    def try_resolve(self, name: str) -> DimExpr | None:
        if name in _FIXED:
            return Sym(name)
        if name in self._memo:
            found = self._memo[name]
            if found is None and name in self._resolving:
                raise error(
                    "E002", f"dimension {name!r} is defined in terms of itself", _DIM_HINT.format(name)
                )
            return found
        self._memo[name] = None
        self._resolving.add(name)
        try:
            d = self._definition(name)
            if d is None:
                out = None
            elif d[0] == "int":
                canonical = self.key_alias().get(name, name)
                if canonical != name:
                    self.extra[canonical] = d[1]
                elif name not in self.config:
                    self.extra[name] = d[1]
                out = Sym(canonical)
            elif d[0] == "base":
                value = self.canon(d[1]).evaluate(self.bindings())
                self.extra[name] = value
                out = Sym(name)
            else:
                out = self.canon(d[1])
        finally:
            self._resolving.discard(name)
        self._memo[name] = out
        return out

    def resolve(self, name: str) -> DimExpr:
        out = self.try_resolve(name)
        if out is None:
            owner = type(self.obj).__name__
            raise error("E002", f"undefined dimension {name!r} in {owner}", _DIM_HINT.format(name))
        return out

    def canon(self, d: Any) -> DimExpr:
        """The IR form of a dim: a string such as ``"D // 2"``, an int, a ``Dim`` or a ``DimExpr``."""
        try:
            e = parse_dim(d)
        except DimError as exc:
            raise error("E008", f"bad dimension {d!r}: {exc.message}", exc.hint) from None
        return e.substitute(self.resolve)

    def bindings(self) -> dict[str, int]:
        out = {k: v for k, v in self.config.items() if _is_int(v)}
        out.update(
            {k: v for k, v in getattr(self.obj, "__dict__", {}).items() if _is_int(v) and k not in out}
        )
        out.update(self.extra)
        return out

    def value(self, d: Any) -> int:
        return self.canon(d).evaluate(self.bindings())

    def origin_key(self, symbol: str) -> str | None:
        for key, alias in self.key_alias().items():
            if alias == symbol:
                return key
        return symbol if self.int_key(symbol) is not None else None

    def lookup(self, name: str) -> Any:
        """The value of a config name for conditions: an attribute, a config entry or a dimension."""
        obj_dict = getattr(self.obj, "__dict__", {})
        if name in obj_dict and not isinstance(obj_dict[name], DimExpr):
            return obj_dict[name]
        if name in self.config:
            return self.config[name]
        if name == "true":  # True and False are the condition language's own literals
            return True
        if name in ("false", "None"):
            return False
        if self.try_resolve(name) is not None:
            return self.value(name)
        raise KeyError(name)


def translate(expr: DimExpr, sub: Scope, caller: Scope) -> DimExpr:
    """Rewrite a dim of ``sub`` (a submodule or block) in ``caller``'s symbols, matching by value."""

    def one(s: str) -> DimExpr:
        if s in _FIXED:
            return Sym(s)
        v = sub.value(Sym(s))
        key = sub.origin_key(s)
        if key is not None and key in sub.foreign:
            return caller.canon(sub.foreign[key])
        for name in (s, key):
            if name is not None:
                found = caller.try_resolve(name)
                if found is not None and found.evaluate(caller.bindings()) == v:
                    return found
        for name in [*caller.config, *CONVENTIONAL]:
            if caller.int_key(name) is not None or name in CONVENTIONAL:
                found = caller.try_resolve(name)
                if found is not None and found.evaluate(caller.bindings()) == v:
                    return found
        return Const(v)

    return expr.substitute(one)


# --- conditions and constraints ------------------------------------------------------------------


def check_condition(text: str, scope: Scope) -> bool:
    """Evaluate a condition string against a module's config (DSLError E026 if it is malformed)."""
    try:
        condition = parse_condition(text)
    except ConditionError as exc:
        raise error(
            "E026",
            exc.message,
            "conditions use config names, integers, + - * // %, comparisons and and/or/not",
        ) from None
    try:
        return condition.evaluate(scope.lookup)
    except ConditionError as exc:
        hint = (
            "use a constructor argument, an attribute set in __init__ or a dimension"
            if exc.name is not None
            else "conditions compare integer config values and dimensions"
        )
        raise error("E026", exc.message, hint) from None
    except DimError as exc:  # a dimension the scope cannot evaluate
        raise error(
            "E026",
            f"condition {text!r} cannot be evaluated: {exc.message}",
            "conditions compare integer config values and dimensions",
        ) from None
