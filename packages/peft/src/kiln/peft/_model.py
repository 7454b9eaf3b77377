"""``PeftModel``: a kiln Model whose projections carry LoRA adapters, saved and loaded as PEFT does."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kiln.core import KilnError, Model, init_value
from kiln.core.ir import Bundle
from kiln.peft import _safetensors
from kiln.peft._config import ALL_LINEAR, LoraConfig
from kiln.peft._errors import AdapterError
from kiln.peft._ia3 import IA3Config, IA3Site, apply_ia3
from kiln.peft._lora import Site, apply, init_spec

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


def _bundle(model: Model) -> Bundle:
    ir = model.ir
    if isinstance(ir, Bundle):
        return ir
    return Bundle((ir, *(m for m in (model.modules or {}).values() if m.name != ir.name)), entry=ir.name)


class PeftModel(Model):
    """A kiln :class:`~kiln.core.Model` with LoRA adapters: the Model API, with adapters under PEFT's names.

    Made by :func:`get_peft_model` or :meth:`from_pretrained`. It trains in LoRA mode (recompute slots
    with a ``lora_only`` policy are recomputed, ``fft_only`` ones saved): only the adapters have
    gradients and optimizer state. LoRA dropout applies in training (``loss_and_grads``,
    ``train_step``, ``loss(training=True)``) and not in ``loss`` or ``logits``, as in PEFT's train and
    eval modes. ``loss_and_grads``
    keys gradients by PEFT's file names (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``);
    ``parameters()`` and ``set_parameters()`` keep kiln's names (``blocks.0.qkv_weight.q.lora_A``).

    The base model given is kept (``get_base_model()``) with its weights as they were; the PEFT model
    holds its own copy of them, so both take memory until the base model is dropped.
    """

    def __init__(self, model: Model, config: LoraConfig | IA3Config, *, is_trainable: bool = True,
                 seed: int = 0, **options: Any) -> None:
        if isinstance(model, PeftModel):
            raise AdapterError("the model already has adapters; merge_and_unload() it first")
        if not isinstance(model, Model):
            raise KilnError(f"expected a kiln.core.Model, found {type(model).__name__}")
        if isinstance(config, IA3Config):
            bundle, sites = apply_ia3(_bundle(model), config, trainable=is_trainable)
        elif isinstance(config, LoraConfig):
            bundle, sites = apply(_bundle(model), config, trainable=is_trainable)
        else:
            raise KilnError(f"expected a kiln.peft.LoraConfig or IA3Config, found {type(config).__name__}")
        self.sites: list[Any] = list(sites)
        self.peft_config = {"default": config}
        self._base = model
        self._names = {kiln: peft for s in self.sites for kiln, peft, _ in s.tensors()}
        options = {"dtype": model.dtype, "optimizer": model.optimizer, "backend": model.backend_name,
                   "recompute": model.recompute, "recompute_budget": model.recompute_budget,
                   "data_parallel": model.data_parallel, "passes": model.passes, **options}
        super().__init__(bundle, seed=seed, mode="lora", init=None, **options)
        self.set_parameters(model.parameters())
        self._draw_adapters(seed)

    def _draw_adapters(self, seed: int) -> None:
        """Draw the adapters as PEFT initialises them."""
        rng = np.random.default_rng(seed)
        config = self.peft_config["default"]
        if isinstance(config, IA3Config):  # ones, or (init_ia3_weights=False) standard normal as PEFT draws
            spec = {"kind": "ones"} if config.init_ia3_weights else {"kind": "normal", "std": 1.0}
            shapes = self.parameter_specs()
            self.set_parameters({key: init_value(spec, shapes[key][1], rng, 0.0, key)
                                 for s in self.sites for key, _, _ in s.tensors()})
            return
        self.set_parameters({key: init_value(init_spec(config, s, ab), s.shape(ab), rng, 0.0, key)
                             for s in self.sites for key, _, ab in s.tensors()})

    @classmethod
    def from_pretrained(cls, model: Model, model_id: str | Path, *, is_trainable: bool = False,
                        **options: Any) -> PeftModel:
        """``model`` with the adapter saved in folder ``model_id`` (``adapter_config.json`` and
        ``adapter_model.safetensors``, by kiln or by PEFT). As in PEFT, the adapter is frozen unless
        ``is_trainable``. A bad adapter (a target the model lacks, a missing tensor, a wrong rank)
        raises an :class:`AdapterError` naming the file and the key."""
        folder = Path(model_id)
        config_file, weights_file = folder / CONFIG_NAME, folder / WEIGHTS_NAME
        try:
            data = json.loads(config_file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise AdapterError("not found: an adapter folder holds adapter_config.json and "
                               "adapter_model.safetensors", file=config_file) from None
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise AdapterError(f"cannot be read: {exc}", file=config_file) from None
        ia3 = isinstance(data, Mapping) and data.get("peft_type") == "IA3"
        config = (IA3Config if ia3 else LoraConfig).from_dict(data, file=config_file)
        try:
            peft = cls(model, config, is_trainable=is_trainable, **options)
        except AdapterError as exc:
            if exc.file is not None:
                raise
            raise AdapterError(exc.detail, file=config_file, key=exc.key, hint=exc.hint) from None
        if not weights_file.exists() and (folder / "adapter_model.bin").exists():
            raise AdapterError("kiln reads adapters in safetensors only (this folder has the pickled "
                               "adapter_model.bin)", file=weights_file,
                               hint="save it again with PEFT's save_pretrained(safe_serialization=True)")
        peft.load_adapter_state_dict(_safetensors.read(weights_file), file=weights_file)
        return peft

    # -- adapters under PEFT's names

    def adapter_state_dict(self) -> dict[str, np.ndarray]:
        """Copies of the adapter weights, by PEFT file name."""
        shapes = {kiln: s.shape(ab) for s in self.sites for kiln, _, ab in s.tensors()}
        return {peft: self.parameter(kiln).reshape(shapes[kiln]) for kiln, peft in self._names.items()}

    def load_adapter_state_dict(self, tensors: Mapping[str, Any], *, file: str | Path | None = None) -> None:
        """Set every adapter weight from ``tensors`` (by PEFT file name). All keys and shapes are checked
        before anything is written: a missing or extra tensor, or one of the wrong shape (a rank other
        than the config's), raises an :class:`AdapterError` naming it and ``file``."""
        expected = {peft: (kiln, s.shape(ab), s) for s in self.sites for kiln, peft, ab in s.tensors()}
        for name in tensors:
            if name not in expected:
                raise AdapterError("adapts a module this model's LoRA config does not target", file=file,
                                   key=name, hint=f"the config targets {_modules(self.sites)}")
        for name, (_, shape, s) in expected.items():
            if name not in tensors:
                raise AdapterError("is missing: the adapter config targets this module", file=file, key=name)
            found = tuple(np.shape(tensors[name]))
            if found != shape:
                what = "IA3" if isinstance(s, IA3Site) else f"r={s.r}"
                raise AdapterError(f"is {list(found)}; with {what} and the model's {s.size} x "
                                   f"{s.in_features} weight kiln expects {list(shape)}", file=file, key=name)
        own = self.parameter_specs()
        self.set_parameters({kiln: np.reshape(tensors[name], own[kiln][1])
                             for name, (kiln, _, _) in expected.items()})

    def loss_and_grads(self, input_ids: Any, labels: Any, *, attention_mask: Any = None,
                       position_ids: Any = None, names: str = "peft") -> tuple[float, dict[str, np.ndarray]]:
        """The mean loss and the adapter gradients, keyed by PEFT file name (``names="kiln"``: by kiln
        parameter). Base weights are frozen: they have none."""
        if names not in ("peft", "kiln"):
            raise KilnError(f"names={names!r} is not valid; expected 'peft' or 'kiln'")
        loss, grads = super().loss_and_grads(input_ids, labels, attention_mask=attention_mask,
                                             position_ids=position_ids)
        return loss, grads if names == "kiln" else {self._names[k]: g for k, g in grads.items()}

    def save_pretrained(self, save_directory: str | Path) -> list[Path]:
        """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into the folder, as PEFT does
        (``peft.PeftModel.from_pretrained`` reads them). Returns the files written."""
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        config = self.peft_config["default"]
        name = getattr(self._base, "hf_config", {}).get("_name_or_path")
        extra: dict[str, Any] = {"base_model_name_or_path": name}
        if isinstance(config, LoraConfig) and config.target_modules == ALL_LINEAR:  # as PEFT resolves it
            extra["target_modules"] = sorted({p.rsplit(".", 1)[-1] for s in self.sites for p in s.paths})
        _safetensors.write(folder / WEIGHTS_NAME, self.adapter_state_dict())
        text = json.dumps(config.to_dict(**extra), indent=2) + "\n"
        (folder / CONFIG_NAME).write_text(text, encoding="utf-8")
        return [folder / CONFIG_NAME, folder / WEIGHTS_NAME]

    # -- the base model

    def get_base_model(self) -> Model:
        """The model the adapters were added to, with its weights as they were."""
        return self._base

    def merge_and_unload(self) -> Model:
        """The base model with every adapter merged into its weights (``W[rows] += scaling * B @ A``,
        from this model's own copy of the base weights, so merging twice gives the same result)."""
        merged: dict[str, np.ndarray] = {}
        for s in self.sites:
            for i in range(len(s.paths)):
                key = s.weight_key(i)
                w = merged.setdefault(key, self.parameter(key))
                if isinstance(s, IA3Site):  # W * l: its rows, or (feed-forward) its columns
                    scale = self.parameter(s.key(i))
                    if s.feedforward:
                        w *= scale[None, :]
                    else:
                        w[s.start:s.start + s.size] *= scale[:, None]
                    continue
                a, b = self.parameter(s.key(i, "A")), self.parameter(s.key(i, "B"))
                w[s.start:s.start + s.size] += (b @ a) * s.scaling
        self._base.set_parameters(merged)
        return self._base

    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        """(trainable parameters, all parameters), as PEFT counts them."""
        trainable = self.trainable
        sizes = [(int(np.prod(shape)), trainable[k]) for k, (_, shape) in self.parameter_specs().items()]
        return sum(n for n, t in sizes if t), sum(n for n, _ in sizes)

    def print_trainable_parameters(self) -> None:
        trainable, total = self.get_nb_trainable_parameters()
        print(f"trainable params: {trainable:,d} || all params: {total:,d} || "
              f"trainable%: {100 * trainable / max(total, 1):.4f}")


def _modules(sites: list[Site]) -> str:
    return ", ".join(sorted({p.rsplit(".", 1)[-1] for s in sites for p in s.paths}))


def get_peft_model(model: Model, peft_config: LoraConfig | IA3Config, **options: Any) -> PeftModel:
    """``model`` with the LoRA (or IA³) adapters ``peft_config`` describes, freshly initialised.

    ``options`` go to the :class:`PeftModel` (``seed`` of the adapters' initialisation, ``optimizer``,
    ``recompute``, ``recompute_budget``); by default it takes the base model's.
    """
    return PeftModel(model, peft_config, **options)
