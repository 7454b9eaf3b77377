"""Syntax tree to kiln IR: each ``module``/``block``/``model`` declaration becomes a kiln-dsl class, so
the text and the Python DSL share one compiler (names, dimensions, inlining, HF mappings, annotations)
and give the same IR. A class name resolves to the file's declarations, then its imports, then the
text standard library (``std/``), then kiln-dsl's registered classes; an op in a graph is a graph
builder method or an op of kiln's registry. The graph statements run through kiln-dsl's builder while
the class compiles, and every op they emit points at its line of text."""

from __future__ import annotations

import ast
import inspect
import math
import operator
import re
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from lark import Token, Tree

from kiln.core import Diagnostic, KilnError, op_registry
from kiln.core.ir import DTYPES
from kiln.dsl_text import _mamba
from kiln.dsl_text._errors import TextError
from kiln.dsl_text._parser import parse

__all__ = ["Program", "load_program"]

#: a tensor without a dtype: kiln computes in fp32 (token ids say int32)
DEFAULT_DTYPE = "fp32"
_TYPES: dict[str, type] = {"int": int, "float": float, "bool": bool, "string": str, "str": str}
_INTRINSICS: dict[str, Callable[..., Any]] = {
    "sqrt": math.sqrt,
    "ceil_div": lambda a, b: -(-a // b),
    "min": min,
    "max": max,
    "abs": abs,
}
_BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "/": operator.truediv,
    "//": operator.floordiv,
    "%": operator.mod,
}
_COMPARE: dict[str, Callable[[Any, Any], Any]] = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    ">": operator.gt,
    "<=": operator.le,
    ">=": operator.ge,
}
#: seed 004 Appendix B annotation names, for a kiln-dsl without annotations (kept as ``_<name>`` attrs)
_ANNOTATIONS = {
    "memory",
    "hook",
    "adapter",
    "dtype",
    "precision",
    "fuse",
    "nofuse",
    "shard",
    "checkpoint",
    "frozen",
}
#: builder methods that are plumbing, not ops
_NOT_OPS = {"call", "custom", "input", "output", "save", "saved", "mark_recompute", "declare", "dim", "lift"}
_SUFFIXES = (".kiln", ".module")
#: seed 004's Mamba primitives and the helpers of its §11.3 block (``_mamba``: the function of each)
_SEED_MAMBA = {
    "mamba_conv1d": "conv1d",
    "mamba_selective_scan": "selective_scan",
    "mamba_split_proj": "split_proj",
    "mamba_split_conv": "split_conv",
    "exp_neg": "exp_neg",
    "group_rmsnorm": "group_rmsnorm",
}
#: builder arguments that are dimensions: a dimension expression is passed symbolically
_DIM_ARGS = {"Hq", "Hkv", "D", "head_dim", "rotary_dim", "num_experts"}


class _Src:
    """One source file: its path and text, for locations and carets."""

    def __init__(self, path: str, text: str) -> None:
        self.path, self.text = path, text

    def error(self, code: str, message: str, at: Any, hint: str | None = None) -> TextError:
        line, column = _pos(at)
        return TextError(code, message, self.path, self.text, line, column, hint)

    def span(self, node: Any) -> str:
        if isinstance(node, Token):
            return str(node)
        meta = node.meta
        return " ".join(self.text[meta.start_pos : meta.end_pos].split())

    def loc(self, at: Any) -> str:
        return f"{self.path}:{_pos(at)[0]}"


def _string(src: _Src, tok: Token) -> str:
    """The value of a string or docstring literal (Python's escapes)."""
    try:
        value = ast.literal_eval(str(tok))
    except (SyntaxError, ValueError) as exc:
        raise src.error("E001", f"invalid string literal: {exc.args[0] if exc.args else exc}", tok) from None
    return str(value)


def _pos(at: Any) -> tuple[int, int]:
    if isinstance(at, Token):
        return at.line or 1, at.column or 1
    if isinstance(at, Tree) and not at.meta.empty:
        return at.meta.line, at.meta.column
    if isinstance(at, Tree):
        for child in at.children:
            if isinstance(child, (Token, Tree)):
                found = _pos(child)
                if found != (1, 1):
                    return found
    return 1, 1


def _names(node: Any) -> list[Token]:
    """The dotted name of a ``ref`` tree (``ln1.weight``)."""
    out = []
    for child in node.children:
        out.append(child.children[0] if isinstance(child, Tree) else child)
    return out


def _walk_refs(node: Any) -> Iterator[Tree[Token]]:
    if isinstance(node, Tree):
        if node.data == "ref":
            yield node
            return
        if node.data == "call":
            for child in node.children[1:]:
                yield from _walk_refs(child)
            return
        for child in node.children:
            yield from _walk_refs(child)


class _Env:
    """Compile-time values of one declaration: its parameters and let-bindings."""

    def __init__(self, src: _Src, values: dict[str, Any]) -> None:
        self.src, self.values = src, values

    def value(self, node: Any, *, names: Callable[[str, Token], Any] | None = None) -> Any:
        """Evaluate a constant expression; ``names`` resolves a name that is not a value."""
        try:
            return self._eval(node, names)
        except TextError:
            raise
        except (ArithmeticError, TypeError, ValueError) as exc:
            raise self.src.error("E003", f"cannot evaluate {self.src.span(node)!r}: {exc}", node) from None

    def _eval(self, n: Any, names: Callable[[str, Token], Any] | None) -> Any:
        ev = lambda c: self._eval(c, names)  # noqa: E731
        kind = n.data
        ch = n.children
        if kind == "int_":
            return int(ch[0])
        if kind == "float_":
            return float(ch[0])
        if kind == "string":
            return _string(self.src, ch[0])
        if kind in ("true", "false", "none"):
            return {"true": True, "false": False, "none": None}[kind]
        if kind == "ref":
            parts = _names(n)
            text = ".".join(map(str, parts))
            if len(parts) == 1 and text in self.values:
                return self.values[text]
            if names is not None:
                return names(text, parts[0])
            raise self.src.error(
                "E002",
                f"undefined name {text!r}",
                parts[0],
                "a constant names a parameter of the declaration or a let-binding",
            )
        if kind == "binary":
            return _BINARY[str(ch[1].children[0])](ev(ch[0]), ev(ch[2]))
        if kind == "compare":
            return _COMPARE[str(ch[1].children[0])](ev(ch[0]), ev(ch[2]))
        if kind == "and_":
            return ev(ch[0]) and ev(ch[1])
        if kind == "or_":
            return ev(ch[0]) or ev(ch[1])
        if kind == "not_":
            return not ev(ch[0])
        if kind == "neg":
            return -ev(ch[0])
        if kind == "pow":
            base, exp = ev(ch[0]), ev(ch[1])
            if abs(exp) > 64:
                raise ValueError("exponent too large")
            return base**exp
        if kind == "ternary":
            return ev(ch[0]) if ev(ch[1]) else ev(ch[2])
        if kind == "list_":
            return [ev(c) for c in ch]
        if kind == "call":
            name = ".".join(map(str, _names(ch[0])))
            if name not in _INTRINSICS:
                raise self.src.error(
                    "E014",
                    f"{name!r} is not a compile-time function",
                    ch[0],
                    f"constants may call {', '.join(sorted(_INTRINSICS))}",
                )
            args = [a for a in ch[1:]]
            if any(len(a.children) != 1 for a in args):
                raise self.src.error("E003", f"{name}() takes no keyword arguments", ch[0])
            return _INTRINSICS[name](*(ev(a.children[0]) for a in args))
        raise self.src.error("E003", f"{self.src.span(n)!r} is not a constant expression", n)


class _Decl:
    """One parsed declaration: its kind, name, constructor parameters and sections."""

    def __init__(self, src: _Src, tree: Tree[Token]) -> None:
        self.src, self.tree = src, tree
        kind_tokens = [str(t) for t in tree.children[0].children]
        self.abstract = "abstract" in kind_tokens
        self.kind = kind_tokens[-1]
        self.name: Token = tree.children[1]
        rest = tree.children[2:]
        self.args: list[Tree[Token]] = [c for c in rest if isinstance(c, Tree) and c.data == "param"]
        self.extends = next((c for c in rest if isinstance(c, Token) and c.type == "NAME"), None)
        self.doc = next((_string(src, c) for c in rest if isinstance(c, Token) and c.type == "DOCSTRING"), "")
        self.sections: dict[str, Tree[Token]] = {}
        for c in rest:
            if isinstance(c, Tree) and c.data != "param":
                if c.data in self.sections:
                    raise src.error(
                        "E009",
                        f"{self.name} has two {c.data.removesuffix('_section')} sections",
                        c,
                        "merge them into one",
                    )
                self.sections[c.data] = c


class Program:
    """A compiled text file: its declarations as kiln-dsl classes, in order, and the warnings."""

    def __init__(
        self, path: str, classes: dict[str, type], warnings: list[KilnError], sources: dict[str, str]
    ) -> None:
        self.path, self.classes, self.warnings, self.sources = path, classes, warnings, sources
        self.mappings: dict[str, list[tuple[str, str]]] = {}

    def models(self) -> list[str]:
        """The names of the file's ``model`` declarations, in order."""
        from kiln.dsl import kind_of

        return [n for n, c in self.classes.items() if kind_of(c) == "model"]

    def entry(self, name: str | None = None) -> str:
        """``name``, checked, or the file's only model (or its only declaration)."""
        if name is None:
            models = self.models() or (list(self.classes) if len(self.classes) == 1 else [])
            if len(models) != 1:
                raise KilnError(
                    f"{self.path} declares {len(models)} models ({', '.join(models) or 'none'}): "
                    "name the one to compile",
                    code="E012",
                )
            name = models[0]
        if name not in self.classes:
            raise KilnError(
                f"{self.path} declares no {name!r}",
                code="E002",
                hint=f"it declares {', '.join(self.classes) or 'nothing'}",
            )
        return name

    def bundle(self, name: str | None = None, config: dict[str, Any] | None = None) -> Any:
        """The IR Bundle of declaration ``name`` (default: the file's only model)."""
        from kiln.dsl import build_bundle

        name = self.entry(name)
        found: list[Any] = []
        try:
            bundle = build_bundle(self.classes[name], dict(config or {}), warnings=found)
        except KilnError as exc:  # a diagnostic at a line of a text file gets its caret back
            for d in exc.diagnostics[:1]:
                located = self._at_text(d) or self._at_mapping(d)
                if located is not None:
                    raise located from None
            raise
        # kiln-dsl's warnings (W001-W005) join the file's, at their line of text where they have one
        seen = {str(w) for w in self.warnings}
        for d in found:
            warning = self._at_text(d) or KilnError(
                d.message, code=d.code, hint=d.hint, location=d.location, diagnostics=[d]
            )
            if str(warning) not in seen:
                seen.add(str(warning))
                self.warnings.append(warning)
        return bundle

    def _at_mapping(self, d: Any) -> TextError | None:
        """kiln-dsl's E010 of a text hf_mapping entry (which kiln-dsl places at the lowerer's line), at
        the entry its message names: ``Model.stack.param: ...`` or ``... 'param' ...``."""
        if d.code != "E010":
            return None
        decl = d.message.split(":", 1)[0].split(".", 1)[0]
        found = [
            (len(key), place)
            for key, place in self.mappings.get(decl, [])
            if d.message.startswith(f"{decl}.{key}:")
            or re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", d.message)
        ]
        if not found:
            return None
        place = max(found)[1]
        return self._at_text(Diagnostic(d.code, d.message, d.hint, place))

    def _at_text(self, d: Any) -> TextError | None:
        """Diagnostic ``d`` as a TextError with its caret, when it points at a line of a text file."""
        path, _, rest = (d.location or "").rpartition(":")
        path, _, line = path.rpartition(":") if rest.isdigit() and ":" in path else (path, "", rest)
        if path in self.sources and line.isdigit():
            lines = self.sources[path].splitlines()
            text_line = lines[int(line) - 1] if 0 < int(line) <= len(lines) else ""
            # without a column: the statement's first character
            indent = len(text_line) - len(text_line.lstrip())
            col = int(rest) if rest.isdigit() and line != rest else indent + 1
            code = d.code or "E003"
            return TextError(code, d.message, path, self.sources[path], int(line), col, d.hint)
        return None


def load_program(path: str | Path, text: str | None = None) -> Program:
    """Parse and lower a text-DSL file (``text`` instead of reading ``path``)."""
    path = str(path)
    if text is None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise KilnError(f"cannot read {path}: {exc}", code="E001") from None
    return _Loader().load(path, text)


class _Loader:
    def __init__(self) -> None:
        self.warnings: list[KilnError] = []
        self.loading: list[str] = []
        self.done: dict[str, dict[str, type]] = {}
        self.sources: dict[str, str] = {}
        self.aliases: dict[str, dict[str, Any]] = {}  # per file: the names its imports bind
        # per declaration: its hf_mapping entries (``param`` or ``stack.param``) and their places
        self.mappings: dict[str, list[tuple[str, str]]] = {}

    def load(self, path: str, text: str) -> Program:
        program = Program(path, self.file(path, text), self.warnings, self.sources)
        program.mappings = self.mappings
        return program

    def file(self, path: str, text: str) -> dict[str, type]:
        src = _Src(path, text)
        self.sources[path] = text
        tree = parse(text, path)
        names: dict[str, tuple[Any, Any]] = {}  # name -> (class, where it came from)
        decls = [c for c in tree.children if isinstance(c, Tree) and c.data == "decl"]
        local = {}
        for d in decls:
            decl = _Decl(src, d)
            if str(decl.name) in local:
                raise src.error("E009", f"{decl.name} is declared twice", decl.name)
            local[str(decl.name)] = decl
        for imp in (
            c
            for c in tree.children
            if (isinstance(c, Tree) and c.data.endswith("import"))
            or (isinstance(c, Tree) and c.data == "import_names")
        ):
            for name, cls, at in self.imports(src, imp):
                if name in local:
                    raise src.error(
                        "E024",
                        f"import {name!r} shadows the declaration of {name} in this file",
                        at,
                        "import it under another name: import ... as Other",
                    )
                if name in names and names[name][0] is not cls:
                    raise src.error(
                        "E023",
                        f"two imports bind the name {name!r}",
                        at,
                        "give one of them another name with `as`",
                    )
                names[name] = (cls, at)
        self.aliases[path] = {k: v[0] for k, v in names.items()}
        classes: dict[str, type] = {}
        for decl in local.values():
            classes[str(decl.name)] = _Lowering(self, decl, names, classes).build()
        return classes

    def imports(self, src: _Src, imp: Tree[Token]) -> Iterator[tuple[str, Any, Token]]:
        path = [c for c in imp.children if isinstance(c, Token)]
        trees = {c.data: c for c in imp.children if isinstance(c, Tree)}
        if imp.data == "from_import":
            for item in imp.children:
                if isinstance(item, Tree):
                    name, *alias = item.children
                    bound = alias[0].children[0] if alias else name
                    yield str(bound), self.resolve(src, path, name), name
            return
        if "braced" in trees:
            if "alias" in trees:
                raise src.error(
                    "E001",
                    "`import a.{B, C}` cannot take `as`",
                    trees["alias"].children[0],
                    "import each name with its own `as`",
                )
            for name in trees["braced"].children:
                yield str(name), self.resolve(src, path, name), name
            return
        words = [str(t) for t in path]
        if len(words) > 1 and re.fullmatch(r"v\d+", words[-1]) and words[0] in ("std", "primitives"):
            if words[-1] != "v1":  # seed 004 §4.7: versioned imports; kiln's library is version 1
                raise src.error(
                    "E002",
                    f"{'.'.join(words[:-1])} has version v1 only, not {words[-1]}",
                    path[-1],
                    f"import {'.'.join(words[:-1])}.v1 (or leave the version out)",
                )
            path, words = path[:-1], words[:-1]
        if words[0] == "primitives" or words[:2] in (["std"], ["std", "primitives"]):
            return  # ops are always visible, and so is the standard library
        *parent, last = path
        if not parent:
            raise src.error(
                "E002", f"import {last}: name what to import from a module (std.modules.Linear)", last
            )
        alias = trees["alias"].children[0] if "alias" in trees else last
        yield str(alias), self.resolve(src, parent, last), last

    def resolve(self, src: _Src, path: list[Token], at: Token) -> Any:
        """A class by module path and name: the standard library for ``std.*`` (text, then kiln-dsl's),
        else a text file beside ``src`` (``models.qwen`` is ``models/qwen.kiln``), else a Python module."""
        parts, name = [str(p) for p in path], str(at)
        if parts and parts[0] == "std":
            found = self.std(parts[1:]).get(str(name)) or _dsl_class(str(name))
            if found is None:
                known = sorted({*self.std_names(), *_dsl_names()})
                raise src.error(
                    "E002", f"the standard library has no {name!r}", at, f"it has {', '.join(known)}"
                )
            return found
        base = Path(src.path).parent
        for suffix in _SUFFIXES:
            file = base.joinpath(*parts).with_suffix(suffix)
            if file.is_file():
                key = str(file.resolve())
                if key in self.loading:
                    raise src.error(
                        "E007",
                        f"{'.'.join(parts)} imports itself (through {' -> '.join(self.loading)})",
                        path[0],
                    )
                if key not in self.done:
                    self.loading.append(key)
                    try:
                        self.done[key] = self.file(str(file), file.read_text(encoding="utf-8"))
                    finally:
                        self.loading.pop()
                if str(name) not in self.done[key]:
                    raise src.error(
                        "E002",
                        f"{file.name} declares no {name!r}",
                        at,
                        f"it declares {', '.join(self.done[key]) or 'nothing'}",
                    )
                return self.done[key][str(name)]
        found = _python_class(parts, str(name))
        if found is not None:
            return found
        raise src.error(
            "E002",
            f"no module {'.'.join(parts)!r}: neither std.*, a file "
            f"{'/'.join(parts)}.kiln beside {Path(src.path).name} nor a Python module",
            path[0],
        )

    def std(self, parts: list[str]) -> dict[str, type]:
        """The declarations of the text standard library file ``std/<parts>.kiln`` ({} if none)."""
        base = Path(str(resources.files("kiln.dsl_text").joinpath("std")))
        file = base.joinpath(*parts).with_suffix(".kiln") if parts else None
        if file is None or not file.is_file():
            return {}
        key = str(file.resolve())
        if key not in self.done:
            if key in self.loading:
                return {}
            self.loading.append(key)
            try:
                self.done[key] = self.file(str(file), file.read_text(encoding="utf-8"))
            finally:
                self.loading.pop()
        return self.done[key]

    def std_names(self) -> dict[str, type]:
        """Every declaration of the text standard library: visible without an import (seed 004 §11.1)."""
        base = Path(str(resources.files("kiln.dsl_text").joinpath("std")))
        out: dict[str, type] = {}
        for file in sorted(base.rglob("*.kiln")):
            out.update(self.std(list(file.relative_to(base).with_suffix("").parts)))
            out.update(self.aliases.get(str(file), {}))  # std/blocks.kiln: GQA as CausalSelfAttention
        return out


def _bare(text: str, at: Token) -> str:
    """A name that is no constant, as an annotation argument: a word (``AfterAttention``, ``fp32``)."""
    return text


def _seed_annotation(src: _Src, env: _Env, a: Tree[Token], on: str) -> Any:
    """Seed 004 §7 annotation ``@name(args)`` as kiln-dsl makes it (E008 when unknown or malformed);
    None when kiln-dsl has no annotations (it is kept on the op instead)."""
    try:
        from kiln.dsl.annotations import BY_NAME
    except ImportError:  # a kiln-dsl without annotations
        BY_NAME = None
    name = str(a.children[1])
    known = set(BY_NAME) if BY_NAME is not None else _ANNOTATIONS
    if name not in known:
        extra = "@tied_to, @init, @role and " if on == "param" else ""
        raise src.error(
            "E008",
            f"unknown annotation @{name}",
            a.children[1],
            f"{on}s take {extra}{', '.join('@' + k for k in sorted(known))}",
        )
    if BY_NAME is None:
        return None
    args = [env.value(x.children[0], names=_bare) for x in a.children[2:] if len(x.children) == 1]
    kwargs = {
        str(x.children[0]): env.value(x.children[1], names=_bare)
        for x in a.children[2:]
        if len(x.children) == 2
    }
    try:
        return BY_NAME[name].make(tuple(args), kwargs, src.loc(a))
    except KilnError as exc:
        raise src.error(exc.code or "E008", exc.message, a, exc.hint) from None


def _python_class(parts: list[str], name: str) -> Any:
    """``import kiln.dsl.stdlib.blocks.DenseTransformerBlock``: a kiln-dsl class of a Python module."""
    import importlib

    from kiln.dsl import is_component

    try:
        module = importlib.import_module(".".join(parts))
    except Exception:  # not a Python module (or one that fails): the caller reports the import
        return None
    found = getattr(module, name, None)
    return found if isinstance(found, type) and is_component(found) else None


def _dsl_class(name: str) -> Any:
    from kiln.dsl import lookup_component

    return lookup_component(name)


def _dsl_names() -> list[str]:
    from kiln.dsl import list_registered_blocks, list_registered_modules

    return sorted({*list_registered_blocks(), *list_registered_modules()})


class _Lowering:
    """One declaration as a kiln-dsl class."""

    def __init__(
        self, loader: _Loader, decl: _Decl, imported: dict[str, tuple[Any, Any]], local: dict[str, type]
    ) -> None:
        self.loader, self.decl, self.src = loader, decl, decl.src
        self.imported, self.local = imported, local

    def lookup_class(self, name: str) -> Any:
        if name in self.local:
            return self.local[name]
        if name in self.imported:
            return self.imported[name][0]
        return self.loader.std_names().get(name) or _dsl_class(name)

    # -- the class
    def build(self) -> type:
        from kiln.dsl import block, hf_config, hf_mapping, local_definitions, model, module

        d = self.decl
        if d.extends is not None:
            raise self.src.error(
                "E011",
                f"{d.name} extends {d.extends}: inheritance is not supported by the text syntax yet",
                d.extends,
                "declare the parameters in this declaration",
            )
        ctor = self.ctor_params()
        lets, constraints = self.lets()
        ns: dict[str, Any] = {
            "__doc__": d.doc,
            "__module__": "kiln.dsl_text.user",
            "_dims_": {},
            "_constraints_": tuple(constraints),
        }
        self.params(ns, ctor, lets)
        ns["__init__"] = self.init(ctor, lets)
        if "forward_section" in d.sections and not d.abstract:
            ns["forward"] = self.forward(d.sections["forward_section"])
        elif d.kind == "module":  # a parameter group (RMSNormParams, ExpertMLP): its owner declares them
            ns["_text_group_"] = (
                [(str(n), v) for n, _, _, v in ctor],
                {k: v for k, v in ns.items() if k in self.param_names},
            )
        if "backward_section" in d.sections:
            self.loader.warnings.append(
                self.src.error(
                    "W003",
                    f"{d.name}: the explicit backward section is not used; kiln derives the backward "
                    "graph and checks it",
                    d.sections["backward_section"],
                )
            )
        cls = type(str(d.name), (), ns)
        if "hf_config_section" in d.sections:
            cls = hf_config(**self.hf_config(d.sections["hf_config_section"]))(cls)
        if "hf_mapping_section" in d.sections:
            flat, indexed = self.hf_mappings(d.sections["hf_mapping_section"])
            cls = hf_mapping(**flat)(cls)
            for (stack, var), mappings in indexed.items():
                cls = hf_mapping.indexed(stack, "{" + var + "}", **mappings)(cls)
        register = {"module": module, "block": block, "model": model}[d.kind]
        with local_definitions(str(d.name)):  # the registry is global: the file's classes stay the file's
            cls = register(cls)
        if d.abstract:
            from kiln.dsl import abstract

            cls = abstract(cls)
        return cls

    def ctor_params(self) -> list[tuple[Token, type | None, bool, Any]]:
        out, seen = [], set()
        empty = _Env(self.src, {})
        for p in self.decl.args:
            name, ptype, *default = p.children
            if str(name) in seen:
                raise self.src.error("E009", f"{self.decl.name} has two parameters named {name}", name)
            seen.add(str(name))
            optional = isinstance(ptype, Tree) and ptype.data == "optional"
            base = ptype.children[0] if optional else ptype
            if not (
                isinstance(base, Tree)
                and base.data == "type_call"
                and len(base.children) == 1
                and str(base.children[0]) in _TYPES
            ):
                raise self.src.error(
                    "E003",
                    f"parameter {name}: expected int, float, bool or string, found {self.src.span(ptype)!r}",
                    ptype,
                )
            value = empty.value(default[0]) if default else inspect.Parameter.empty
            if not default and any(d is not inspect.Parameter.empty for *_, d in out):
                raise self.src.error(
                    "E012",
                    f"parameter {name} needs a default: it follows parameters that have one",
                    name,
                    f"write {name}: ... = value, or move it before them",
                )
            out.append((name, _TYPES[str(base.children[0])], optional, value))
        return out

    def lets(self) -> tuple[list[tuple[Token, Tree[Token]]], list[tuple[str, str, str]]]:
        section = self.decl.sections.get("let_section")
        if section is None:
            return [], []
        lets, constraints = [], []
        for item in section.children:
            if item.data == "let_binding":
                lets.append((item.children[0], item.children[1]))
            else:
                for c in item.children:
                    line, col = _pos(c.children[0])
                    constraints.append((
                        self.src.span(c.children[0]),
                        _string(self.src, c.children[1]),
                        f"{self.src.path}:{line}:{col}",  # where kiln-dsl's E026 / E027 point
                    ))
        return lets, constraints

    def init(
        self, ctor: list[tuple[Token, type | None, bool, Any]], lets: list[tuple[Token, Any]]
    ) -> Callable[..., None]:
        src, decl = self.src, self.decl
        sig_params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        for name, ptype, optional, default in ctor:
            ann: Any = ptype | None if optional else ptype
            sig_params.append(
                inspect.Parameter(
                    str(name), inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=ann
                )
            )
        signature = inspect.Signature(sig_params)
        submodules = self.submodules
        lowering, bindings = self, getattr(self, "block_bindings", [])
        count_lets = self.count_lets

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            values = dict(list(bound.arguments.items())[1:])
            self.__dict__.update(values)
            env = _Env(src, dict(values))
            for name, expr in lets:
                if str(name) in env.values:
                    raise src.error("E017", f"{name} is bound twice", name)
                env.values[str(name)] = env.value(expr)
                value = env.values[str(name)]
                if not isinstance(value, int) or isinstance(value, bool) or str(name) in count_lets:
                    self.__dict__[str(name)] = value
            self.__dict__["_text_env"] = env
            for attr, make in submodules.items():
                self.__dict__[attr] = make(self, env)
            lowering.check_block_bindings(self, env, bindings)  # before kiln-dsl builds the stacks

        __init__.__signature__ = signature  # type: ignore[attr-defined]
        __init__.__qualname__ = f"{decl.name}.__init__"
        return __init__

    # -- parameters
    submodules: dict[str, Callable[[Any, _Env], Any]]

    def params(self, ns: dict[str, Any], ctor: list[Any], lets: list[tuple[Token, Any]]) -> None:
        from kiln.dsl import Array, Param, Tensor, tied_to

        self.submodules = {}
        self.count_lets: set[str] = set()
        self.array_elements: dict[str, Any] = {}
        self.groups: set[str] = set()  # parameter groups (ln1: RMSNormParams(...)): name.param
        self.param_names: set[str] = set()
        self.decl_values = {str(n) for n, *_ in ctor} | {str(n) for n, _ in lets}
        ints = {str(n) for n, t, _, _ in ctor if t is int}
        dims = {str(n) for n, _ in lets}
        ns["_dims_"] = {str(n): self.src.span(e) for n, e in lets if self._is_dim_expr(e, ints | dims)}
        self.known_dims = ints | set(ns["_dims_"]) | {"B", "T"}
        section = self.decl.sections.get("params_section")
        declared: dict[str, Any] = {}
        for p in section.children if section is not None else ():
            name, ptype, *rest = p.children
            if str(name) in declared or str(name) in {str(n) for n, *_ in ctor}:
                raise self.src.error("E009", f"{self.decl.name} declares {name} twice", name)
            cond = next((c for c in rest if not (isinstance(c, Tree) and c.data == "annotation")), None)
            annotations = [c for c in rest if isinstance(c, Tree) and c.data == "annotation"]
            when = self.src.span(cond) if cond is not None else None
            if cond is not None:
                self.check_names(cond, self.decl_values, "condition")
            optional = isinstance(ptype, Tree) and ptype.data == "optional"
            base = ptype.children[0] if optional else ptype
            if (
                base.data == "bracket_type"
                and len(base.children) == 2
                and isinstance(base.children[1], Tree)
                and base.children[1].data == "type_call"
            ) or (base.data == "bracket_type" and isinstance(base.children[-1], Token)):
                count, element = base.children[0], base.children[-1]
                self.check_names(count, self.known_dims | dims, "layer count")
                if self.src.span(count) in dims:  # a let-bound layer count: the model's config has it
                    self.count_lets.add(self.src.span(count))
                if self.group_of(element) is not None:  # [E] x ExpertMLP(...): stacked weights
                    self.groups.add(str(name))
                    for pname, param in self.group_params(str(name), element, self.src.span(count)):
                        param.loc = "{}:{}:{}".format(self.src.path, *_pos(name))
                        declared[pname] = param
                        self.param_names.add(pname)
                        ns[pname] = param
                    continue
                ecls = self.block_class(element)
                self.array_elements[str(name)] = ecls
                param = Param(Array[self.src.span(count), ecls], when=when)
                self.bind_block_args(ecls, element)
            elif base.data == "bracket_type":
                param = Param(self.tensor_type(base, optional), when=when)
            elif base.data == "type_call" and str(base.children[0]) == "tied_to":
                target = self.tied_target(base)
                if target not in declared or not isinstance(declared[target].type, type(Tensor["x"])):
                    raise self.src.error(
                        "E002",
                        f"{name} is tied to {target!r}, which is not a tensor parameter declared above it",
                        base,
                    )
                param = Param(declared[target].type, when=when)
                param.tied = tied_to(target)
            elif base.data == "type_call" and self.group_of(base) is not None:
                self.groups.add(str(name))
                for pname, param in self.group_params(str(name), base, None):
                    param.loc = "{}:{}:{}".format(self.src.path, *_pos(name))
                    declared[pname] = param
                    self.param_names.add(pname)
                    ns[pname] = param
                continue
            elif base.data == "type_call":
                self.submodule(str(name), base)
                continue
            else:
                raise self.src.error(
                    "E003",
                    f"parameter {name}: expected a tensor type [dims..., dtype], a "
                    f"stack [n] x Block(...) or a module, found {self.src.span(ptype)!r}",
                    ptype,
                )
            line, col = _pos(name)
            param.loc = f"{self.src.path}:{line}:{col}"  # kiln-dsl's diagnostics of it point here
            for a in annotations:
                self.param_annotation(param, a, declared)
            declared[str(name)] = param
            self.param_names.add(str(name))
            ns[str(name)] = param
        for n in self.count_lets:  # a constant layer count: a config value, as in kiln-dsl
            ns["_dims_"].pop(n, None)

    def group_of(self, call: Tree[Token]) -> Any:
        cls = self.lookup_class(str(call.children[0]))
        return getattr(cls, "__dict__", {}).get("_text_group_")

    def group_params(self, name: str, call: Tree[Token], count: str | None) -> list[tuple[str, Any]]:
        """The parameters of a group declared by ``name: Group(args)`` (or ``name: [n] x Group(args)``):
        ``name.weight``, their dimensions in the owner's names (and ``n`` first)."""
        import re

        from kiln.dsl import Param, Tensor

        ctor, params = self.group_of(call)
        args = call.children[1:]
        pos = [a.children[0] for a in args if len(a.children) == 1]
        kw = {str(a.children[0]): a.children[1] for a in args if len(a.children) == 2}
        if len(pos) > len(ctor):
            raise self.src.error(
                "E003", f"{call.children[0]} takes {len(ctor)} arguments, found {len(pos)}", call
            )
        values: dict[str, str] = {}
        for (pname, default), expr in zip(ctor, pos + [None] * len(ctor), strict=False):
            if pname in kw:
                expr = kw.pop(pname)
            if expr is not None:
                self.check_names(expr, self.known_dims | set(self.decl_values), "argument")
                values[pname] = f"({self.src.span(expr)})"
            elif default is inspect.Parameter.empty:
                raise self.src.error("E012", f"{call.children[0]} needs {pname}", call)
            else:
                values[pname] = repr(default).lower() if isinstance(default, bool) else repr(default)
        if kw:
            raise self.src.error("E002", f"{call.children[0]} has no parameter {next(iter(kw))!r}", call)

        def sub(text: Any) -> Any:
            if not isinstance(text, str):
                return text
            return re.sub(r"\b[A-Za-z_][A-Za-z0-9_]*\b", lambda m: values.get(m[0], m[0]), text)

        out = []
        for pname, p in params.items():
            dims = [sub(d) for d in p.type.dims]
            if count is not None:
                dims = [count, *dims]
            ann = Tensor[(*dims, p.type.dtype)]
            when = sub(p.when) if isinstance(p.when, str) else p.when
            out.append((f"{name}.{pname}", Param(ann, when=when, init=p.init, role=p.role)))
        return out

    def _is_dim_expr(self, expr: Any, ints: set[str]) -> bool:
        if isinstance(expr, Tree):
            if expr.data in (
                "float_",
                "string",
                "true",
                "false",
                "none",
                "call",
                "list_",
                "compare",
                "and_",
                "or_",
                "not_",
                "ternary",
            ):
                return False
            if expr.data == "binary" and str(expr.children[1].children[0]) == "/":
                return False
            if expr.data == "ref":
                return ".".join(map(str, _names(expr))) in ints
            return all(
                self._is_dim_expr(c, ints)
                for c in expr.children
                if isinstance(c, Tree) and c.data not in ("add_op", "mul_op")
            )
        return False

    def check_names(self, expr: Any, known: set[str], what: str) -> None:
        for ref in _walk_refs(expr):
            text = ".".join(map(str, _names(ref)))
            if text not in known:
                raise self.src.error(
                    "E002",
                    f"{what} {self.src.span(expr)!r}: undefined name {text!r}",
                    _names(ref)[0],
                    f"known here: {', '.join(sorted(known)) or 'none'}",
                )

    def tensor_type(self, t: Tree[Token], optional: bool = False, dtype: str = DEFAULT_DTYPE) -> Any:
        from kiln.dsl import Tensor

        items = list(t.children)
        if (
            items
            and isinstance(items[-1], Tree)
            and items[-1].data == "ref"
            and ".".join(map(str, _names(items[-1]))) in DTYPES
        ):
            dtype = str(_names(items.pop())[0])
        dims: list[Any] = []
        for it in items:
            if isinstance(it, Tree) and it.data == "star_dim":
                raise self.src.error(
                    "E004",
                    "a variadic dimension [*, ...] has no size in kiln's IR",
                    it,
                    "name the leading dimensions (B, T, ...)",
                )
            if isinstance(it, Tree) and it.data == "ref" and str(_names(it)[0]) in DTYPES:
                raise self.src.error("E003", f"the dtype {self.src.span(it)} must come last", it)
            self.check_names(it, self.known_dims, "dimension")
            if isinstance(it, Tree) and it.data == "int_":
                dims.append(int(it.children[0]))
            elif isinstance(it, Tree) and it.data in ("ref", "binary"):
                dims.append(self.src.span(it))
            else:
                raise self.src.error(
                    "E003", f"dimension {self.src.span(it)!r}: expected an integer expression", it
                )
        ann = Tensor[(*dims, dtype)]
        return ann | None if optional else ann

    def tied_target(self, call: Tree[Token]) -> str:
        args = call.children[1:]
        if len(args) != 1 or len(args[0].children) != 1 or args[0].children[0].data != "ref":
            raise self.src.error("E010", "tied_to takes the name of one parameter", call)
        return ".".join(map(str, _names(args[0].children[0])))

    def param_annotation(self, param: Any, a: Tree[Token], declared: dict[str, Any]) -> None:
        from kiln.dsl import tied_to

        name = str(a.children[1])
        args = a.children[2:]
        env = _Env(self.src, {})
        kw = {str(x.children[0]): x.children[1] for x in args if len(x.children) == 2}
        pos = [x.children[0] for x in args if len(x.children) == 1]
        if name == "tied_to":
            if len(pos) != 1 or pos[0].data != "ref" or str(_names(pos[0])[0]) not in declared:
                raise self.src.error("E010", "@tied_to names a parameter declared above", a)
            when = self.src.span(kw["when"]) if "when" in kw else None
            if "when" in kw:  # checked here, at its place in the text, as a parameter's `if` condition
                self.check_names(kw["when"], self.decl_values, "condition")
            param.tied = tied_to(str(_names(pos[0])[0]), when=when)
        elif name == "init":
            value = env.value(pos[0], names=lambda text, at: text) if pos else None
            param.init = {"kind": value, **{k: env.value(v) for k, v in kw.items()}} if kw else value
        elif name == "role":
            param.role = env.value(pos[0], names=lambda text, at: text) if pos else None
        else:
            ann = _seed_annotation(self.src, env, a, "param")
            if ann is not None:
                param.annotations = (*param.annotations, ann)
            elif name == "frozen":
                param.frozen = True

    def block_class(self, element: Tree[Token]) -> Any:
        name = element.children[0]
        cls = self.lookup_class(str(name))
        if cls is None:
            raise self.src.error(
                "E002",
                f"unknown block {name!r}",
                name,
                f"declare it in this file or import it; known: {', '.join(_dsl_names())}",
            )
        return cls

    def bind_block_args(self, cls: Any, element: Tree[Token]) -> None:
        """kiln-dsl passes a model's config to its blocks by name: a block argument must be the model's
        value of that name (checked when the model is built)."""
        args = element.children[1:]
        sig = inspect.signature(cls.__init__)
        params = [p for p in list(sig.parameters.values())[1:]]
        pos = [a.children[0] for a in args if len(a.children) == 1]
        kw = {str(a.children[0]): a for a in args if len(a.children) == 2}
        if len(pos) > len(params):
            raise self.src.error(
                "E003", f"{cls.__name__} takes {len(params)} arguments, found {len(pos)}", element
            )
        binding = {p.name: e for p, e in zip(params, pos, strict=False)}
        for k, a in kw.items():
            if k not in {p.name for p in params}:
                raise self.src.error(
                    "E002",
                    f"{cls.__name__} has no parameter {k!r}",
                    a.children[0],
                    f"it takes {', '.join(p.name for p in params)}",
                )
            binding[k] = a.children[1]
        self.block_bindings = [*getattr(self, "block_bindings", []), (cls, binding)]

    def submodule(self, name: str, call: Tree[Token]) -> None:
        cls = self.lookup_class(str(call.children[0]))
        if cls is None:
            raise self.src.error(
                "E002",
                f"unknown module {str(call.children[0])!r}",
                call.children[0],
                f"declare it in this file or import it; known: {', '.join(_dsl_names())}",
            )
        args = call.children[1:]

        def make(obj: Any, env: _Env) -> Any:
            pos = [env.value(a.children[0]) for a in args if len(a.children) == 1]
            kw = {str(a.children[0]): env.value(a.children[1]) for a in args if len(a.children) == 2}
            try:
                return cls(*pos, **kw)
            except TypeError as exc:
                raise self.src.error("E003", f"{name}: {exc}", call) from None

        self.submodules[name] = make

    # -- forward
    def forward(self, section: Tree[Token]) -> Callable[..., Any]:
        inputs: list[tuple[str, Any]] = []
        outputs: list[tuple[str, Any]] = []
        graph_body = None
        save: list[Tree[Token]] = []
        recompute: list[Tree[Token]] = []
        for item in section.children:
            if item.data == "inputs_block":
                inputs += [(str(d.children[0]), self.io_type(d.children[1], True)) for d in item.children]
            elif item.data == "outputs_block":
                outputs += [(str(d.children[0]), self.io_type(d.children[1])) for d in item.children]
            elif item.data == "in_decl":  # a model's `in` is its token ids (seed 004 §4.5)
                inputs.append(
                    (
                        "token_ids" if self.decl.kind == "model" else "in_",
                        self.io_type(item.children[0], True),
                    )
                )
            elif item.data == "out_decl":
                outputs.append(("out", self.io_type(item.children[0])))
            elif item.data == "graph_section":
                graph_body = item.children[0]
            elif item.data == "save_list":
                save.append(item.children[0])
            elif item.data == "recompute_list":
                recompute.append(item.children[0])
        if graph_body is None:
            raise self.src.error("E012", f"{self.decl.name}: the forward section has no graph", section)
        if not outputs:
            raise self.src.error(
                "E012",
                f"{self.decl.name}: the forward section declares no outputs",
                section,
                "add out: [dims...] or outputs:",
            )
        names = [n for n, _ in inputs]
        if any(item.data == "in_decl" for item in section.children):
            names[0] = "in"  # the graph's name for it (`in` is a Python keyword)
        for n, _ in inputs:
            if n in self.param_names:
                raise self.src.error("E009", f"input {n} has the name of a parameter", section)
        lowering = self

        def forward(obj: Any, *refs: Any) -> Any:
            from kiln.dsl import graph

            g = graph()
            env: _Env = obj._text_env
            tensors = dict(zip(names, refs, strict=True))
            _Graph(lowering, g, env, obj, tensors).body(graph_body)
            for lst, directive in ((save, g.save), (recompute, g.mark_recompute)):
                for node in lst:
                    found = lowering.expand_names(node, tensors)
                    if found:
                        directive(*found)
            outs = []
            for n, _ in outputs:
                if n not in tensors:
                    raise lowering.src.error(
                        "E002",
                        f"output {n!r} is not computed by the graph",
                        graph_body,
                        f"end a data flow with -> {n}",
                    )
                outs.append(tensors[n])
            return outs[0] if len(outs) == 1 else tuple(outs)

        sig = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        sig += [
            inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=t) for n, t in inputs
        ]
        ret = outputs[0][1] if len(outputs) == 1 else tuple[tuple(t for _, t in outputs)]  # type: ignore[misc]
        forward.__signature__ = inspect.Signature(sig, return_annotation=ret)  # type: ignore[attr-defined]
        forward.__annotations__ = {**{n: t for n, t in inputs}, "return": ret}
        forward.__qualname__ = f"{self.decl.name}.forward"
        from kiln.dsl import forward as mark

        return mark(forward, location=self.src.loc(section))  # kiln-dsl's diagnostics point at the text

    def io_type(self, t: Any, is_input: bool = False) -> Any:
        """A forward input or output type; a model's inputs are token ids, positions, segments and
        targets, so without a dtype they are int32 (seed 004 §4.5)."""
        optional = isinstance(t, Tree) and t.data == "optional"
        base = t.children[0] if optional else t
        if not (
            isinstance(base, Tree)
            and base.data == "bracket_type"
            and not (
                len(base.children) >= 2
                and isinstance(base.children[-1], Tree)
                and base.children[-1].data == "type_call"
            )
        ):
            raise self.src.error(
                "E003", f"expected a tensor type [dims..., dtype], found {self.src.span(t)!r}", t
            )
        default = "int32" if is_input and self.decl.kind == "model" else DEFAULT_DTYPE
        return self.tensor_type(base, optional, default)

    def check_block_bindings(self, obj: Any, env: _Env, bindings: list[tuple[Any, dict[str, Any]]]) -> None:
        for cls, binding in bindings:
            for pname, expr in binding.items():
                value = env.value(expr)
                have = obj.__dict__.get(pname, env.values.get(pname, inspect.Parameter.empty))
                if have is inspect.Parameter.empty or (pname not in obj.__dict__ and have == value):
                    obj.__dict__[pname] = value  # a let-binding too: kiln-dsl reads the model's attributes
                elif have != value or type(have) is not type(value):
                    raise self.src.error(
                        "E003",
                        f"{cls.__name__} argument {pname} = {value!r}, but {self.decl.name}'s {pname} is "
                        f"{have!r}: kiln gives a block the model's value of each name",
                        expr,
                        f"pass {pname} (the same value) or rename the model's parameter",
                    )

    def expand_names(self, node: Tree[Token], tensors: dict[str, Any]) -> list[Any]:
        import fnmatch

        out = []
        for pat in node.children:
            toks = [str(c.children[0] if isinstance(c, Tree) else c) for c in pat.children]
            if any(t == "..." for t in toks):
                continue  # "per_layer_saves...": the blocks keep their own lists
            pattern = "".join(toks) if toks else "*"
            hits = [n for n in tensors if fnmatch.fnmatchcase(n, pattern)]
            if not hits:
                raise self.src.error(
                    "E006", f"{pattern!r} names no tensor of the graph", pat, f"tensors: {', '.join(tensors)}"
                )
            out += [tensors[n] for n in hits]
        return out

    # -- HuggingFace
    def hf_config(self, section: Tree[Token]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        env = _Env(self.src, {})
        for entry in section.children:
            key = self.src.span(entry.children[0])
            if entry.data == "hf_table":
                if key != "param_mapping":
                    raise self.src.error(
                        "E010",
                        f"hf_config: unknown table {key!r}",
                        entry,
                        "hf_config takes architecture, model_type and param_mapping",
                    )
                for pair in entry.children[1:]:
                    if pair.data != "hf_value":
                        raise self.src.error(
                            "E010", "param_mapping maps a parameter to a HF config key", pair
                        )
                    out[self.src.span(pair.children[0])] = str(
                        env.value(pair.children[1], names=lambda text, at: text)
                    )
            else:
                value = env.value(entry.children[1], names=lambda text, at: text)
                if key == "architecture":
                    out["architecture"] = value
                elif key in ("model_type", "config_class"):
                    if key == "model_type":
                        out["model_type"] = value
                else:
                    raise self.src.error(
                        "E010",
                        f"hf_config: unknown key {key!r}",
                        entry,
                        "hf_config takes architecture, model_type and param_mapping",
                    )
        return out

    def hf_mappings(
        self, section: Tree[Token]
    ) -> tuple[dict[str, Any], dict[tuple[str, str], dict[str, Any]]]:
        """``param: "key"`` and, for the blocks of a stack, ``blocks[{layer}].param: "...{layer}..."``."""
        from kiln.dsl import fuse, stack_experts, tied_to, transform

        out: dict[str, Any] = {}
        indexed: dict[tuple[str, str], dict[str, Any]] = {}
        env = _Env(self.src, {})
        specs = {"fuse": fuse, "tied_to": tied_to, "transform": transform, "stack_experts": stack_experts}
        places = self.loader.mappings.setdefault(str(self.decl.name), [])
        for entry in section.children:
            key = self.src.span(entry.children[0]).replace(" ", "")
            line, col = _pos(entry)
            places.append((re.sub(r"\[[^]]*\]", "", key), f"{self.src.path}:{line}:{col}"))
            if entry.data != "hf_value":
                raise self.src.error(
                    "E010", f"hf_mapping {key}: expected a checkpoint key or fuse(...)", entry
                )
            expr = entry.children[1]
            target = out
            if "[" in key:
                first, *rest = entry.children[0].children
                if len(first.children) != 2 or any(len(p.children) != 1 for p in rest) or not rest:
                    raise self.src.error("E010", f"hf_mapping {key}: expected stack[{{layer}}].param", entry)
                stack, var = str(first.children[0]), str(first.children[1])
                if stack not in self.param_names:
                    raise self.src.error("E010", f"hf_mapping {key}: {stack!r} is not a parameter", first)
                key = ".".join(str(p.children[0]) for p in rest)
                target = indexed.setdefault((stack, var), {})
            if expr.data == "string":
                target[key] = _string(self.src, expr.children[0])
            elif expr.data == "call" and str(_names(expr.children[0])[0]) in specs:
                fn = specs[str(_names(expr.children[0])[0])]
                args = expr.children[1:]
                pos = [
                    env.value(a.children[0], names=lambda text, at: text)
                    for a in args
                    if len(a.children) == 1
                ]
                kw = {
                    str(a.children[0]): env.value(a.children[1], names=lambda text, at: text)
                    for a in args
                    if len(a.children) == 2
                }
                try:
                    target[key] = fn(*pos, **kw)
                except (TypeError, KilnError) as exc:
                    raise self.src.error("E010", f"hf_mapping {key}: {exc}", expr) from None
            else:
                raise self.src.error(
                    "E010", f"hf_mapping {key}: expected a string or fuse/tied_to/transform(...)", expr
                )
        return out, indexed


class _Graph:
    """Lowers the statements of one graph through kiln-dsl's builder."""

    def __init__(self, lowering: _Lowering, g: Any, env: _Env, obj: Any, tensors: dict[str, Any]) -> None:
        self.lw, self.g, self.env, self.obj, self.tensors = lowering, g, env, obj, tensors
        self.src = lowering.src

    def body(self, body: Tree[Token]) -> None:
        for stmt in body.children:
            self.statement(stmt)

    def statement(self, stmt: Tree[Token]) -> None:
        if stmt.data == "flow":
            self.flow(stmt)
        elif stmt.data == "conditional":
            cond = self.env.value(stmt.children[0], names=self.not_a_constant)
            if cond:
                self.body(stmt.children[1])
            elif len(stmt.children) > 2:
                self.body(stmt.children[2])
        elif stmt.data == "recompute_block":
            raise self.src.error(
                "E001",
                "recompute: blocks belong to explicit backward graphs",
                stmt,
                "list the tensors to recompute in the forward section: recompute: [a, b]",
            )
        elif stmt.data == "elided":
            raise self.src.error("E001", "'...' stands for an elided graph: write the statements", stmt)

    def not_a_constant(self, text: str, at: Token) -> Any:
        if text in self.tensors or text in self.lw.param_names:
            raise self.src.error(
                "E016",
                f"if guard {text!r} is a tensor: its value is not known while the graph is built",
                at,
                "guard on a parameter of the declaration or a let-binding",
            )
        raise self.src.error(
            "E002",
            f"undefined name {text!r}",
            at,
            "a condition names a parameter of the declaration or a let-binding",
        )

    def flow(self, stmt: Tree[Token]) -> None:
        items = [c for c in stmt.children if not (isinstance(c, Token) and c.type == "ARROW")]
        annotations = [c for c in items if isinstance(c, Tree) and c.data == "annotation"]
        steps = [c for c in items if not (isinstance(c, Tree) and c.data == "annotation")]
        source, *ops, dest = steps
        dest_names = self.destinations(dest)
        first_op = self.g.op_count
        if source.data == "call":
            current = self.apply(source, [], len(dest_names) if not ops else None)
        else:
            current = [self.tensor(r) for r in (source.children if source.data == "tuple_ref" else [source])]
        for k, op in enumerate(ops):
            current = self.apply(op, current, len(dest_names) if k == len(ops) - 1 else None)
        if len(current) != len(dest_names):
            raise self.src.error(
                "E003", f"the data flow gives {len(current)} tensor(s) but names {len(dest_names)}", dest
            )
        for (name, at), ref in zip(dest_names, current, strict=True):
            if name == "_":
                continue
            if name in self.tensors or name in self.lw.param_names:
                raise self.src.error(
                    "E017",
                    f"tensor {name!r} is defined twice",
                    at,
                    "every tensor is assigned once (SSA): give this one another name",
                )
            if ops or source.data == "call":
                try:
                    self.g.name_tensor(name, ref, self.src.loc(at))
                except KilnError as exc:
                    raise self.src.error(exc.code or "E017", exc.message, at, exc.hint) from None
            self.tensors[name] = ref
        self.relocate(
            first_op,
            stmt,
            annotations,
            [r for (n, _), r in zip(dest_names, current, strict=True) if n != "_"],
        )

    def relocate(
        self, first: int, stmt: Tree[Token], annotations: list[Tree[Token]], results: list[Any]
    ) -> None:
        """The ops of one statement point at its line; its annotations go on its results (kiln-dsl's
        ``g.annotate``), or, with a kiln-dsl that has none, on its last op as ``_<name>`` attributes."""
        extra: dict[str, Any] = {}
        for a in annotations:
            ann = _seed_annotation(self.src, self.env, a, "tensor")
            if ann is not None:
                try:
                    self.g.annotate(results, ann)
                except KilnError as exc:
                    raise self.src.error(exc.code or "E008", exc.message, a, exc.hint) from None
            else:
                args = [self.env.value(x.children[-1], names=_bare) for x in a.children[2:]]
                extra["_" + str(a.children[1])] = args[0] if len(args) == 1 else args or True
        self.g.locate(first, self.src.loc(stmt), **extra)

    def destinations(self, dest: Tree[Token]) -> list[tuple[str, Any]]:
        refs = dest.children if dest.data == "tuple_ref" else [dest]
        out = []
        for r in refs:
            if r.data != "ref" or len(r.children) != 1:
                raise self.src.error(
                    "E001",
                    f"a data flow ends in the name(s) of its result, found {self.src.span(r)!r}",
                    r,
                    "e.g. x -> silu() -> y",
                )
            tok = _names(r)[0]
            out.append((str(tok), tok))
        return out

    def tensor(self, r: Tree[Token]) -> Any:
        text = ".".join(map(str, _names(r)))
        if text in self.tensors:
            return self.tensors[text]
        if text in self.lw.param_names or text in self.lw.groups:
            return text  # a parameter by name; a group (experts) for the ops that read its weights
        at = _names(r)[0]
        if text.startswith("saved."):
            raise self.src.error("E006", "saved.<name> is read in explicit backward graphs only", at)
        raise self.src.error(
            "E002",
            f"undefined tensor {text!r}",
            at,
            f"tensors so far: {', '.join([*self.tensors, *sorted(self.lw.param_names)]) or 'none'}",
        )

    def arg(self, node: Any) -> Any:
        """An op argument: a tensor (by name), else a constant, else a bare word (an enum: TN, fp32).
        The items of a list that are dimension expressions stay symbolic (``shape=[B * T, d_model]``)."""
        if isinstance(node, Tree) and node.data == "list_":
            dims = self.lw.known_dims
            return [
                self.src.span(x)
                if self.lw._is_dim_expr(x, dims) or (x.data == "ref" and self.src.span(x) in dims)
                else self.arg(x)
                for x in node.children
            ]
        if isinstance(node, Tree) and node.data == "ref":
            text = ".".join(map(str, _names(node)))
            if text in self.tensors:
                return self.tensors[text]
            if text in self.lw.param_names:
                return text
        return self.env.value(node, names=self.bare_word)

    def bare_word(self, text: str, at: Token) -> Any:
        if text in self.tensors or text in self.lw.param_names:
            raise self.src.error("E003", f"tensor {text!r} used in a constant expression", at)
        if "." in text:
            raise self.src.error(
                "E002",
                f"undefined name {text!r}",
                at,
                "a submodule's tensors are not visible; call the submodule",
            )
        return text

    def apply(self, call: Tree[Token], inputs: list[Any], n_out: int | None) -> list[Any]:
        if call.data == "ref":
            name_tok = _names(call)[0]
            name, args = ".".join(map(str, _names(call))), []
        else:
            name_tok = _names(call.children[0])[0]
            name, args = ".".join(map(str, _names(call.children[0]))), list(call.children[1:])
        pos = [
            self.src.span(a.children[0])  # the §11.3 split sizes stay dimension expressions
            if name in ("mamba_split_proj", "mamba_split_conv")
            and self.lw._is_dim_expr(a.children[0], self.lw.known_dims)
            else self.arg(a.children[0])
            for a in args
            if len(a.children) == 1
        ]
        kw = {str(a.children[0]): self.arg(a.children[1]) for a in args if len(a.children) == 2}
        for a in args:  # a head count or size stays a dimension expression
            if (
                len(a.children) == 2
                and str(a.children[0]) in _DIM_ARGS
                and self.lw._is_dim_expr(a.children[1], self.lw.known_dims)
            ):
                kw[str(a.children[0])] = self.src.span(a.children[1])
        try:
            result = self.emit(name, name_tok, inputs, pos, kw, n_out)
        except TextError:
            raise
        except KilnError as exc:
            raise self.src.error(exc.code or "E003", f"{name}: {exc.message}", name_tok, exc.hint) from None
        except (TypeError, ValueError, ArithmeticError) as exc:
            raise self.src.error("E003", f"{name}: {exc}".replace("GraphBuilder.", ""), name_tok) from None
        out = list(result) if isinstance(result, (tuple, list)) else [result]
        if n_out is not None and n_out < len(out):
            out = out[
                :n_out
            ]  # the leading results (fused_residual_rmsnorm -> (residual, y)); the rest unnamed
        return out

    def emit(
        self, name: str, at: Token, inputs: list[Any], pos: list[Any], kw: dict[str, Any], n_out: int | None
    ) -> Any:
        g = self.g
        if name == "StackedBlocks":
            blocks, *rest = pos or [None]
            if "n_layers" not in kw and rest:
                kw["n_layers"] = rest[0]
            element = getattr(self.lw.array_elements.get(str(blocks)), "forward", None)
            inputs = self.positions(inputs, element)
            return g.call("StackedBlocks", *inputs, num_outputs=n_out, blocks=blocks, **kw)
        if name in self.lw.submodules:
            inputs = self.positions(inputs, getattr(type(self.obj.__dict__.get(name)), "forward", None))
            return g.call(name, *inputs, *pos, num_outputs=n_out, **kw)
        if name == "Linear" and pos and all(self.is_tensor(p) for p in pos):
            return self.linear(inputs, pos)
        if name == "moe_experts":
            return self.moe_experts(inputs, at)
        if name in _SEED_MAMBA:
            return self.seed_mamba(name, at, inputs, pos, kw, n_out)
        if name in ("zeros", "ones", "fill") and "dtype" not in kw and len(pos) < 2 + (name == "fill"):
            kw["dtype"] = DEFAULT_DTYPE  # the text's default dtype, not the Python DSL's bf16
        if not name.startswith("_") and name not in _NOT_OPS and callable(getattr(g, name, None)):
            method = getattr(g, name)
            args, kw = _bind(method, [*inputs, *pos], kw, self.is_tensor)
            return method(*args, **kw)
        if name in op_registry():
            opdef = op_registry().get_op(name)
            tensors = [p for p in pos if self.is_tensor(p)]
            consts = [p for p in pos if not self.is_tensor(p)]
            free = [a.name for a in opdef.attrs if a.name not in kw]
            if len(consts) > len(free):
                raise self.src.error(
                    "E003",
                    f"op {name!r} takes the attributes {', '.join(free) or 'none'}, "
                    f"found {len(consts)} positional values",
                    at,
                )
            kw.update(zip(free, consts, strict=False))
            return g.custom(name, *inputs, *tensors, num_outputs=n_out, **kw)
        known = sorted(n for n in dir(g) if not n.startswith("_") and n not in _NOT_OPS)
        raise self.src.error(
            "E014",
            f"unknown op or submodule {name!r}",
            at,
            f"ops: {', '.join(known[:12])}, ... (kiln's op registry); submodules: "
            f"{', '.join(self.lw.submodules) or 'none'}",
        )

    def seed_mamba(
        self, name: str, at: Token, inputs: list[Any], pos: list[Any], kw: dict[str, Any], n_out: int | None
    ) -> Any:
        """Seed 004's Mamba primitives and §11.3 helpers (``_mamba``); kiln's own signature of
        ``mamba_conv1d`` / ``mamba_selective_scan`` passes through to the registry op."""
        g = self.g
        tensors = [*inputs, *(p for p in pos if self.is_tensor(p))]
        consts = [p for p in pos if not self.is_tensor(p)]
        if name == "mamba_conv1d":
            kiln_form = not consts and set(kw) <= {"activation"} and len(tensors) <= 3 and n_out in (None, 1)
            if kiln_form and (len(tensors) < 2 or not _mamba.time_major(g, tensors[0])):
                return g.custom(name, *tensors, num_outputs=n_out, **kw)
            return _mamba.conv1d(g, tensors, consts, kw, n_out)
        if name == "mamba_selective_scan":
            if consts or not _mamba.is_seed_scan(g, tensors, kw, n_out):
                return g.custom(name, *tensors, *consts, num_outputs=n_out, **kw)
            return _mamba.selective_scan(g, tensors, kw, n_out)
        helper = getattr(_mamba, _SEED_MAMBA[name])
        if len(inputs) != 1:
            raise self.src.error("E003", f"{name} takes one input, found {len(inputs)}", at)
        return helper(g, inputs[0], *pos, **kw)

    def positions(self, inputs: list[Any], forward: Any) -> list[Any]:
        """A block or submodule whose forward takes ``position_ids`` / ``segment_ids`` after the inputs
        given gets the caller's tensors of those names; a model or block that has none declares them
        (int32 ``[B, T]``: the runtime feeds a model's, ``StackedBlocks`` a block's)."""
        if forward is None:
            return inputs
        names = list(inspect.signature(forward).parameters)[1:]
        out = list(inputs)
        for extra in names[len(inputs) :]:
            if extra not in ("position_ids", "segment_ids"):
                break
            if extra not in self.tensors:
                if self.lw.decl.kind == "module":
                    break
                self.tensors[extra] = self.g.input(extra, shape=["B", "T"], dtype="int32")
            out.append(self.tensors[extra])
        return out

    def is_tensor(self, value: Any) -> bool:
        from kiln.dsl import GraphRef

        return isinstance(value, GraphRef) or (isinstance(value, str) and value in self.lw.param_names)

    def linear(self, inputs: list[Any], weights: list[Any]) -> Any:
        """Seed 004 §10.2 ``Linear(weight)``: ``y = x @ weight^T`` over the last dimension of ``x``."""
        g = self.g
        if len(inputs) != 1 or len(weights) != 1:
            raise KilnError(
                f"Linear(weight) takes one input and one weight, found {len(inputs)} and {len(weights)}",
                code="E003",
            )
        x, w = inputs[0], weights[0]
        w_ref = g.resolve(w)
        *lead, c = x.shape
        rows = lead[0]
        for d in lead[1:]:
            rows = rows * d
        flat = g.view(x, shape=[rows, c]) if len(lead) != 1 else x
        y = g.matmul(flat, w, transpose="NT")
        return g.view(y, shape=[*lead, w_ref.shape[0]]) if len(lead) != 1 else y

    def moe_experts(self, inputs: list[Any], at: Token) -> Any:
        """Seed 004 §11.2 ``(permuted, experts, indices) -> moe_experts()``: every expert's SwiGLU MLP on
        its rows, the weights of the stack ``experts: [E] x ExpertMLP(...)`` (``gate_up`` and ``down``)."""
        g = self.g
        if len(inputs) != 3 or not isinstance(inputs[1], str):
            raise self.src.error(
                "E003",
                "moe_experts takes (permuted_input, experts, indices): the stack of "
                "ExpertMLP weights in the middle",
                at,
            )
        x, stack, indices = inputs
        scatter = g.scatter_indices(indices)
        if scatter is None:
            raise self.src.error(
                "E003", "moe_experts: the indices were not permuted by moe_permute first", at
            )
        gate_up = f"{stack}.gate_up"
        down = f"{stack}.down"
        for p in (gate_up, down):
            if p not in self.lw.param_names:
                raise self.src.error(
                    "E002",
                    f"moe_experts: the stack {stack!r} has no {p.split('.')[-1]!r} weights",
                    at,
                    "declare experts: [num_experts] x ExpertMLP(d_model, d_ff)",
                )
        h = g.moe_grouped_gemm_gate_up(x, gate_up, scatter)
        return g.moe_grouped_gemm_down(g.swiglu(h), down, scatter)


def _bind(
    method: Callable[..., Any], args: list[Any], kw: dict[str, Any], is_tensor: Callable[[Any], bool]
) -> tuple[list[Any], dict[str, Any]]:
    """Positional constants beyond a builder method's positional parameters fill its keyword-only
    attributes in order (``fused_residual_rmsnorm(ln1.weight, eps)``)."""
    params = list(inspect.signature(method).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind is p.VAR_POSITIONAL for p in params) or len(args) <= len(positional):
        return args, kw
    extra = args[len(positional) :]
    if any(is_tensor(e) for e in extra):
        return args, kw  # too many tensors: the builder says so
    free = [
        p.name
        for p in params
        if p.kind is p.KEYWORD_ONLY
        and p.name not in kw
        and not p.name.endswith("name")
        and not p.name[:1].isupper()
    ]
    if len(extra) > len(free):
        return args, kw
    return args[: len(positional)], {**kw, **dict(zip(free, extra, strict=False))}
