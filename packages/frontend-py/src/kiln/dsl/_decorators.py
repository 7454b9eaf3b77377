"""Decorators and declarations of the DSL, the registries, and the specs read off decorated classes."""

from __future__ import annotations

import importlib.util
import inspect
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from kiln.dsl._errors import class_location, error, user_location
from kiln.dsl._hf import TiedTo
from kiln.dsl._types import ArrayType, TensorAnnotation

__all__ = [
    "Activation",
    "Gradient",
    "ModuleSpec",
    "Param",
    "PrimitiveSpec",
    "abstract",
    "backward",
    "block",
    "extends",
    "forward",
    "get_block_spec",
    "get_model_spec",
    "get_module_spec",
    "hf_config",
    "hf_export",
    "hf_mapping",
    "list_registered_blocks",
    "list_registered_models",
    "list_registered_modules",
    "model",
    "module",
    "param",
    "primitive",
    "recompute",
    "registry",
    "save",
]

KINDS = ("module", "block", "model", "primitive")
_REGISTRY: dict[str, dict[str, Any]] = {k: {} for k in KINDS}
_DEFINED: dict[str, list[type]] = {}  # every class registered under a name, for lookups by package
_STDLIB = "kiln.dsl.stdlib"


# --- declarations --------------------------------------------------------------------------------


class _Declared:
    """Something declared in a class body: it learns its attribute name and where it was written."""

    name: str = ""

    def __init__(self) -> None:
        self.loc = user_location()

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name


class Param(_Declared):
    """A parameter declared as a class attribute: ``weight = Param(Tensor["O", "C"])``.

    ``when`` is a config flag name, a condition string (``"use_bias and not tied"``) or a callable on
    the module; ``frozen`` params are never trained; ``hf_mapping`` is the weight's checkpoint key or
    mapping spec; ``init`` overrides the initializer (``"normal"``, ``"ones"``, ``"zeros"`` or a dict);
    ``lora_targets`` are the slices LoRA may adapt: a name (the whole weight), ``(name, start, size)``
    or ``(name, start, size, dim)`` with dims of the module (``size`` None: to the end), or a
    ``kiln.core.ir.LoraTarget``. A fused weight lists them in the order of its ``fuse`` sources.
    ``role`` says what the parameter is for (``weight``, ``bias``, ``norm``, ``embedding``,
    ``adapter``; optimizer parameter groups select by it); by default kiln infers it.
    """

    def __init__(
        self,
        param_type: TensorAnnotation | ArrayType,
        *,
        when: Any = None,
        frozen: bool = False,
        hf_mapping: Any = None,
        init: Any = None,
        description: str = "",
        lora_targets: Iterable[Any] = (),
        role: str | None = None,
    ) -> None:
        super().__init__()
        self.type, self.when, self.frozen, self.hf_mapping = param_type, when, frozen, hf_mapping
        self.init, self.description, self.lora_targets = init, description, tuple(lora_targets)
        self.role = role
        self.tied: TiedTo | None = None
        self.optional = False
        #: seed 004 §7 annotations written after it: ``Param(...) @ shard("column") @ frozen``
        self.annotations: tuple[Any, ...] = ()

    def __repr__(self) -> str:
        return f"Param({self.type!r}, name={self.name!r})"


class _ParamMethod(Param):
    """A method-style ``@param``: the return annotation is the parameter's type."""

    def __init__(self, fn: Callable[..., Any], **options: Any) -> None:
        super().__init__(None, **options)  # type: ignore[arg-type]  # read from the annotation later
        self.fn = fn
        self.name = fn.__name__
        self.tied = getattr(fn, "__kiln_tied_to__", None)
        self.loc = _def_location(fn)

    def resolve_type(self) -> Any:
        if self.type is None:
            self.type = inspect.get_annotations(self.fn, eval_str=True).get("return")
        return self.type


def _def_location(fn: Callable[..., Any]) -> str | None:
    from kiln.dsl._errors import function_location

    return function_location(fn)


def param(
    fn: Callable[..., Any] | None = None,
    *,
    condition: Any = None,
    when: Any = None,
    frozen: bool = False,
    hf_mapping: Any = None,
    init: Any = None,
    description: str = "",
    lora_targets: Iterable[Any] = (),
) -> Any:
    """Method-style parameter: ``@param def weight(self) -> Tensor["O", "C"]: ...``.

    ``condition``/``when`` include it only when true; stack ``@tied_to("embedding")`` to tie it. The
    other options are those of :class:`Param`.
    """

    def wrap(f: Callable[..., Any]) -> _ParamMethod:
        return _ParamMethod(
            f,
            when=when if when is not None else condition,
            frozen=frozen,
            hf_mapping=hf_mapping,
            init=init,
            description=description or (f.__doc__ or "").strip(),
            lora_targets=lora_targets,
        )

    return wrap(fn) if fn is not None else wrap


class Activation(_Declared):
    """An activation slot (seed 003 §10, seed 000): a pre-declared buffer with memory and recompute hints."""

    slot_kind = "activation"

    def __init__(
        self,
        tensor_type: TensorAnnotation,
        *,
        dtype: str | None = None,
        aliases: Iterable[str] = (),
        save: bool = False,
        recompute: bool = False,
        recompute_from: Iterable[str] = (),
        recompute_op: str | None = None,
        recompute_attrs: dict[str, Any] | None = None,
        recompute_policy: str = "always",
        recompute_group: str | None = None,
        recompute_outputs: Iterable[str] = (),
        lora_targets: Iterable[str] = (),
        shares_with: str | None = None,
        share_policy: str = "per_layer",
        when: Any = None,
        scope: str = "block",
        description: str = "",
        memory_hint: str | None = None,
    ) -> None:
        super().__init__()
        self.type, self.dtype, self.aliases = tensor_type, dtype, tuple(aliases)
        self.save, self.recompute = save, recompute
        self.recompute_from, self.recompute_op = tuple(recompute_from or ()), recompute_op
        self.recompute_attrs = dict(recompute_attrs or {})
        self.recompute_policy, self.recompute_group = recompute_policy, recompute_group
        self.recompute_outputs, self.lora_targets = tuple(recompute_outputs or ()), tuple(lora_targets or ())
        self.shares_with, self.share_policy, self.when = shares_with, share_policy, when
        self.scope, self.description, self.memory_hint = scope, description, memory_hint
        self.gradient_of: str | None = None
        self.alias_of: str | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.type!r}, name={self.name!r})"


class Gradient(Activation):
    """A gradient slot: ``d_ln1 = Gradient(Tensor["B", "T", "C"], gradient_of="ln1")``."""

    slot_kind = "gradient"

    def __init__(
        self,
        tensor_type: TensorAnnotation,
        *,
        gradient_of: str | None = None,
        dtype: str | None = None,
        shares_with: str | None = None,
        alias_of: str | None = None,
        when: Any = None,
        scope: str = "gradient",
        description: str = "",
        aliases: Iterable[str] = (),
    ) -> None:
        super().__init__(
            tensor_type,
            dtype=dtype,
            aliases=aliases,
            shares_with=shares_with,
            when=when,
            scope=scope,
            description=description,
        )
        self.gradient_of, self.alias_of = gradient_of, alias_of
        self.loc = user_location()


# --- method decorators ---------------------------------------------------------------------------


def forward(fn: Callable[..., Any], location: str | None = None) -> Callable[..., Any]:
    """Mark the method that builds the forward graph with ``with graph() as g: ...``. Another frontend
    that generates the method gives the ``file:line`` of its declaration as ``location``: diagnostics
    about the forward's signature and outputs point there, not at the generated function."""
    fn.__kiln_forward__ = True  # type: ignore[attr-defined]
    if location is not None:
        fn.__kiln_location__ = location  # type: ignore[attr-defined]
    return fn


def backward(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark the method that builds the module's explicit backward graph (``Module.backward``).

    It takes the gradients of the forward outputs, reads forward tensors with ``g.saved(name)`` and
    returns the gradients ``d_<input>`` / ``d_<param>``; ``kiln.core.compile`` checks it against the
    derived backward and runs it in place of that one.
    """
    fn.__kiln_backward__ = True  # type: ignore[attr-defined]
    return fn


def _add_names(attr: str, names: tuple[Any, ...]) -> Callable[[Any], Any]:
    loc = user_location()

    def wrap(fn: Any) -> Any:
        setattr(fn, attr, (*getattr(fn, attr, ()), *names))
        locs = getattr(fn, "__kiln_locs__", {})
        fn.__kiln_locs__ = {**{n: loc for n in names}, **locs}
        return fn

    return wrap


def save(*names: str) -> Callable[[Any], Any]:
    """``@save("x", "up")``: tensors the forward keeps for backward (above or below ``@forward``)."""
    return _add_names("__kiln_save__", names)


def recompute(*names: str) -> Callable[[Any], Any]:
    """``@recompute("hidden")``: tensors recomputed in backward instead of kept."""
    return _add_names("__kiln_recompute__", names)


# --- class decorators ----------------------------------------------------------------------------


def _meta(cls: type) -> dict[str, Any]:
    if "__kiln__" not in cls.__dict__:
        cls.__kiln__ = {"hf_mappings": {}, "hf_indexed": {}, "hf_export": {}}  # type: ignore[attr-defined]
    meta: dict[str, Any] = cls.__dict__["__kiln__"]
    return meta


def _recording_new(cls: type, *args: Any, **kwargs: Any) -> Any:
    """Instances of DSL classes remember their constructor arguments (their config)."""
    obj = object.__new__(cls)
    init = cls.__init__  # type: ignore[misc]
    if init is not object.__init__:
        try:
            bound = inspect.signature(init).bind(obj, *args, **kwargs)
            bound.apply_defaults()
            values = dict(list(bound.arguments.items())[1:])
            for name, p in inspect.signature(init).parameters.items():
                if p.kind is p.VAR_KEYWORD:
                    values.update(values.pop(name, {}))
                elif p.kind is p.VAR_POSITIONAL:
                    values.pop(name, None)
            obj.__dict__["__kiln_args__"] = values
        except TypeError:
            pass  # __init__ itself reports the bad call
    return obj


def _register(cls: type, kind: str) -> type:
    meta = _meta(cls)
    meta["kind"] = kind
    if "__new__" not in cls.__dict__ and cls.__new__ is object.__new__:
        cls.__new__ = _recording_new  # type: ignore[assignment]
    table = _REGISTRY[kind]
    _DEFINED.setdefault(cls.__name__, []).append(cls)
    old = table.get(cls.__name__)
    from_stdlib = cls.__module__.startswith(_STDLIB)
    if old is None or not from_stdlib or old.__module__.startswith(_STDLIB):
        for other in KINDS:  # a name belongs to one kind at a time
            if other != kind and _REGISTRY[other].get(cls.__name__) is not None and not from_stdlib:
                del _REGISTRY[other][cls.__name__]
        table[cls.__name__] = cls
    return cls


def module(cls: type) -> type:
    """A reusable module (Linear, RMSNorm, ...): parameters and a ``@forward`` graph."""
    return _register(cls, "module")


def block(cls: type) -> type:
    """A transformer block: a module with activation slots, repeated by ``Array[n, Block]``."""
    return _register(cls, "block")


def model(cls: type) -> type:
    """A top-level model: inputs ``token_ids``/``position_ids``/``targets``, output ``loss``."""
    return _register(cls, "model")


def abstract(cls: type) -> type:
    """An interface: its parameters are inherited by ``@extends``, it cannot be compiled itself."""
    _meta(cls)["abstract"] = True
    return cls


def _fix_class_cells(obj: Any, old: type, new: type, depth: int = 0) -> None:
    """Point zero-argument ``super()`` (the ``__class__`` cell) of rebuilt methods at the new class."""
    if depth > 3:
        return
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    elif isinstance(obj, property):
        for f in (obj.fget, obj.fset, obj.fdel):
            _fix_class_cells(f, old, new, depth + 1)
        return
    elif isinstance(obj, _ParamMethod):
        obj = obj.fn
    if isinstance(obj, types.FunctionType):
        for cell in obj.__closure__ or ():
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if value is old:
                cell.cell_contents = new
            else:
                _fix_class_cells(value, old, new, depth + 1)


def extends(base: str | type) -> Callable[[type], type]:
    """``@extends("BaseAttention")``: inherit the parameters, slots and methods of another DSL class."""
    where = user_location()

    def wrap(cls: type) -> type:
        base_cls = base if isinstance(base, type) else _lookup_name(base, cls)
        if base_cls is None:
            raise error(
                "E002",
                f"@extends({base!r}) on {cls.__name__}: no DSL class named {base!r}",
                "define (and decorate) the base class before the class that extends it",
                where,
            )
        if issubclass(cls, base_cls):
            return cls
        ns = {k: v for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__")}
        bases = (base_cls,) if cls.__bases__ == (object,) else (*cls.__bases__, base_cls)
        new = type(cls)(cls.__name__, bases, ns)
        for value in ns.values():
            _fix_class_cells(value, cls, new)
        meta = _meta(new)
        meta["extends"] = base_cls.__name__
        meta.pop("abstract", None)
        if "kind" in meta:
            _register(new, meta["kind"])
        return new

    return wrap


def hf_config(
    architecture: str | None = None, model_type: str | None = None, **mapping: str
) -> Callable[[type], type]:
    """Map a HuggingFace config onto constructor arguments: ``d_model="hidden_size"``."""

    def wrap(cls: type) -> type:
        _meta(cls)["hf_config"] = {
            "architecture": architecture,
            "model_type": model_type,
            "param_mapping": dict(mapping),
            "loc": class_location(cls),
        }
        return cls

    return wrap


class _HFMappingDecorator:
    """``@hf_mapping(param=key, ...)`` and ``@hf_mapping.indexed("blocks", param=key, ...)``."""

    def __call__(self, **mappings: Any) -> Callable[[type], type]:
        loc = user_location()

        def wrap(cls: type) -> type:
            _meta(cls)["hf_mappings"].update({k: (v, loc) for k, v in mappings.items()})
            return cls

        return wrap

    def indexed(
        self, array_param: str, index_var: str = "{layer}", layer_offset: Any = 0, layers: Any = None,
        **mappings: Any
    ) -> Callable[[type], type]:
        """``{layer}`` of block ``i`` is HF layer ``layers[i]``: ``layers`` is a list of ints or the name
        of a model attribute holding one (stacks whose layers interleave); ``layer_offset`` (an int,
        or a config name or dim expression of the model) makes it ``layer_offset + i``."""
        loc = user_location()

        def wrap(cls: type) -> type:
            entry = _meta(cls)["hf_indexed"].setdefault(array_param, {"index_var": index_var, "mappings": {}})
            entry["mappings"].update({k: (v, loc) for k, v in mappings.items()})
            if layer_offset != 0:
                entry["layer_offset"] = (layer_offset, loc)
            if layers is not None:
                entry["layers"] = (layers, loc)
            return cls

        return wrap


hf_mapping = _HFMappingDecorator()


def hf_export(**spec: Any) -> Callable[[type], type]:
    """What writing a HuggingFace checkpoint back needs (mapping specs and plain JSON values)."""
    loc = user_location()

    def wrap(cls: type) -> type:
        _meta(cls)["hf_export"].update({k: (v, loc) for k, v in spec.items()})
        return cls

    return wrap


# --- primitives ----------------------------------------------------------------------------------


@attrs.define
class PrimitiveSpec:
    """A ``@primitive``: a typed signature for a kernel (an op of kiln's registry when called in a graph)."""

    name: str
    impl: str | None
    fn: Callable[..., Any]
    inputs: dict[str, Any]
    attrs: dict[str, Any]
    outputs: Any
    doc: str = ""
    backward_fn: Callable[..., Any] | None = None
    backward_save: tuple[str, ...] = ()
    loc: str | None = None

    def __call__(self, *inputs: Any, **attrs_: Any) -> Any:
        from kiln.dsl._builder import current_builder

        return current_builder("a @primitive").custom(self.name, *inputs, **attrs_)

    def backward(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``@matmul.backward``: record the backward signature (and its ``@save`` list)."""
        self.backward_fn = fn
        self.backward_save = tuple(getattr(fn, "__kiln_save__", ()))
        return fn


def primitive(
    fn: Callable[..., Any] | None = None, *, impl: str | None = None, name: str | None = None
) -> Any:
    """``@primitive(impl="kernels.matmul") def matmul(A: Tensor[...], ...) -> Tensor[...]``.

    Records the signature; ``@matmul.backward`` records the backward signature. Called inside a
    graph, a primitive emits the registered op of the same name.
    """

    def wrap(f: Callable[..., Any]) -> PrimitiveSpec:
        sig = inspect.signature(f)
        hints = inspect.get_annotations(f, eval_str=True)
        ins = {n: hints.get(n) for n, p in sig.parameters.items() if p.kind is not p.KEYWORD_ONLY}
        kw = {n: p.default for n, p in sig.parameters.items() if p.kind is p.KEYWORD_ONLY}
        spec = PrimitiveSpec(
            name or f.__name__,
            impl,
            f,
            ins,
            kw,
            hints.get("return"),
            (f.__doc__ or "").strip(),
            loc=_def_location(f),
        )
        _REGISTRY["primitive"][spec.name] = spec
        return spec

    return wrap(fn) if fn is not None else wrap


# --- specs ---------------------------------------------------------------------------------------


@attrs.define
class ModuleSpec:
    """What a decorated class declares. ``kind`` is ``module``, ``block`` or ``model``."""

    name: str
    kind: str
    cls: type
    params: dict[str, Param]
    #: parameters a class redefines: the definition of the base class it replaces, and that class's name
    redefined: dict[str, tuple[Param, str]]
    activations: dict[str, Activation]
    forward: Callable[..., Any] | None
    backward: Callable[..., Any] | None
    save: tuple[str, ...]
    recompute: tuple[str, ...]
    hf_config: dict[str, Any] | None
    hf_mappings: dict[str, Any]
    hf_indexed: dict[str, Any]
    hf_export: dict[str, Any]
    abstract: bool
    extends: str | None
    constraints: tuple[Any, ...]
    dims: dict[str, Any]
    doc: str
    loc: str | None
    #: seed 004 §7 annotations of the class (class decorators such as ``@checkpoint``), bases first
    annotations: tuple[Any, ...] = ()


def spec_of(cls: type) -> ModuleSpec:
    """Read the spec off a decorated class (walking its bases, so ``@extends`` inherits)."""
    meta = cls.__dict__.get("__kiln__") or {}
    params: dict[str, Param] = {}
    owners: dict[str, str] = {}
    redefined: dict[str, tuple[Param, str]] = {}
    slots: dict[str, Activation] = {}
    fwd = bwd = None
    hf_mappings: dict[str, Any] = {}
    hf_indexed: dict[str, Any] = {}
    hf_export: dict[str, Any] = {}
    hf_cfg = None
    for c in reversed(cls.__mro__[:-1]):
        cmeta = c.__dict__.get("__kiln__") or {}
        hf_mappings.update(cmeta.get("hf_mappings", {}))
        for k, v in cmeta.get("hf_indexed", {}).items():
            hf_indexed[k] = v
        hf_export.update(cmeta.get("hf_export", {}))
        hf_cfg = cmeta.get("hf_config", hf_cfg)
        for k, v in c.__dict__.items():
            if isinstance(v, Param):
                if k in params:
                    redefined[k] = (params[k], owners[k])
                params[k], owners[k] = v, c.__name__
            elif isinstance(v, Activation):
                slots[k] = v
            elif callable(v) and getattr(v, "__kiln_forward__", False):
                fwd = v
            elif callable(v) and getattr(v, "__kiln_backward__", False):
                bwd = v
        try:
            annotations = inspect.get_annotations(c, eval_str=True)
        except Exception:  # annotations that are not DSL types need not evaluate
            annotations = inspect.get_annotations(c)
        for k, v in annotations.items():  # ``bias: Tensor["O"] | None``
            if isinstance(v, TensorAnnotation) and k not in params:
                p = Param(v)
                p.name, p.optional, p.loc = k, v.optional, class_location(c, f"{k}:")
                params[k] = p
    return ModuleSpec(
        name=cls.__name__,
        kind=meta.get("kind", "module"),
        cls=cls,
        params=params,
        redefined=redefined,
        activations=slots,
        forward=fwd,
        backward=bwd,
        save=tuple(getattr(fwd, "__kiln_save__", ())),
        recompute=tuple(getattr(fwd, "__kiln_recompute__", ())),
        hf_config=hf_cfg,
        hf_mappings=hf_mappings,
        hf_indexed=hf_indexed,
        hf_export=hf_export,
        abstract=bool(meta.get("abstract")),
        extends=meta.get("extends"),
        constraints=tuple(getattr(cls, "_constraints_", ()) or ()),
        dims=dict(getattr(cls, "_dims_", {}) or {}),
        doc=(cls.__doc__ or "").strip(),
        loc=class_location(cls),
        annotations=tuple(a for c in reversed(cls.__mro__[:-1])
                          for a in c.__dict__.get("__kiln_annotations__", ())),
    )


# --- registry ------------------------------------------------------------------------------------

_stdlib_state = {"loaded": False}


def _ensure_stdlib() -> None:
    """Import the standard library (which registers its classes) on first lookup, if it is installed."""
    if _stdlib_state["loaded"]:
        return
    _stdlib_state["loaded"] = True
    if _STDLIB in sys.modules or importlib.util.find_spec(_STDLIB) is None:
        return
    importlib.import_module(_STDLIB)


def _lookup_name(name: str, near: Any = None) -> type | None:
    """A DSL class by name: first the globals of ``near``'s module, then a class of the same package
    (so the standard library finds its own blocks), then the registries."""
    if near is not None:
        home = getattr(near, "__module__", "") or ""
        mod = sys.modules.get(home)
        found = getattr(mod, name, None) if mod is not None else None
        if isinstance(found, type) and "kind" in (found.__dict__.get("__kiln__") or {}):
            return found
        if home.startswith(_STDLIB):
            _ensure_stdlib()
        package = home.rpartition(".")[0]
        for cls in reversed(_DEFINED.get(name, [])):
            if package and cls.__module__.rpartition(".")[0] == package:
                return cls
    for kind in ("model", "block", "module"):
        if name in _REGISTRY[kind]:
            return _REGISTRY[kind][name]  # type: ignore[no-any-return]
    _ensure_stdlib()
    for kind in ("model", "block", "module"):
        if name in _REGISTRY[kind]:
            return _REGISTRY[kind][name]  # type: ignore[no-any-return]
    return None


def _get(kind: str, name: str) -> Any:
    _ensure_stdlib()
    found = _REGISTRY[kind].get(name)
    if found is None:
        known = ", ".join(sorted(_REGISTRY[kind])) or "none"
        raise error("E002", f"no {kind} named {name!r} is registered", f"registered {kind}s: {known}")
    return found


class _Registry:
    """The unified registry: ``registry.get_model("Qwen3Model")`` returns its spec."""

    def get_module(self, name: str) -> ModuleSpec:
        return spec_of(_get("module", name))

    def get_block(self, name: str) -> ModuleSpec:
        return spec_of(_get("block", name))

    def get_model(self, name: str) -> ModuleSpec:
        return spec_of(_get("model", name))

    def get_primitive(self, name: str) -> PrimitiveSpec:
        return _get("primitive", name)  # type: ignore[no-any-return]

    def get_any(self, name: str) -> ModuleSpec | PrimitiveSpec:
        _ensure_stdlib()
        for kind in ("model", "block", "module", "primitive"):
            if name in _REGISTRY[kind]:
                found = _REGISTRY[kind][name]
                return found if kind == "primitive" else spec_of(found)
        raise error(
            "E002",
            f"no DSL component named {name!r} is registered",
            "decorate it with @module, @block, @model or @primitive",
        )

    def list(self, kind: str) -> list[str]:
        _ensure_stdlib()
        return sorted(_REGISTRY[kind])

    def find_hf_architecture(self, architecture: str) -> type | None:
        """The model mapping ``architecture``: the latest user definition, else the standard library's."""
        _ensure_stdlib()
        found = [
            cls
            for cls in _REGISTRY["model"].values()
            if (spec_of(cls).hf_config or {}).get("architecture") == architecture
        ]
        found.sort(key=lambda cls: not cls.__module__.startswith(_STDLIB))  # stable: registration order kept
        return found[-1] if found else None

    def architectures(self) -> list[str]:
        _ensure_stdlib()
        return sorted(
            {(spec_of(c).hf_config or {}).get("architecture") or "" for c in _REGISTRY["model"].values()}
            - {""}
        )


registry = _Registry()


def get_model_spec(name: str) -> ModuleSpec:
    return registry.get_model(name)


def get_block_spec(name: str) -> ModuleSpec:
    return registry.get_block(name)


def get_module_spec(name: str) -> ModuleSpec:
    return registry.get_module(name)


def list_registered_models() -> list[str]:
    return registry.list("model")


def list_registered_blocks() -> list[str]:
    return registry.list("block")


def list_registered_modules() -> list[str]:
    return registry.list("module")


def is_component(cls: Any) -> bool:
    """Whether ``cls`` itself is decorated with ``@module``, ``@block`` or ``@model`` (not only a base)."""
    return isinstance(cls, type) and (cls.__dict__.get("__kiln__") or {}).get("kind") in (
        "module",
        "block",
        "model",
    )


def kind_of(cls: type) -> str | None:
    """``"module"``, ``"block"``, ``"model"`` for a decorated class or a subclass of one, else None."""
    for c in cls.__mro__:
        kind = (c.__dict__.get("__kiln__") or {}).get("kind")
        if kind:
            return kind  # type: ignore[no-any-return]
    return None
