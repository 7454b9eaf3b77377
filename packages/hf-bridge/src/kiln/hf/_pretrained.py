"""``from_pretrained`` / ``save_pretrained``: a HF checkpoint folder in, a kiln Model out, and back.

The architecture named by ``config.json`` picks the DSL model that declares it (``@hf_config``);
kiln-dsl compiles it from the config, and the model's HF weight mappings, resolved against the
checkpoint's headers, say where every tensor goes. Everything that can be checked without reading
tensor data (the config, every key, shape and dtype) is checked before the model is allocated; the
tensors are then copied from the memory maps straight into the model's arena, one at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from kiln.core import KilnError, Model, get_registry, init_value
from kiln.core.ir import (
    Bundle,
    Module,
    Op,
    ParamSpec,
    TensorDecl,
    dim_bindings,
    evaluate_shape,
    from_json,
    parse_dim,
    thaw,
)
from kiln.hf._data import IGNORE_INDEX
from kiln.hf._errors import CheckpointError, HFConfigError
from kiln.hf._mapping import Entry, WeightMap, resolve
from kiln.hf._rope import rope_inv_freq, rope_parameters, rope_table

CONFIG_NAME = "config.json"
#: the frozen model parameter holding the RoPE table of scaled RoPE variants
ROPE_PARAM = "rope_freqs"
# transformers' attribute_map aliases: configs may hold a value under the other name
_ALIASES = {"num_experts": "num_local_experts", "partial_rotary_factor": "rotary_pct",
            "rope_theta": "rotary_emb_base"}
_COMMON_DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "pad_token_id": None,
                    "rope_theta": 10000.0}
#: the MoE load-balancing loss: added to the loss only when the config asks for the router logits
_AUX_DEFAULTS = {"output_router_logits": False, "router_aux_loss_coef": 0.001}
#: transformers' defaults (its config classes') for every config key kiln reads: what a key a
#: config.json omits means. None where transformers derives the value (``num_key_value_heads`` =
#: ``num_attention_heads``, ``head_dim`` = ``hidden_size // num_attention_heads``), as the DSL models
#: do; ``rope_theta`` is the one a config without ``rope_parameters`` (or ``rope_theta``) has.
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {
        **_COMMON_DEFAULTS, "attention_bias": False, "vocab_size": 32000, "hidden_size": 4096,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
        "intermediate_size": 11008, "max_position_embeddings": 2048, "head_dim": None, "mlp_bias": False},
    "Qwen3ForCausalLM": {
        **_COMMON_DEFAULTS, "attention_bias": False, "vocab_size": 151936, "hidden_size": 4096,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "intermediate_size": 22016, "max_position_embeddings": 32768, "head_dim": 128},
    "Qwen3MoeForCausalLM": {
        **_COMMON_DEFAULTS, "attention_bias": False, "vocab_size": 151936, "hidden_size": 2048,
        "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4,
        "intermediate_size": 6144, "max_position_embeddings": 32768, "head_dim": None, "num_experts": 128,
        "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": False,
        "decoder_sparse_step": 1, "mlp_only_layers": [], **_AUX_DEFAULTS},
    "MistralForCausalLM": {
        **_COMMON_DEFAULTS, "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
        "max_position_embeddings": 131072, "head_dim": None, "sliding_window": 4096},
    "MixtralForCausalLM": {
        **_COMMON_DEFAULTS, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "vocab_size": 32000,
        "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "intermediate_size": 14336, "max_position_embeddings": 131072, "head_dim": None,
        "sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2, **_AUX_DEFAULTS},
    "GPTNeoXForCausalLM": {
        "vocab_size": 50432, "hidden_size": 6144, "num_hidden_layers": 44, "num_attention_heads": 64,
        "intermediate_size": 24576, "max_position_embeddings": 2048, "layer_norm_eps": 1e-5,
        "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "use_parallel_residual": True,
        "attention_bias": True, "tie_word_embeddings": False, "pad_token_id": None, "hidden_act": "gelu"},
}
_ACTIVATIONS = ("silu", "swish")
#: architectures whose MLP is not SwiGLU: the activation their kiln block computes
_ACTIVATION_OF = {"GPTNeoXForCausalLM": ("gelu",)}
_SAVE_DTYPES = ("float32", "bfloat16", "float16", "float64")


def shift_labels(labels: Any, ignore_index: int = IGNORE_INDEX) -> np.ndarray:
    """HF's unshifted ``labels`` ``[batch, seq]`` as kiln's targets: ``labels[:, 1:]``, then ``ignore_index``.

    transformers scores position ``t`` against ``labels[:, t + 1]``; kiln against ``labels[:, t]``.
    """
    lab = np.asarray(labels)
    if lab.ndim != 2:
        raise KilnError(f"labels must be [batch, seq], found shape {list(lab.shape)}")
    return np.concatenate([lab[:, 1:], np.full((lab.shape[0], 1), ignore_index, lab.dtype)], axis=1)


def read_config(folder: str | Path) -> tuple[dict[str, Any], Path]:
    """``config.json`` of a checkpoint folder, and its path."""
    file = Path(folder) / CONFIG_NAME
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HFConfigError("no config.json: a HF checkpoint folder holds one beside its weights",
                            file=file) from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise HFConfigError(f"cannot read the config: {e}", file=file) from None
    if not isinstance(config, dict):
        raise HFConfigError(f"must hold a JSON object, found {type(config).__name__}", file=file)
    return config, file


def supported_architectures() -> list[str]:
    """HF architectures some registered DSL model declares through ``@hf_config``."""
    from kiln.dsl import registry

    return list(registry.architectures())


def _architecture(config: Mapping[str, Any], file: Path) -> str:
    names = config.get("architectures")
    supported = supported_architectures()
    for name in names if isinstance(names, list) else ():
        if name in supported:
            return str(name)
    found = f"architectures {names!r} are" if names else "no architectures are"
    raise HFConfigError(f"{found} not supported; kiln's DSL models map {', '.join(supported)}",
                        key="architectures", file=file)


def _check(config: Mapping[str, Any], file: Path, arch: str = "") -> None:
    """Features of these configs the kiln models do not compute: refused rather than silently wrong."""
    allowed = _ACTIVATION_OF.get(arch, _ACTIVATIONS)
    act = config.get("hidden_act", allowed[0])
    if act not in allowed:
        mlp = "GELU (exact)" if allowed == ("gelu",) else "SwiGLU (silu)"
        raise HFConfigError(f"activation {act!r} is not supported; this architecture's kiln MLP is {mlp}",
                            key="hidden_act", file=file)
    if config.get("use_sliding_window"):
        raise HFConfigError("sliding-window attention is not supported", key="use_sliding_window", file=file)
    if config.get("router_jitter_noise"):
        raise HFConfigError("router jitter noise is not supported (kiln's routers are deterministic)",
                            key="router_jitter_noise", file=file)
    kinds = set(config.get("layer_types") or ()) - {"full_attention"}
    if kinds:
        raise HFConfigError(f"layer types {sorted(kinds)} are not supported; kiln runs full attention",
                            key="layer_types", file=file)


def with_defaults(config: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """``config`` as transformers reads it: legacy key names under their current ones, then the
    architecture's defaults for the keys it omits."""
    given = dict(config)
    for name, alias in _ALIASES.items():
        if given.get(name) is None and given.get(alias) is not None:
            given[name] = given[alias]
    return {**HF_DEFAULTS.get(arch, {}), **given}


def _dsl_config(config: Mapping[str, Any], arch: str, file: Path) -> tuple[dict[str, Any], bool]:
    """The config the DSL compiles, and whether RoPE needs a table (a scaled or partial RoPE)."""
    out = with_defaults(config, arch)
    try:
        rope = rope_parameters(out)
    except HFConfigError as e:
        raise HFConfigError(e.message, key=e.key, file=file) from None
    table = rope["rope_type"] != "default" or rope.get("partial_rotary_factor", 1.0) != 1.0
    # the DSL models compute plain RoPE from rope_theta; for the other kinds the table replaces it
    out.pop("rope_scaling", None)
    out["rope_parameters"] = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
    out["rope_theta"] = rope["rope_theta"]
    return out, table


def config_bundle(folder: str | Path) -> Bundle:
    """The kiln IR of the model a HF checkpoint folder's ``config.json`` describes (no weights read):
    what ``kiln plan FOLDER`` plans."""
    return compile_config(*read_config(folder))[0]


def compile_config(config: Mapping[str, Any], file: str | Path = CONFIG_NAME) -> tuple[Bundle, str]:
    """The kiln IR of a HF config (a ``config.json`` as a dict) and the architecture it names.

    Raises :class:`HFConfigError` naming ``file`` and the key at fault: an architecture no DSL model
    declares (the message lists those that are), a feature kiln does not compute, or the DSL's own
    diagnostics (e.g. E027 for a constraint the config breaks).
    """
    from kiln.dsl import compile_model_for_hf

    file = Path(file)
    arch = _architecture(config, file)
    _check(config, file, arch)
    dsl_config, table = _dsl_config(config, arch, file)
    payload = compile_model_for_hf(arch, dsl_config)
    if not payload["success"]:
        errs = payload["errors"]
        raise HFConfigError("; ".join(f"{e['code']}: {e['message']}" for e in errs), file=file,
                            hint=errs[0].get("hint"))
    bundle = Bundle(tuple(from_json(m) for m in payload["modules"]), entry=payload["entry"])
    if table:
        model = bundle.module(bundle.entry)
        rows = config.get("max_position_embeddings") or model.config.get("max_seq")
        inv_freq, _ = rope_inv_freq(with_defaults(config, arch), head_dim=model.config.get("head_size"))
        bundle = with_rope_table(bundle, (int(rows), inv_freq.size, 2))
    return bundle, arch


def with_rope_table(bundle: Bundle, shape: tuple[int, ...]) -> Bundle:
    """``bundle`` with a frozen model parameter ``rope_freqs`` of ``shape`` ``[rows, rotary_dim // 2, 2]``
    fed to every op that takes a ``freqs`` table (``rope``, ``qkv_qk_norm_rope``), in the model and in
    the blocks it calls (as an extra last input of each ``call``)."""
    from kiln.core import op_registry

    registry = op_registry()
    decl = TensorDecl(ROPE_PARAM, shape, "fp32")
    rotary_dim = 2 * shape[1]

    def feed(op: Op, name: str) -> Op:
        schema = registry[op.type].inputs if op.type in registry else ()
        if "freqs?" not in schema:
            return op
        i = schema.index("freqs?")
        inputs = list(op.inputs) + [""] * (i + 1 - len(op.inputs))
        inputs[i] = name
        # an int rotary_dim: the shape rules then see the table's width as a number, not ``D // 2``
        return attrs.evolve(op, inputs=tuple(inputs), attrs={**op.attrs, "rotary_dim": rotary_dim})

    model = bundle.module(bundle.entry)
    assert model.forward is not None
    called = {str(op.attrs["module"]) for op in model.forward.ops if op.type == "call"}
    modules = []
    for m in bundle.modules:
        g = m.forward
        if g is None or (m.name != model.name and m.name not in called):
            modules.append(m)
            continue
        ops = tuple(attrs.evolve(op, inputs=(*op.inputs, ROPE_PARAM)) if op.type == "call"
                    else feed(op, ROPE_PARAM) for op in g.ops)
        if m.name == model.name:
            spec = ParamSpec(ROPE_PARAM, shape, "fp32", frozen=True, init={"kind": "zeros"},
                             description="(cos, sin) rows of scaled RoPE by position, from config.json")
            m = attrs.evolve(m, params=(*m.params, spec),
                             forward=attrs.evolve(g, params=(*g.params, decl), ops=ops))
        else:
            m = attrs.evolve(m, forward=attrs.evolve(g, inputs=(*g.inputs, decl), ops=ops))
        modules.append(m)
    return attrs.evolve(bundle, modules=tuple(modules))


def _strings(spec: Any) -> Iterable[str]:
    if isinstance(spec, str):
        yield spec
    elif isinstance(spec, Mapping):
        for v in spec.values():
            yield from _strings(v)
    elif isinstance(spec, list | tuple):
        for v in spec:
            yield from _strings(v)


def _fill(spec: Any, var: str, value: str) -> Any:
    if isinstance(spec, str):
        return spec.replace(var, value)
    if isinstance(spec, Mapping):
        return {k: _fill(v, var, value) for k, v in spec.items()}
    if isinstance(spec, list | tuple):
        return [_fill(v, var, value) for v in spec]
    return spec


def _stack_mappings(model: Module, modules: Mapping[str, Module], stack: str) -> tuple[dict[str, Any], str]:
    """The block-parameter mappings of layer stack ``stack`` and their layer placeholder."""
    spec = next(p for p in model.params if p.name == stack)
    indexed = thaw(model.hf_mappings.get(stack)) or {}
    block = modules[str(spec.array_of)]
    maps = indexed.get("mappings") or {p.name: thaw(p.hf_mapping) for p in block.params}
    return maps, indexed.get("index", "{layer}")


def _layer_offsets(model: Module, modules: Mapping[str, Module], ints: Mapping[str, int]) -> dict[str, int]:
    """HF layer index of each stack's first layer, for stacks whose mapping lists no ``layers``
    (:meth:`Module.hf_layers`). Stacks run in the order the forward calls them; a stack whose key
    templates repeat an earlier stack's continues that stack's layer numbering."""
    assert model.forward is not None
    done: list[tuple[set[str], int]] = []
    offsets: dict[str, int] = {}
    for op in model.forward.ops:
        if op.type != "call":
            continue
        stack = str(op.attrs.get("params", "blocks"))
        templates = set(_strings(_stack_mappings(model, modules, stack)[0]))
        offsets[stack] = sum(n for t, n in done if t & templates)
        done.append((templates, parse_dim(op.attrs["n_layers"]).evaluate(ints)))
    return offsets


def weight_entries(bundle: Bundle) -> list[Entry]:
    """Every stored parameter of the model (as kiln's runtime lays them out) with its HF mapping,
    ``{layer}`` filled with the HF layer index. The RoPE table parameter has none: kiln fills it."""
    model = bundle.module(bundle.entry)
    mods = {m.name: m for m in bundle.modules}
    ints = dim_bindings(model.config)
    offsets = _layer_offsets(model, mods, ints)
    out = []

    def mapping(found: Any, param: str) -> Any:
        if found is None:
            raise KilnError(f"kiln parameter {param!r} has no HF weight mapping, so it cannot be loaded",
                            hint="declare one with Param(hf_mapping=...) or @hf_mapping")
        return found

    for spec in model.params:
        if spec.tied_to is not None or spec.name == ROPE_PARAM:
            continue
        if spec.array_of is None:
            found = thaw(model.hf_mappings.get(spec.name, spec.hf_mapping))
            out.append(Entry(spec.name, evaluate_shape(spec.shape, ints), mapping(found, spec.name),
                             thaw(spec.init), ints))
            continue
        block = mods[spec.array_of]
        bints = {**ints, **dim_bindings(block.config)}
        maps, var = _stack_mappings(model, mods, spec.name)
        assert spec.count is not None
        count = spec.count.evaluate(ints)
        layers = model.hf_layers(spec.name, count) or [offsets.get(spec.name, 0) + i for i in range(count)]
        for i, layer in enumerate(map(str, layers)):
            for b in block.params:
                key = f"{spec.name}.{i}.{b.name}"
                out.append(Entry(key, evaluate_shape(b.shape, bints), _fill(mapping(maps.get(b.name), key),
                                 var, layer), thaw(b.init), bints))
    return out


class PretrainedModel(Model):
    """A kiln :class:`~kiln.core.Model` loaded from a HF checkpoint: the Model API, plus HF names.

    ``loss_and_grads`` keys gradients by the checkpoint's tensor names (fused parameters split back);
    ``hf_state_dict`` and ``save_pretrained`` give the weights in the checkpoint's layout.
    ``parameters()``/``set_parameters()`` keep kiln's own names. Labels are kiln's: already shifted
    (``labels[:, t]`` is the target of position ``t``); :func:`shift_labels` converts HF's.
    """

    def __init__(self, module_ir: Bundle, *, hf_config: Mapping[str, Any], architecture: str,
                 weights: WeightMap, **options: Any) -> None:
        self.hf_config, self.architecture, self.weights = dict(hf_config), architecture, weights
        self.seed = int(options.get("seed", 0))
        # nothing to draw: the checkpoint fills the (zeroed) weights; see from_pretrained
        super().__init__(module_ir, init=None, **options)

    def loss_and_grads(self, input_ids: Any, labels: Any, *, attention_mask: Any = None,
                       position_ids: Any = None, names: str = "hf") -> tuple[float, dict[str, np.ndarray]]:
        """The mean loss and the gradients, keyed by checkpoint tensor name (``names="kiln"``: by
        kiln parameter). A trained parameter without a HF tensor (a LoRA adapter) keeps its kiln name."""
        if names not in ("hf", "kiln"):
            raise KilnError(f"names={names!r} is not valid; expected 'hf' or 'kiln'")
        loss, grads = super().loss_and_grads(input_ids, labels, attention_mask=attention_mask,
                                             position_ids=position_ids)
        if names == "kiln":
            return loss, grads
        mapped = {p.param for p in self.weights.pieces}
        out = {k: np.asarray(v) for k, v in self.weights.export(grads, np.dtype(self.dtype)).items()}
        out.update({k: v for k, v in grads.items() if k not in mapped})
        return loss, out

    def hf_state_dict(self, dtype: Any = None) -> dict[str, np.ndarray]:
        """The weights as checkpoint tensors: ``{name: array}``, in ``dtype`` or, by default, each in
        the dtype it was loaded with."""
        dtype = None if dtype is None else _float_dtype(dtype)
        return {k: np.asarray(v) for k, v in self.weights.export(_Parameters(self), dtype).items()}

    def save_pretrained(self, path: str | Path, *, max_shard_size: int | str = "5GB",
                        dtype: Any = None) -> list[Path]:
        """Write the weights in the checkpoint's layout and ``config.json`` into folder ``path``.

        One ``model.safetensors``, or shards of at most ``max_shard_size`` with an index, each with
        ``{"format": "pt"}`` metadata; tensors are made one at a time. ``dtype`` (``"bfloat16"``,
        ``"float32"``...) casts every tensor, and is recorded in the config; by default each keeps the
        dtype it was loaded with. The config is the one loaded, round-tripped. Returns the files written.
        """
        folder = Path(path)
        config = dict(self.hf_config)
        if dtype is not None:
            dtype = _float_dtype(dtype)
            key = "torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"  # v4 : v5
            config[key] = dtype.name
        tensors = self.weights.export(_Parameters(self), dtype)
        written = get_registry("weight_formats")["safetensors"].save(folder, tensors,
                                                                    max_shard_size=max_shard_size)
        (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        return [*written, folder / CONFIG_NAME]


def _float_dtype(dtype: Any) -> np.dtype[Any]:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt.name not in _SAVE_DTYPES:
        raise KilnError(f"dtype={dtype!r} is not valid; expected one of {', '.join(_SAVE_DTYPES)}")
    return dt


def weight_format(path: str | Path) -> Any:
    """The first registered weight format (``kiln_register_weight_formats``) that reads ``path``."""
    formats = get_registry("weight_formats")
    for name in formats.names():
        if formats[name].detect(path):
            return formats[name]
    known = ", ".join(formats.names()) or "none"
    raise CheckpointError(f"no registered weight format reads this ({known} registered)",
                          file=Path(path),
                          hint="a HF checkpoint folder holds model.safetensors or its .index.json")


def from_pretrained(path: str | Path, *, backend: str = "numpy", dtype: str = "float32", mode: str = "full",
                    recompute: str = "none", **model_kwargs: Any) -> PretrainedModel:
    """Load a HF checkpoint folder (``config.json`` + ``model.safetensors`` or a sharded index).

    The architecture in ``config.json`` must be one a registered DSL model declares (Llama, Qwen3,
    Qwen3-MoE in kiln's library); scaled RoPE (``linear``, ``dynamic``, ``yarn``, ``llama3``) becomes a
    frozen table parameter ``rope_freqs``. BF16/F16 weights are upcast to ``dtype`` exactly.
    ``model_kwargs`` go to :class:`~kiln.core.Model` (``seed``, ``optimizer``, ``recompute_budget``).

    Every key, shape and dtype is checked against the model's mappings before the model is allocated;
    bad files raise a :class:`~kiln.core.KilnError` naming the file and the tensor or key, and no model
    is returned. Tensors are read one at a time from memory maps into the model's arena.
    """
    folder = Path(path)
    config, file = read_config(folder)
    bundle, arch = compile_config(config, file)
    entries = weight_entries(bundle)
    with weight_format(folder).open(folder) as ckpt:
        weights = resolve(ckpt, entries)
        model = PretrainedModel(bundle, hf_config=config, architecture=arch, weights=weights, backend=backend,
                                dtype=dtype, mode=mode, recompute=recompute, **model_kwargs)
        specs = model.parameter_specs()
        for param in dict.fromkeys(p.param for p in weights.pieces if not p.absent):  # one at a time
            view = model.host_view(param)  # host memory: read straight into the arena
            value = view if view is not None else np.zeros(specs[param][1], model.dtype)
            weights.load(ckpt, {param: value}, only=param)
            if view is None:
                model.set_parameters({param: value})
    _initialise_absent(model, [e for e in entries if e.param in weights.absent])
    if ROPE_PARAM in model.parameter_specs():
        m = bundle.module(bundle.entry)
        rows = model.parameter_specs()[ROPE_PARAM][1][0]
        model.set_parameters({ROPE_PARAM: rope_table(with_defaults(config, arch), rows,
                                                     head_dim=m.config.get("head_size"))})
    return model


class _Parameters(Mapping[str, np.ndarray]):
    """A model's parameters by name, each copied to the host when asked for (export one at a time)."""

    def __init__(self, model: Model) -> None:
        self.model, self.names = model, list(model.parameter_specs())
        self.known = set(self.names)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.known:
            raise KeyError(name)
        return self.model.parameter(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def _initialise_absent(model: PretrainedModel, entries: list[Entry]) -> None:
    """Optional weights the checkpoint lacks start from their declared init, drawn from the model's seed."""
    rng = np.random.default_rng(model.seed)
    std = float(model.hf_config.get("initializer_range", 0.02))
    for e in entries:
        value = init_value(e.init, e.shape, rng, std, e.param)
        model.set_parameters({e.param: value})
