"""``kiln train``: a TOML config checked as a whole before any work, the training loop and its outputs.

A run writes into ``train.output_dir``: ``tokenizer/``, ``metrics.jsonl`` (one JSON object per step),
``checkpoints/step-<n>/`` (see ``_checkpoint``), ``loss.png`` and, at the end, ``model/`` (a HF
checkpoint folder with the tokenizer) or, in LoRA mode, ``adapter/`` (a PEFT adapter folder).
docs/training.md describes every key; a test keeps it in step with ``SCHEMA``.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import textwrap
import threading
import time
import tomllib
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import attrs
import numpy as np

from kiln.core import KilnError, get_registry
from kiln.hf import _checkpoint
from kiln.hf._data import IGNORE_INDEX
from kiln.hf._errors import DataError
from kiln.hf._progress import Progress, duration
from kiln.hf._tracking import TRACKERS, open_trackers

#: DSL constructor arguments per size; the DSL ignores those a model does not take
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"d_model": 64, "n_layers": 2, "num_query_heads": 4, "num_kv_heads": 2, "head_size": 16,
             "d_ff": 192, "moe_d_ff": 96},
    "small": {"d_model": 128, "n_layers": 4, "num_query_heads": 4, "num_kv_heads": 2, "head_size": 32,
              "d_ff": 384, "moe_d_ff": 192},
    "base": {"d_model": 256, "n_layers": 6, "num_query_heads": 8, "num_kv_heads": 4, "head_size": 32,
             "d_ff": 768, "moe_d_ff": 384},
}
_COMMON = {"tie_word_embeddings": True, "rope_theta": 10000.0, "num_experts": 4, "num_experts_per_tok": 2}
#: the positions a from-scratch model declares (HF's max_position_embeddings) unless train.seq_len is longer
MAX_SEQ = 2048
#: keys a resumed run may change; any other change is refused
_RESUMABLE = ("train.output_dir", "train.steps", "train.eval_every", "train.eval_batches",
              "train.checkpoint_every", "train.keep_last", "train.keep_best", "train.log_every",
              "train.report_to", "parallel.zero", "parallel.tensor", "parallel.ranks",
              "parallel.overlap")
#: ``kiln train``'s exit codes for data errors and non-finite values (a config error exits 2, as every
#: other KilnError; docs/training.md lists them all)
EXIT_DATA, EXIT_NONFINITE = 3, 4


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainConfigError(KilnError):
    """A ``kiln train`` config value that is unknown, of the wrong type, out of range or a missing file.

    ``key`` is the dotted key at fault (``"train.steps"``), a section, or ``None`` for the whole file.
    """

    def __init__(self, message: str, *, key: str | None = None, file: str | Path | None = None,
                 **kw: Any) -> None:
        self.key, self.file = key, None if file is None else str(file)
        where = ": ".join(p for p in (self.file, key) if p)
        super().__init__(f"{where}: {message}" if where else message, **kw)


class TrainingError(KilnError):
    """A run that cannot go on: a non-finite loss, gradient or weight (naming the step)."""

    exit_code = EXIT_NONFINITE


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped a run at once (at start-up, or a second time while training):
    ``exit_code`` is 128 + the signal's number, ``message`` says what is left to resume from."""

    def __init__(self, signum: int, message: str = "") -> None:
        super().__init__(message)
        self.signum, self.message, self.exit_code = signum, message, 128 + signum


# -- the schema

REQUIRED: Any = object()
Check = tuple[Callable[[Any], bool], str]


@attrs.frozen
class Key:
    """One config key: its kind, its default, and its valid values (a list, or a check and its text)."""

    kind: str  # int | float | str | bool | path | paths | table | budget | targets
    default: Any = None
    choices: Sequence[str] | Callable[[], Sequence[str]] | None = None
    check: Check | None = None

    def valid(self) -> Sequence[str] | None:
        return self.choices() if callable(self.choices) else self.choices


def _at_least(n: float) -> Check:
    return (lambda v: v >= n), f">= {n}"


def _above(n: float) -> Check:
    return (lambda v: v > n), f"> {n}"


def _within(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = True) -> Check:
    text = f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    return (lambda v: (lo < v if lo_open else lo <= v) and (v < hi if hi_open else v <= hi)), text


def _models() -> list[str]:
    """The DSL models that declare a HF architecture (so that a run can export them)."""
    from kiln.dsl import get_model_spec, list_registered_models

    return [n for n in list_registered_models() if get_model_spec(n).hf_config is not None]


def _registered(kind: str) -> list[str]:
    from kiln.core import get_registry

    return get_registry(kind).names()


def _recompute_modes() -> Sequence[str]:
    from kiln.core.recompute import MODES

    return MODES


SCHEMA: dict[str, dict[str, Key]] = {
    "model": {
        "name": Key("str", choices=_models),
        "size": Key("str", "tiny", tuple(PRESETS)),
        "config": Key("table", {}),
        "checkpoint": Key("path"),
        "seed": Key("int", 0, check=_at_least(0)),
    },
    "data": {
        "files": Key("paths", REQUIRED),
        "tokenizer": Key("path"),
        "vocab_size": Key("int", 1024, check=_at_least(257)),
        "format": Key("str", "text", ("text", "completion", "alpaca", "chat")),
        "fields": Key("table", {}),
        "roles": Key("table", {}),
        "chat_template": Key("str", ""),
        "train_on_prompt": Key("bool", False),
        "too_long": Key("str", "truncate", ("truncate", "drop")),
        "separator": Key("str", ""),
        "packing": Key("bool", True),
        "ignore_index": Key("int", IGNORE_INDEX),
        "validation_fraction": Key("float", 0.1, check=_within(0.0, 1.0, lo_open=True)),
        "seed": Key("int", 0, check=_at_least(0)),
    },
    "train": {
        "output_dir": Key("path"),
        "mode": Key("str", "full", ("full", "lora")),
        "backend": Key("str", "numpy", lambda: _registered("backends")),
        "steps": Key("int", 100, check=_at_least(1)),
        "batch_size": Key("int", 8, check=_at_least(1)),
        "grad_accum_steps": Key("int", 1, check=_at_least(1)),
        "seq_len": Key("int", 64, check=_at_least(1)),
        "recompute": Key("str", "dsl", _recompute_modes),
        "memory_budget": Key("budget"),
        "precision": Key("str", "fp32", ("fp32", "bf16")),
        "eval_every": Key("int", 50, check=_at_least(0)),
        "eval_batches": Key("int", 8, check=_at_least(1)),
        "checkpoint_every": Key("int", 50, check=_at_least(0)),
        "keep_last": Key("int", 2, check=_at_least(1)),
        "keep_best": Key("int", 0, check=_at_least(0)),
        "log_every": Key("int", 10, check=_at_least(1)),
        "report_to": Key("names", [], tuple(TRACKERS)),
    },
    "optimizer": {
        "name": Key("str", "adamw", lambda: _registered("optimizers")),
        "lr": Key("float", 1e-3, check=_above(0)),
        "beta1": Key("float", 0.9, check=_within(0.0, 1.0)),
        "beta2": Key("float", 0.999, check=_within(0.0, 1.0)),
        "eps": Key("float", 1e-8, check=_above(0)),
        "weight_decay": Key("float", 0.0, check=_at_least(0)),
        "max_grad_norm": Key("float", 1.0, check=_at_least(0)),
        "warmup_steps": Key("int", 0, check=_at_least(0)),
        "schedule": Key("str", "cosine", ("cosine", "linear", "constant")),
        "min_lr_ratio": Key("float", 0.1, check=_within(0.0, 1.0, hi_open=False)),
        "momentum": Key("float", 0.0, check=_within(0.0, 1.0)),
        "nesterov": Key("bool", False),
        "decay_norms_and_biases": Key("bool", False),
        "groups": Key("groups", None),
    },
    "parallel": {
        "zero": Key("bool", False),
        "overlap": Key("bool", False),
        "tensor": Key("int", 1, check=_at_least(1)),
        "ranks": Key("int", None, check=_at_least(1)),
    },
    "lora": {
        "r": Key("int", 8, check=_at_least(1)),
        "lora_alpha": Key("float", 16.0, check=_above(0)),
        "lora_dropout": Key("float", 0.0, check=_within(0.0, 1.0)),
        "target_modules": Key("targets", "all-linear"),
        "use_rslora": Key("bool", False),
    },
}
_KINDS = {"int": "an int", "float": "a number", "str": "a string", "bool": "true or false", "path": "a path",
          "paths": "a path or a list of paths", "table": "a table",
          "groups": "a list of tables ([[optimizer.groups]] with params, roles, weight_decay, lr_scale)",
          "targets": "a string or a list of strings", "names": "a list of strings",
          "budget": "bytes (an int or a string such as \"64MiB\") or a fraction (0.5 or \"50%\")"}


# -- reading and checking a config


@attrs.frozen
class TrainConfig:
    """A checked config: every key of every section (defaults filled in, paths absolute).

    ``root`` is the folder relative paths start from (the config file's); ``given`` the sections and
    keys the file sets.
    """

    sections: Mapping[str, Mapping[str, Any]]
    file: Path | None = None
    given: Mapping[str, frozenset[str]] = attrs.field(factory=dict)
    root: Path = Path()

    def __getitem__(self, section: str) -> Mapping[str, Any]:
        return self.sections[section]

    def fingerprint(self) -> dict[str, Any]:
        """The values that define a run (all but those a resumed run may change), as JSON values; paths
        under ``root`` relative to it, so that a project folder moved or copied elsewhere resumes."""
        return {f"{s}.{k}": _jsonable(v, self.root) for s, keys in self.sections.items()
                for k, v in keys.items() if f"{s}.{k}" not in _RESUMABLE}

    def plan(self) -> tuple[Any, dict[str, Any]]:
        """What ``kiln plan CONFIG.toml`` plans: the IR of the model the run trains, and the settings of
        its training step: ``mode``, ``recompute``, ``budget``, ``batch``, ``seq``, ``backend``,
        ``optimizer``, ``precision`` and ``passes`` (in LoRA mode, the ``lora`` pass with the ``[lora]``
        table)."""
        from kiln.hf import load_tokenizer

        t, tokenizer = self["train"], self["data"]["tokenizer"]
        if self["model"]["checkpoint"] is not None:
            bundle = _checkpoint_ir(self)
        else:
            bundle = _scratch_bundle(self, None if tokenizer is None else
                                     load_tokenizer(tokenizer).get_vocab_size(with_added_tokens=True))
        return bundle, {"mode": t["mode"], "recompute": t["recompute"], "budget": t["memory_budget"],
                        "batch": t["batch_size"], "seq": t["seq_len"], "backend": t["backend"],
                        "optimizer": _optimizer(self, t["steps"]), "precision": t["precision"],
                        "passes": [("lora", dict(self["lora"]))] if t["mode"] == "lora" else [],
                        **_plan_parallel(self)}


def _jsonable(v: Any, root: Path | None = None) -> Any:
    """``v`` as JSON values; a path under ``root`` relative to it."""
    if isinstance(v, Path):
        return str(v.relative_to(root) if root is not None and v.is_relative_to(root) else v)
    if isinstance(v, (list, tuple)):
        return [_jsonable(x, root) for x in v]
    if isinstance(v, Mapping):
        return {k: _jsonable(x, root) for k, x in v.items()}
    if attrs.has(type(v)):  # a parameter group
        return _jsonable(attrs.asdict(v), root)
    return v


def _value(key: str, spec: Key, value: Any, base: Path, file: Path | None) -> Any:
    """``value`` checked against ``spec`` (paths made absolute and checked to exist)."""
    valid = spec.valid()

    def bad(message: str) -> TrainConfigError:
        return TrainConfigError(message, key=key, file=file,
                                hint=f"valid values: {', '.join(map(str, valid))}" if valid else None)

    kind = spec.kind
    wrong = bad(f"expected {_KINDS[kind]}, found {type(value).__name__} {value!r}")
    if isinstance(value, bool) != (kind == "bool") and kind != "budget":
        raise wrong
    if kind == "int" and not isinstance(value, int):
        raise wrong
    if kind == "float":
        if not isinstance(value, (int, float)):
            raise wrong
        value = float(value)
        if not math.isfinite(value):
            raise bad(f"must be finite, found {value}")
    if kind in ("str", "path") and not isinstance(value, str):
        raise wrong
    if kind == "table" and not isinstance(value, dict):
        raise wrong
    if kind == "groups":
        from kiln.core import ParamGroup

        if not isinstance(value, list) or not all(isinstance(g, dict) for g in value):
            raise wrong
        try:
            return [ParamGroup(**g) for g in value]
        except TypeError as e:
            raise bad(f"{e}; a group takes params, roles, weight_decay and lr_scale") from None
        except KilnError as e:
            raise bad(e.message) from None
    if kind == "names":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise wrong
        for v in value:
            _value(key, attrs.evolve(spec, kind="str"), v, base, file)
        return list(dict.fromkeys(value))
    if kind in ("paths", "targets"):
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
            raise wrong
        if not items:
            raise bad("must not be empty")
        if kind == "targets":
            return value if isinstance(value, str) else items
        paths = [(base / v).expanduser() for v in items]
        for p in paths:
            if not p.is_file():
                raise bad(f"file {str(p)!r} does not exist")
        return paths
    if kind == "path":
        return (base / value).expanduser()
    if kind == "budget":
        from kiln.core.recompute import parse_budget

        try:
            return parse_budget(value)
        except KilnError as e:
            raise bad(f"{e.message}; expected {_KINDS[kind]}") from None
    if valid is not None and value not in valid and not (key == "model.name" and _model_file_source(value)):
        close = difflib.get_close_matches(str(value), list(map(str, valid)), n=1)
        raise bad(f"{value!r} is not one of {', '.join(map(repr, valid))}"
                  + (f" (did you mean {close[0]!r}?)" if close else ""))
    if spec.check is not None and not spec.check[0](value):
        raise bad(f"must be {spec.check[1]}, found {value!r}")
    return value


def _unknown(key: str, known: Sequence[str], what: str, file: Path | None) -> TrainConfigError:
    close = difflib.get_close_matches(key.rpartition(".")[2], known, n=1)
    return TrainConfigError(f"unknown {what}" + (f" (did you mean {close[0]!r}?)" if close else ""), key=key,
                            file=file, hint=f"valid {what}s: {', '.join(known)}")


def load_train_config(source: str | Path | Mapping[str, Any], *,
                      base: str | Path | None = None) -> TrainConfig:
    """Read and check a ``kiln train`` config: a TOML file, or its content as a dict.

    Relative paths are relative to the config file's folder (for a dict: ``base``, by default the
    working directory). Raises :class:`TrainConfigError` naming the key at fault and, where they form a
    list, the valid values; the whole config is checked before anything is tokenized, trained or written.
    """
    file = None
    if isinstance(source, Mapping):
        data, root = dict(source), Path(base or ".").resolve()
    else:
        file = Path(source)
        try:
            data = tomllib.loads(file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise TrainConfigError("the config file does not exist", file=file) from None
        except (OSError, UnicodeDecodeError) as e:
            raise TrainConfigError(f"cannot read the config: {e}", file=file) from None
        except tomllib.TOMLDecodeError as e:
            raise TrainConfigError(f"not valid TOML: {e}", file=file) from None
        root = Path(base) if base is not None else file.resolve().parent
    for name, table in data.items():
        if name not in SCHEMA:
            raise _unknown(name, list(SCHEMA), "section", file)
        if not isinstance(table, dict):
            raise TrainConfigError(f"must be a table ([{name}]), found {type(table).__name__}", key=name,
                                   file=file)
    sections: dict[str, dict[str, Any]] = {}
    for name, keys in SCHEMA.items():
        table = data.get(name, {})
        for key in table:
            if key not in keys:
                raise _unknown(f"{name}.{key}", list(keys), "key", file)
        out = sections[name] = {}
        for key, spec in keys.items():
            if key in table:
                out[key] = _value(f"{name}.{key}", spec, table[key], root, file)
            elif spec.default is REQUIRED:
                raise TrainConfigError("is missing: it has no default", key=f"{name}.{key}", file=file)
            else:
                out[key] = spec.default
    if sections["train"]["output_dir"] is None:
        sections["train"]["output_dir"] = root / "runs" / (file.stem if file else "run")
    config = TrainConfig(sections, file, {name: frozenset(table) for name, table in data.items()}, root)
    _check_together(config)
    return config


def _check_together(config: TrainConfig) -> None:
    """Checks across keys, and those that need the model library, the files or kiln-peft: the model's
    config.json and weight files, the model built from scratch, the LoRA targets, the output folder."""
    file, model, data, t = config.file, config["model"], config["data"], config["train"]
    ckpt, tokenizer = model["checkpoint"], data["tokenizer"]
    if (model["name"] is None) == (ckpt is None):
        raise TrainConfigError("give either model.name (a model trained from scratch) or model.checkpoint "
                               "(a HF checkpoint folder)" + (", not both" if ckpt else ""),
                               key="model.checkpoint" if ckpt else "model.name", file=file,
                               hint=f"models: {', '.join(_models())}")
    if t["memory_budget"] is not None and t["recompute"] != "auto":
        raise TrainConfigError(f"applies only with train.recompute = \"auto\" (recompute is "
                               f"{t['recompute']!r}): the other planners take no budget",
                               key="train.memory_budget", file=file,
                               hint="set recompute = \"auto\", or remove memory_budget")
    _check_output_dir(t["output_dir"], file)
    _check_data(config)
    if ckpt is not None:
        if not (ckpt / "config.json").is_file():
            raise TrainConfigError(f"{str(ckpt)!r} is not a HF checkpoint folder (it has no config.json)",
                                   key="model.checkpoint", file=file)
        for key in ("size", "config"):
            if key in config.given.get("model", ()):
                raise TrainConfigError("applies to model.name only; a checkpoint's config.json sets the "
                                       "model", key=f"model.{key}", file=file)
        if tokenizer is None and not (ckpt / "tokenizer.json").is_file():
            raise TrainConfigError(f"is needed: the checkpoint {str(ckpt)!r} has no tokenizer.json, and a "
                                   "new tokenizer would not match its vocabulary", key="data.tokenizer",
                                   file=file)
        bundle = _checkpoint_ir(config)
    if tokenizer is not None and not (tokenizer.is_file() or (tokenizer / "tokenizer.json").is_file()):
        raise TrainConfigError(f"{str(tokenizer)!r} is neither a tokenizer.json nor a folder holding one",
                               key="data.tokenizer", file=file)
    if model["name"] is not None:
        bundle = _scratch_bundle(config, None)  # the DSL checks the model's config now
        try:  # and the run can export it: a dry run of the export over empty views
            from kiln.hf._pretrained import weight_entries

            _scratch_tensors(bundle, {e.param: np.broadcast_to(np.float32(0), e.shape)
                                      for e in weight_entries(bundle)})
        except KilnError as e:
            raise TrainConfigError(f"{model['name']} trained from scratch cannot be saved as a HF checkpoint "
                                   f"yet: {e.message}", key="model.name", file=file) from None
    if t["mode"] == "lora":
        if "lora" not in _registered("adapters"):
            raise TrainConfigError("LoRA training needs kiln-peft, which is not installed", key="train.mode",
                                   file=file, hint="pip install kiln-peft")
        _check_lora_targets(config, bundle)
    elif "lora" in config.given:
        raise TrainConfigError("the [lora] section applies only with train.mode = \"lora\"", key="lora",
                               file=file)


def _check_data(config: TrainConfig) -> None:
    """The ``[data]`` keys of instruction and chat data, and the trackers of ``train.report_to``."""
    from kiln.hf._chat import BUILTIN_TEMPLATES
    from kiln.hf._samples import FIELDS, ROLES
    from kiln.hf._tracking import TRACKERS, missing

    file, data, given = config.file, config["data"], config.given.get("data", frozenset())
    fmt = data["format"]
    absent = missing(config["train"]["report_to"])
    if absent:
        raise TrainConfigError(f"{absent[0]!r} needs {TRACKERS[absent[0]]}, which is not installed",
                               key="train.report_to", file=file, hint=f"pip install 'kiln-hf[{absent[0]}]'")
    only = {"fields": ("completion", "alpaca", "chat"), "train_on_prompt": ("completion", "alpaca", "chat"),
            "too_long": ("completion", "alpaca", "chat"), "roles": ("chat",), "chat_template": ("chat",),
            "separator": ("text",)}
    for key, formats in only.items():
        if key in given and fmt not in formats:
            raise TrainConfigError(f"applies only with data.format = {' or '.join(map(repr, formats))} "
                                   f"(format is {fmt!r})", key=f"data.{key}", file=file)
    if fmt == "text":
        return
    for key, value in data["fields"].items():
        if key not in FIELDS[fmt]:
            raise _unknown(f"data.fields.{key}", list(FIELDS[fmt]), f"field of the {fmt!r} format", file)
        if not isinstance(value, str):
            raise TrainConfigError(f"expected the name of a field, found {type(value).__name__} {value!r}",
                                   key=f"data.fields.{key}", file=file)
    for key, value in data["roles"].items():
        if value not in ROLES:
            raise TrainConfigError(f"{value!r} is not one of {', '.join(map(repr, ROLES))}",
                                   key=f"data.roles.{key}", file=file)
    for path in data["files"]:
        suffix = path.suffix.lower()
        if suffix not in (".jsonl", ".json", ".parquet"):
            raise TrainConfigError(f"{str(path)!r}: a {fmt!r} data file is JSONL (.jsonl) or Parquet "
                                   "(.parquet)", key="data.files", file=file)
        if suffix == ".parquet" and importlib.util.find_spec("pyarrow") is None:
            raise TrainConfigError(f"{str(path)!r}: reading Parquet needs pyarrow, which is not installed",
                                   key="data.files", file=file, hint="pip install 'kiln-hf[parquet]'")
    name = data["chat_template"]
    if fmt != "chat":
        return
    if name and name not in BUILTIN_TEMPLATES:
        close = difflib.get_close_matches(name, list(BUILTIN_TEMPLATES), n=1)
        raise TrainConfigError(f"{name!r} is not a built-in template" + (f" (did you mean {close[0]!r}?)"
                                                                          if close else ""),
                               key="data.chat_template", file=file,
                               hint=f"built-in templates: {', '.join(BUILTIN_TEMPLATES)}; leave it out to "
                                    "use the tokenizer's own")
    if not name and _template_source(config) is None:
        raise TrainConfigError("is needed: the tokenizer has no chat template of its own "
                               "(tokenizer_config.json or chat_template.jinja)", key="data.chat_template",
                               file=file,
                               hint=f"name a built-in template: {', '.join(BUILTIN_TEMPLATES)}")


def _tokenizer_folder(config: TrainConfig) -> Path | None:
    """The folder of the run's given tokenizer (``data.tokenizer`` or the checkpoint's), if any."""
    source = config["data"]["tokenizer"] or config["model"]["checkpoint"]
    if source is None:
        return None
    return source if source.is_dir() else source.parent


def _template_source(config: TrainConfig) -> str | None:
    """The chat template the config's tokenizer folder holds, if any."""
    from kiln.hf._chat import checkpoint_template

    folder = _tokenizer_folder(config)
    return None if folder is None else checkpoint_template(folder)


def _check_output_dir(out: Path, file: Path | None) -> None:
    """``out`` is a folder, or one the run can create (nothing is created now)."""
    if out.exists() and not out.is_dir():
        raise TrainConfigError(f"{str(out)!r} is a file, not a folder", key="train.output_dir", file=file)
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise TrainConfigError(f"{str(out)!r} cannot be created: {str(existing)!r} is a file",
                               key="train.output_dir", file=file)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise TrainConfigError(f"{str(out)!r} cannot be written: {str(existing)!r} is not writable by this "
                               "user", key="train.output_dir", file=file)


def _checkpoint_ir(config: TrainConfig) -> Any:
    """The IR of ``model.checkpoint`` from its config.json, once its weight files' headers are checked
    (a missing or truncated file is reported now, not after tokenizing)."""
    from kiln.hf import open_checkpoint
    from kiln.hf._pretrained import compile_config, read_config

    ckpt, file, seq = config["model"]["checkpoint"], config.file, config["train"]["seq_len"]
    try:  # the architecture and config.json, then every weight file's header against its size
        bundle = compile_config(*read_config(ckpt))[0]
        with open_checkpoint(ckpt):
            pass
    except KilnError as e:
        raise TrainConfigError(str(e), key="model.checkpoint", file=file) from None
    positions = bundle.module(bundle.entry).config.get("max_seq")
    if isinstance(positions, int) and seq > positions:
        raise TrainConfigError(f"{seq} is more than the {positions} positions of the checkpoint's model "
                               "(max_position_embeddings in its config.json)", key="train.seq_len", file=file,
                               hint=f"seq_len <= {positions}")
    return bundle


def _check_lora_targets(config: TrainConfig, bundle: Any) -> None:
    """The ``lora`` pass on the model's IR, so that a ``target_modules`` entry that matches nothing is
    reported before any weight is read, with the closest module name."""
    from kiln.core import get_registry

    try:
        get_registry("graph_passes")["lora"](bundle, _lora_config(config))
    except TrainConfigError:
        raise
    except KilnError as e:
        culprit = str(getattr(e, "key", ""))  # the entry; the adapter's hint lists the model's names
        close = difflib.get_close_matches(culprit, re.findall(r"\w+", e.hint or ""), n=1)
        raise TrainConfigError(e.message + (f" (did you mean {close[0]!r}?)" if close else ""),
                               key="lora.target_modules", file=config.file, hint=e.hint) from None


def _optimizer(config: TrainConfig, total_steps: int) -> Any:
    """The ``[optimizer]`` table as an optimizer: ``name`` picks a registered one (core's ``adamw``
    and ``sgd``, or a plugin's), which takes the settings it declares."""
    from kiln.core import HF_TRAINER_GROUPS, get_registry

    o = config["optimizer"]
    cls = get_registry("optimizers")[o["name"]]
    settings = {**o, "max_grad_norm": o["max_grad_norm"] or None, "total_steps": total_steps,
                "groups": o["groups"] if o["groups"] is not None else
                () if o["decay_norms_and_biases"] else HF_TRAINER_GROUPS}
    fields = {a.name for a in attrs.fields(cls)}
    return cls(**{k: v for k, v in settings.items() if k in fields})


def _lora_config(config: TrainConfig) -> Any:
    """The ``[lora]`` table as the configuration of the ``lora`` adapter (``kiln_register_adapters``)."""
    from kiln.core import get_registry

    try:
        return get_registry("adapters")["lora"].config(**config["lora"])
    except KilnError as e:
        key = getattr(e, "key", None)
        raise TrainConfigError(e.message, key=f"lora.{key}" if key else "lora", file=config.file,
                               hint=e.hint) from None


# -- the tokenizer and the data of a run (kiln train, kiln data)


def build_tokenizer(config: TrainConfig, say: Callable[[str], None]) -> tuple[Any, str]:
    """The run's tokenizer and its EOS token: ``data.tokenizer``, the checkpoint's, or a byte-level BPE
    tokenizer trained on the data (on the text of its records, with the tokens a built-in chat
    template needs)."""
    from kiln.hf import load_tokenizer, train_bpe_tokenizer

    data = config["data"]
    folder = _tokenizer_folder(config)
    if folder is not None:
        return load_tokenizer(data["tokenizer"] or folder), _eos_token(folder)
    start, eos = time.perf_counter(), _eos_token(None)
    if data["format"] == "text":
        for file in data["files"]:  # the tokenizers library reports bad bytes without naming the file
            _check_utf8(file)
        tok = train_bpe_tokenizer(data["files"], data["vocab_size"])
    else:
        from kiln.hf._chat import BUILTIN_TOKENS
        from kiln.hf._samples import read_records, record_text

        template = chat_template(config, eos)
        records = read_records(data["files"], data["format"], fields=data["fields"], roles=data["roles"])
        with tempfile.TemporaryDirectory(prefix="kiln-texts-") as tmp:
            texts = Path(tmp) / "texts.txt"
            texts.write_text("\n\n".join(record_text(r, template) for r in records), encoding="utf-8")
            tok = train_bpe_tokenizer([texts], data["vocab_size"],
                                      special_tokens=(eos, *BUILTIN_TOKENS.get(data["chat_template"], ())))
    say(f"tokenizer: byte-level BPE, {tok.get_vocab_size()} tokens, trained on {len(data['files'])} file(s) "
        f"in {time.perf_counter() - start:.1f}s")
    return tok, eos


def chat_template(config: TrainConfig, eos: str) -> Any:
    """The :class:`~kiln.hf.ChatTemplate` of a ``chat`` run (None for other formats): the built-in one
    ``data.chat_template`` names, else the tokenizer's own; it sees the tokenizer's special tokens."""
    from kiln.hf._chat import BUILTIN_TEMPLATES, ChatTemplate, special_tokens, tokenizer_config

    name = config["data"]["chat_template"]
    if config["data"]["format"] != "chat":
        return None
    folder = _tokenizer_folder(config)
    specials = {**(special_tokens(tokenizer_config(folder)) if folder is not None else {}), "eos_token": eos}
    if name:
        return ChatTemplate(BUILTIN_TEMPLATES[name], specials=specials, name=f"chat template {name!r}")
    return ChatTemplate(_template_source(config) or "", specials=specials,
                        name=f"the chat template of {folder}")


def build_dataset(config: TrainConfig, tokenizer: Any, eos: str, template: Any,
                  cache_dir: Path | None) -> Any:
    """The run's dataset: a :class:`~kiln.hf.PackedDataset` of text, or a :class:`~kiln.hf.SampleDataset`
    of records, in batches of ``train.batch_size * train.grad_accum_steps`` rows."""
    from kiln.hf import PackedDataset, SampleDataset
    from kiln.hf._chat import BUILTIN_TOKENS

    data, t = config["data"], config["train"]
    common = {"seq_len": t["seq_len"], "batch_size": t["batch_size"] * t["grad_accum_steps"],
              "eos_token": eos, "seed": data["seed"], "validation_fraction": data["validation_fraction"],
              "drop_last": True, "packing": data["packing"], "ignore_index": data["ignore_index"]}
    if data["format"] == "text":
        return PackedDataset(data["files"], tokenizer, separator=data["separator"] or None,
                             cache_dir=cache_dir, **common)
    for token in BUILTIN_TOKENS.get(data["chat_template"], ()):
        if tokenizer.token_to_id(token) is None:
            raise TrainConfigError(f"the template {data['chat_template']!r} needs the token {token!r}, which "
                                   "the tokenizer does not have", key="data.chat_template", file=config.file,
                                   hint="choose a template whose tokens the tokenizer has (zephyr needs "
                                        "none)")
    return SampleDataset(data["files"], tokenizer, format=data["format"], template=template,
                         fields=data["fields"], roles=data["roles"], train_on_prompt=data["train_on_prompt"],
                         too_long=data["too_long"], **common)


def data_summary(config: TrainConfig, ds: Any) -> str:
    """What the data line of ``kiln train`` and ``kiln data`` says about a dataset."""
    data, t = config["data"], config["train"]
    batches = (f"{ds.num_sequences:,} training sequences of {t['seq_len']} ({len(ds):,} batches of "
               f"{t['batch_size']} per epoch), {ds.validation().num_sequences:,} held out")
    if data["format"] == "text":
        how = "documents packed" if data["packing"] else "one document per sequence"
        return (f"{len(ds.tokens):,} tokens in {len(data['files'])} file(s), {batches}; {how}: "
                f"{ds.efficiency:.1%} of the positions hold tokens")
    s = ds.stats
    dropped = s["dropped_too_long"] + s["dropped_untrained"]
    how = "samples packed" if data["packing"] else "one sample per sequence"
    return (f"{s['records']:,} {data['format']} records in {len(data['files'])} file(s): {s['samples']:,} "
            f"samples of {s['min_tokens']}-{s['max_tokens']} tokens ({s['truncated']} truncated to seq_len, "
            f"{dropped} dropped), {s['tokens']:,} tokens, {s['trained_tokens'] / s['tokens']:.0%} of them "
            f"trained; {batches}; {how}: {ds.efficiency:.1%} of the positions hold tokens")


# -- models trained from scratch


def _model_file_source(name: str) -> Any:
    """The model source that reads ``model.name`` as a model file and gives its kiln-dsl class
    (kiln-dsl-text: ``FILE.kiln`` or ``FILE.kiln:Model``), or None for a registered model's name."""
    sources = get_registry("model_sources")
    for key in sources:
        source = sources[key]
        if callable(getattr(source, "model_class", None)) and source.claims(name):
            return source
    return None


def _model_ref(config: TrainConfig) -> Any:
    """What kiln-dsl compiles for ``model.name``: the registered model's name, or the class of a model
    file (relative to the config's folder)."""
    name, file = config["model"]["name"], config.file
    source = _model_file_source(name)
    if source is None:
        return name
    try:
        return source.model_class(name, Path(file).parent if file is not None else Path.cwd())
    except KilnError as e:
        raise TrainConfigError(f"the model file does not compile: {e}", key="model.name", file=file) from None


def _scratch_bundle(config: TrainConfig, vocab_size: int | None) -> Any:
    """The IR of ``model.name``: its size preset, then ``model.config``; the vocabulary the tokenizer's."""
    from kiln.dsl import build_bundle

    model, seq, file = config["model"], config["train"]["seq_len"], config.file
    given = dict(model["config"])
    from kiln.dsl import config_keys, config_type_errors, unknown_config_keys

    ref = _model_ref(config)
    for key, close in unknown_config_keys(ref, given):
        takes = ", ".join(config_keys(ref) or [])
        raise TrainConfigError(f"is not a config key of {model['name']}"
                               + (f" (did you mean {close!r}?)" if close else ""), key=f"model.config.{key}",
                               file=file, hint=f"{model['name']} takes {takes}")
    for key, value, expected in config_type_errors(ref, given):
        raise TrainConfigError(f"expected {expected}, found {type(value).__name__} {value!r}",
                               key=f"model.config.{key}", file=file)
    vocab = vocab_size or config["data"]["vocab_size"]
    if vocab_size is not None and given.get("vocab_size", vocab) < vocab:
        raise TrainConfigError(f"{given['vocab_size']} is below the tokenizer's {vocab} tokens",
                               key="model.config.vocab_size", file=file)
    if given.get("max_seq", seq) < seq:
        raise TrainConfigError(f"{given['max_seq']} is below train.seq_len = {seq}",
                               key="model.config.max_seq", file=file)
    try:
        return build_bundle(ref, {**_COMMON, **PRESETS[model["size"]], "vocab_size": vocab,
                                            "max_seq": max(seq, MAX_SEQ), **given})
    except KilnError as e:
        raise TrainConfigError(f"model {model['name']!r} ({model['size']}) does not compile with this "
                               f"config: {e.message}", key="model.config", file=file,
                               hint="; ".join(str(d) for d in e.diagnostics) or e.hint) from None


def hf_config_of(bundle: Any) -> dict[str, Any]:
    """The HF ``config.json`` of a DSL model's IR: its ``@hf_config`` mapping applied in reverse."""
    model = bundle.module(bundle.entry)
    decl, cfg = model.hf_config, model.config
    out: dict[str, Any] = {"architectures": [decl["architecture"]], "model_type": decl["model_type"],
                           "hidden_act": "silu", "torch_dtype": "float32"}
    for arg, key in {"tie_word_embeddings": "tie_word_embeddings", **decl["param_mapping"]}.items():
        if cfg.get(arg) is not None:
            *parents, leaf = str(key).split(".")
            node = out
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = json.loads(json.dumps(_jsonable(cfg[arg])))
    return out


def _generation_config(folder: Path, eos_id: int | None) -> None:
    """What ``generate`` reads: the eos (and, if the model has one, pad) token id in ``config.json``
    and a ``generation_config.json``, as transformers writes them."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    ids = {k: v for k, v in (("eos_token_id", eos_id), ("pad_token_id", config.get("pad_token_id")))
           if v is not None}
    for key, value in ids.items():
        config.setdefault(key, value)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    generation = {**{k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config},
                  "_from_model_config": True}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")


def _scratch_tensors(bundle: Any, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The HF tensors of a model built from the DSL: its weight mappings inverted. A fused tensor is
    cut along the parameter's LoRA-target slices, which the DSL declares for its sources, in order."""
    from kiln.core.ir import parse_dim
    from kiln.hf._pretrained import weight_entries

    specs = {p.name: p for m in bundle.modules for p in m.params}
    out: dict[str, np.ndarray] = {}

    def emit(spec: Any, arr: np.ndarray, entry: Any) -> None:
        if isinstance(spec, str):
            out[spec.removeprefix("?")] = arr  # a view: the writer copies it out
            return
        kind, dim = spec.get("type"), spec.get("dim", 0)
        if kind == "transform":
            emit(spec["source"], arr.swapaxes(-1, -2), entry)
        elif kind == "fuse":
            targets = specs[entry.param.rpartition(".")[2]].lora_targets
            if len(targets) != len(spec["sources"]) or any(t.dim != dim or t.size is None for t in targets):
                raise KilnError(f"kiln parameter {entry.param!r}: the sizes of the fused tensors "
                                f"{list(spec['sources'])} are not declared, so it cannot be exported")
            sizes = [parse_dim(t.size).evaluate(entry.ints) for t in targets]
            parts = np.split(arr, np.cumsum(sizes)[:-1], axis=dim)
            for source, part in zip(spec["sources"], parts, strict=True):
                emit(source, part, entry)
        elif kind == "stack_experts":  # [experts, rows, cols]: one tensor per expert ([gate | up] split)
            pattern, up = spec["pattern"], spec.get("up_pattern")
            each = [(str(i), arr[i]) for i in range(arr.shape[0])] if "{expert}" in pattern else [("", arr)]
            for i, part in each:
                if spec.get("fuse_gate_up") and up is not None:
                    half = part.shape[-2] // 2
                    emit(pattern.replace("{expert}", i), part[..., :half, :], entry)
                    emit(up.replace("{expert}", i), part[..., half:, :], entry)
                else:
                    emit(pattern.replace("{expert}", i), part, entry)
        elif kind != "tied_to":  # a tied parameter is written through its target
            raise KilnError(f"kiln parameter {entry.param!r}: exporting a {kind!r} weight mapping of a model "
                            "trained from scratch is not supported")

    for entry in weight_entries(bundle):
        emit(entry.mapping, params[entry.param], entry)
    return out


def save_pretrained(model: Any, path: str | Path) -> list[Path]:
    """Write a kiln :class:`~kiln.core.Model` built from a kiln-dsl model that declares a HF architecture
    (``@hf_config``) as a HF checkpoint folder: ``config.json`` and float32 ``model.safetensors``,
    which ``transformers``' ``from_pretrained`` (and kiln's) read. The DSL's weight mappings are applied
    in reverse (fused tensors split, stacked experts written one per expert). A model that has its
    own ``save_pretrained`` (loaded by :func:`from_pretrained`; a PEFT model, whose adapter it writes)
    saves itself. Returns the files written."""
    folder = Path(path)
    if hasattr(model, "save_pretrained"):
        written: list[Path] = model.save_pretrained(folder, **({} if hasattr(model, "peft_config") else
                                                              {"dtype": "float32"}))
        return written
    bundle = model.ir
    entry = bundle.module(bundle.entry) if hasattr(bundle, "entry") else bundle
    if not getattr(entry, "hf_config", None):
        raise KilnError(f"model {entry.name!r} declares no HF architecture (kiln-dsl's @hf_config), so it "
                        "has no HF checkpoint layout")
    from kiln.core import get_registry

    tensors = _scratch_tensors(bundle, model.parameters())
    files = get_registry("weight_formats")["safetensors"].save(folder, tensors)
    (folder / "config.json").write_text(json.dumps(hf_config_of(bundle), indent=2) + "\n", encoding="utf-8")
    return [*files, folder / "config.json"]



# -- reports


def _count(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def plan_summary(model: Any, batch: int, seq: int) -> str:
    """The recompute plan and the planned memory of ``model``'s training Program for one shape."""
    prog = model.program(batch, seq)
    plan = prog.recompute
    return "\n".join([f"recompute {plan.mode!r} ({plan.training} training), planned by {plan.planner} in "
                      f"{plan.seconds * 1e3:.0f} ms for batches of {batch} x {seq} tokens:", plan.table(),
                      "planned memory:", textwrap.indent(prog.memory_table(), "  ")])


def replay_step(model: Any, batch: Mapping[str, Any], parameters: Mapping[str, np.ndarray],
                step: int = 1) -> Iterator[tuple[Any, str, np.ndarray]]:
    """Replay training step number ``step`` op by op, from ``parameters``, in the order of its Program,
    with the ops' reference kernels and a fresh array per tensor (random ops draw the masks that step
    drew): ``(program step, tensor name, value)`` for every output of the forward and backward.
    Raises KeyError naming a tensor the replay has no value for."""
    from kiln.core import counter_offset, op_registry, segment_ids

    ids, labels = np.asarray(batch["input_ids"]), np.asarray(batch["labels"])
    prog, registry = model.program(*ids.shape), op_registry()
    tensors, env = prog.tensors, dict(parameters)
    mask = (labels != model.ignore_index).astype(np.float64)
    positions = batch.get("position_ids", np.arange(ids.shape[1]))
    feeds = {"token_ids": ids, "targets": labels, "position_ids": positions,
             "segment_ids": segment_ids(batch.get("attention_mask"), batch.get("position_ids"), ids.shape),
             "d_loss": mask / max(mask.sum(), 1)}
    for name, value in feeds.items():
        if name in tensors:
            arr, shape = np.asarray(value).astype(tensors[name].dtype), tensors[name].shape
            # position ids: [T] for every row, or one row per sequence
            env[name] = arr.reshape(shape) if arr.size == math.prod(shape) else np.broadcast_to(arr, shape)
    for st in prog.steps:
        if st.phase == "optimizer":
            return
        ins = [env[k] if k else None for k in st.inputs]
        if st.how in ("alias", "copy"):
            outs: Sequence[Any] = [np.reshape(ins[0], tensors[st.outputs[0]].shape)]
        else:
            op, attrs = registry.get_op(st.op.type), dict(st.attrs)
            if op.random and "offset" in attrs:
                attrs["offset"] = counter_offset(int(attrs["offset"]), st.layer or 0, step)
            res = op.kernel(*ins, **attrs)
            outs = res if isinstance(res, (tuple, list)) else (res,)
        for key, value in zip(st.outputs, outs, strict=False):
            if key:
                env[key] = np.asarray(value)
                yield st, key, env[key]


def first_nonfinite(model: Any, batch: Mapping[str, Any], parameters: Mapping[str, np.ndarray],
                    step: int = 1) -> str:
    """Replay training step ``step`` (:func:`replay_step`); name the first op whose output is not finite,
    or the weight that was not finite before the step (an earlier optimizer update made it so)."""
    for name, value in parameters.items():
        bad = value.size - int(np.isfinite(value).sum())
        if bad:
            return (f"weight {name!r} was not finite before step {step} ({bad} of its {value.size} values): "
                    "an earlier step's optimizer update made it so, not an op of this step")
    replay = replay_step(model, batch, parameters, step)
    while True:
        try:
            st, key, arr = next(replay)
        except StopIteration:
            return "replaying the step op by op found no non-finite value in its forward and backward"
        except KeyError as e:
            return f"the replay stopped: no value for {e}"
        if np.issubdtype(arr.dtype, np.floating) and not np.isfinite(arr).all():
            layer = "" if st.layer is None else f", layer {st.layer}"
            bad = arr.size - int(np.isfinite(arr).sum())
            return (f"the first non-finite value comes from op {st.op.type!r} (program step "
                    f"{st.index}, {st.phase}{layer}): {bad} of the {arr.size} values of {key!r} are "
                    "NaN or infinite, while every input of the op is finite")


# -- the run


class _Metrics:
    """``metrics.jsonl``; resuming first cuts it back to the checkpoint's step."""

    def __init__(self, path: Path | None, keep_until: int, trackers: Sequence[Any] = ()) -> None:
        kept: list[dict[str, Any]] = []
        self.records, self.trackers = kept, trackers  # trackers get every record too
        self._file: TextIO | None = None
        if path is None:  # a data-parallel rank other than 0: records kept, nothing written
            return
        if path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                with contextlib.suppress(ValueError):  # a line a crash cut short
                    record = json.loads(line)
                    if isinstance(record, dict) and record.get("step", math.inf) <= keep_until:
                        kept.append(record)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        os.replace(tmp, path)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        for tracker in self.trackers:
            tracker.write(record)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        for tracker in self.trackers:
            tracker.close()


def _replace_dir(final: Path, fill: Callable[[Path], Any]) -> Path:
    """Fill a temporary folder, then put it in the place of ``final`` (removing an old one)."""
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    fill(tmp)
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)  # ``final`` is missing only between the two renames
    shutil.rmtree(old, ignore_errors=True)
    return final


def _eos_token(folder: Path | None) -> str:
    """The EOS token a ``tokenizer_config.json`` in ``folder`` names, else kiln's."""
    from kiln.hf import EOS_TOKEN

    with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
        eos = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("eos_token")  # type: ignore[operator]
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str):
            return eos
    return EOS_TOKEN


def _check_utf8(file: Path) -> None:
    """Raise :class:`DataError` naming ``file`` and the offset of its first byte that is not UTF-8."""
    import codecs

    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open(file, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                raise DataError(f"not UTF-8 text: {e.reason} at byte {offset + e.start}", file=file,
                                hint="save it as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
            if not chunk:
                return
            offset += len(chunk)


def _plan_parallel(config: TrainConfig) -> dict[str, Any]:
    """``[parallel]`` as ``kiln plan CONFIG.toml`` plans it: ``ranks`` (``parallel.ranks``, else the
    tensor-parallel degree: one group), ``tensor`` and ``zero``; nothing for a one-process run."""
    par = config["parallel"]
    ranks = par["ranks"] or (par["tensor"] if par["tensor"] > 1 else None)
    if ranks is None and par["zero"]:
        raise TrainConfigError("ZeRO-1 splits the optimizer state over the ranks: kiln plan needs their "
                               "number", key="parallel.zero", file=config.file,
                               hint="set parallel.ranks = N (or pass --ranks N)")
    if ranks is None or ranks == 1:
        return {}
    _check_parallel(config, ranks, f"parallel.ranks = {ranks}" if par["ranks"] else
                    "one tensor-parallel group")
    return {"ranks": ranks, "tensor": par["tensor"], "zero": par["zero"]}


def _check_parallel(config: TrainConfig, ranks: int, what: str) -> None:
    """``[parallel]`` against the number of ranks: the tensor-parallel degree divides them, the
    data-parallel ranks (the others) divide the batch, and ``parallel.ranks`` (when set) is them."""
    par, file = config["parallel"], config.file
    tensor = par["tensor"]
    if par["ranks"] is not None and par["ranks"] != ranks:
        raise TrainConfigError(f"{par['ranks']} ranks, but the run has {ranks} ({what})",
                               key="parallel.ranks", file=file,
                               hint=f"run with --nproc {par['ranks']}, or set parallel.ranks = {ranks}")
    if ranks % tensor:
        raise TrainConfigError(f"{tensor} does not divide the {ranks} ranks ({what}): each group of "
                               f"{tensor} consecutive ranks holds the model in slices", key="parallel.tensor",
                               file=file)
    if tensor > 1 and config["train"]["mode"] == "lora":
        raise TrainConfigError("tensor parallelism trains the whole model: LoRA runs data parallel only",
                               key="parallel.tensor", file=file)
    if config["train"]["batch_size"] % (ranks // tensor):
        raise TrainConfigError(f"{config['train']['batch_size']} is not a multiple of the {ranks // tensor} "
                               f"data-parallel ranks ({what}"
                               + (f", over parallel.tensor = {tensor}" if tensor > 1 else "")
                               + "): each rank trains an equal share of the global batch",
                               key="train.batch_size", file=file)


def _data_parallel(config: TrainConfig) -> Any:
    """kiln-dist's parallelism of this rank (``DataParallel``, or ``TensorParallel`` over ``[parallel]
    tensor`` ranks) when this process is one of several MPI ranks, else None. On the ``cuda`` backend
    (``cuda:N``) with nccl4py installed, its collectives run on the GPUs: ``DataParallel("nccl")``, the
    ``nccl`` grid (``grid(tensor, backend=...)``); otherwise through MPI on host copies."""
    tensor = config["parallel"]["tensor"]
    try:
        from kiln.dist import DataParallel, TensorParallel, grid, launched, nccl_available
    except ImportError:
        if tensor > 1:
            raise TrainConfigError("needs kiln-dist (pip install kiln-dist)", key="parallel.tensor",
                                   file=config.file) from None
        return None
    world = DataParallel("mpi").communicator.world_size if launched() else 1
    if world == 1:
        if config["parallel"]["ranks"] not in (None, 1):
            _check_parallel(config, 1, "one process")
        if tensor > 1:
            raise TrainConfigError(f"{tensor} needs {tensor} ranks or a multiple: run with --nproc",
                                   key="parallel.tensor", file=config.file)
        return None
    _check_parallel(config, world, f"{world} MPI ranks")
    zero = int(config["parallel"]["zero"])  # ZeRO-1 over the data-parallel ranks (of the grid)
    overlap = bool(config["parallel"]["overlap"])  # their all-reduce / reduce-scatter in the backward
    backend = config["train"]["backend"]
    if tensor == 1:
        gpu = backend.partition(":")[0] == "cuda" and nccl_available()
        return DataParallel("nccl" if gpu else "mpi", zero=zero, overlap=overlap)
    dp, tp = grid(tensor, backend=backend)  # nccl-dp / nccl-tp on cuda with nccl4py, else mpi-dp / mpi-tp
    return TensorParallel(tp, DataParallel(dp, zero=zero, overlap=overlap) if world > tensor else None)


class _Run:
    def __init__(self, config: TrainConfig, *, resume: bool, debug_nans: bool, stream: TextIO) -> None:
        self.c, self.resume, self.debug_nans, self.stream = config, resume, debug_nans, stream
        train = config["train"]
        self.dp = _data_parallel(config)
        #: every rank of the job (a signal stops them all after the same step)
        self.world = None if self.dp is None else get_registry("communicators")["mpi"]
        # rank 0 writes the run folder; the other ranks, whose weights and optimizer state are the
        # same (or slices of it, gathered to save), read its checkpoints and write and print nothing
        self.rank = 0 if self.world is None else self.world.rank
        self.whole: Any = None  # the whole model, where the ranks hold slices (tensor parallelism)
        self.dir = Path(train["output_dir"])
        if self.rank:
            self.stream = open(os.devnull, "w")  # noqa: SIM115 (lives as long as the run)
        self.ckpts = self.dir / "checkpoints"
        self.steps, self.mode = train["steps"], train["mode"]
        self.progress: Progress | None = None
        self.bundle: Any = None
        self.template: Any = None  # the chat template of chat data
        self.training = False  # between the first step and the last: a signal stops at a step's end
        self.stop = 0  # the signal that asked the run to stop
        self.elapsed = 0.0  # seconds spent by the processes before this one
        self.t0 = time.perf_counter()

    def say(self, text: str) -> None:
        if self.progress is not None:
            self.progress.message(text)
        else:
            print(text, file=self.stream, flush=True)

    def clock(self) -> float:
        return self.elapsed + time.perf_counter() - self.t0

    # -- setup

    def tokenizer(self) -> tuple[Any, str]:
        from kiln.hf import load_tokenizer

        saved = self.dir / "tokenizer"
        if self.resume and (saved / "tokenizer.json").is_file():
            tok, eos = load_tokenizer(saved), _eos_token(saved)
        else:
            tok, eos = build_tokenizer(self.c, self.say)
        self.template = chat_template(self.c, eos)
        if self.world is not None:  # every rank has read the saved tokenizer before rank 0 replaces it
            self.world.barrier()
        if not self.rank:
            _replace_dir(saved, lambda d: self.save_tokenizer(tok, d, eos))
        return tok, eos

    def save_tokenizer(self, tokenizer: Any, folder: Path, eos: str) -> None:
        """The tokenizer's files, with the chat template in ``tokenizer_config.json`` (where transformers'
        ``apply_chat_template`` reads it)."""
        from kiln.hf import save_tokenizer

        save_tokenizer(tokenizer, folder, eos_token=eos)
        if self.template is not None:
            file = folder / "tokenizer_config.json"
            config = json.loads(file.read_text(encoding="utf-8"))
            file.write_text(json.dumps({**config, "chat_template": self.template.source}, indent=2) + "\n",
                            encoding="utf-8")

    def data(self, tokenizer: Any, eos: str) -> None:
        t = self.c["train"]
        self.ds = build_dataset(self.c, tokenizer, eos, self.template, self.dir / "cache")
        if len(self.ds) == 0:
            raise DataError(f"the data holds {self.ds.num_sequences} training sequences of "
                            f"{t['seq_len']} tokens, fewer than one step's "
                            f"{t['batch_size'] * t['grad_accum_steps']} (train.batch_size x "
                            "train.grad_accum_steps)",
                            hint="add data to data.files, or lower train.batch_size, grad_accum_steps or "
                                 "seq_len")
        self.say(f"data: {data_summary(self.c, self.ds)}")

    def build_model(self, vocab_size: int) -> Any:
        from kiln.core import Model

        m, t = self.c["model"], self.c["train"]
        optimizer = _optimizer(self.c, self.steps)
        options = {"seed": m["seed"], "optimizer": optimizer, "backend": t["backend"], "mode": self.mode,
                   "recompute": t["recompute"], "recompute_budget": t["memory_budget"],
                   "precision": t["precision"]}
        if self.c["data"]["ignore_index"] != IGNORE_INDEX:  # the losses ignore the data's label
            options["passes"] = [("ignore_index", {"value": self.c["data"]["ignore_index"]})]
        tp = self.c["parallel"]["tensor"] > 1 and self.dp is not None
        if self.dp is not None and not tp:
            options["data_parallel"] = self.dp
        if m["checkpoint"] is not None:
            from kiln.hf import from_pretrained

            model = from_pretrained(m["checkpoint"], **options)
            what = f"{model.architecture} from {m['checkpoint']}"
            vocab = int(model.hf_config.get("vocab_size", vocab_size))
            if vocab < vocab_size:
                raise TrainConfigError(f"has {vocab_size} tokens, more than the model's vocabulary of "
                                       f"{vocab}", key="data.tokenizer", file=self.c.file)
        else:
            self.bundle = _scratch_bundle(self.c, vocab_size)
            model = Model.from_ir(self.bundle, **options)
            what = f"{m['name']} ({m['size']}) from scratch"
        if tp:  # each rank trains its slices of the whole model, which rank 0 keeps to export
            from kiln.dist import shard

            group = get_registry("communicators")[self.dp.comm]
            sliced = Model.from_ir(model.ir, **{**options, "init": None, "parallel": self.dp})
            sliced.set_parameters(shard(model.parameters(), model.ir, group.rank, group.world_size))
            self.whole, model = (model if not self.rank else None), sliced
            what += f", {group.world_size}-way tensor parallel"
            if self.dp.data_parallel is not None and self.dp.data_parallel.zero:
                what += f", ZeRO-1 over {self.dp.data_parallel.communicator.world_size} data-parallel ranks"
        sync = self.dp.data_parallel if tp else self.dp  # the data-parallel gradient sync, if any
        if sync is not None and sync.overlap:
            what += f", {'reduce-scatter' if sync.zero else 'all-reduce'} overlapped with the backward"
        if self.mode == "lora":
            model = get_registry("adapters")["lora"].apply(model, _lora_config(self.c), seed=m["seed"])
        try:  # compiles the training step: the recompute plan may not fit the budget
            params = model.program(t["batch_size"], t["seq_len"]).params
        except KilnError as e:
            if t["recompute"] != "auto" or "budget" not in str(e):
                raise
            raise TrainConfigError(e.message, key="train.memory_budget", file=self.c.file,
                                   hint=e.hint) from None
        total = sum(math.prod(p.shape) for p in params)
        trained = sum(math.prod(p.shape) for p in params if p.trainable)
        self.say(f"model: {what}, {_count(total)} parameters ({_count(trained)} trained), "
                 f"{t['backend']} backend")
        return model

    # -- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The state of the whole model, whatever the number of ranks (every rank calls it)."""
        if self.dp is None:
            return dict(self.model.state_dict())
        from kiln.dist import gather_state

        return gather_state(self.model)

    def save(self, step: int, eval_loss: float | None = None) -> Path:
        state = self.state_dict()
        if self.rank:  # rank 0 saves the state of the whole model
            return self.ckpts
        opt = state["optimizer"]
        trainable = self.model.trainable
        weights = {k: v for k, v in state["parameters"].items() if self.mode == "full" or trainable[k]}
        moments = {f"{which}.{k}": v for which, per in opt.items() if isinstance(per, dict)
                   for k, v in per.items()}
        rng: dict[str, Any] = {"shuffle_seed": self.c["data"]["seed"], "epoch": self.ds.epoch}
        if hasattr(self.model, "rng_state"):  # random ops whose state lives in the model
            rng["model"] = self.model.rng_state()
        info = {"optimizer_step": opt["step"], "data": self.ds.state(), "data_files": self.data_files(),
                "rng": rng, "elapsed": self.clock(), "config": self.c.fingerprint(), "eval_loss": eval_loss}
        t = self.c["train"]
        return _checkpoint.save(self.ckpts, step, weights, moments, info, keep=t["keep_last"],
                                keep_best=t["keep_best"])

    def data_files(self) -> list[list[Any]]:
        """The data files (relative to the config's folder) and their sizes: what a moved run compares."""
        return [[_jsonable(f, self.c.root), f.stat().st_size] for f in self.c["data"]["files"]]

    def restore(self) -> int:
        """Load the newest intact checkpoint; the step it was taken after (0 without one)."""
        for path in reversed(_checkpoint.checkpoints(self.ckpts)):
            try:
                weights, moments, state = _checkpoint.load(path)
            except KilnError as e:
                if self.rank:  # rank 0 sets it aside
                    continue
                self.say(f"skipping checkpoint {path.name} (renamed {_checkpoint.set_aside(path).name}): {e}")
                continue
            old, new = state.get("config", {}), self.c.fingerprint()
            changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
            if changed:
                raise TrainConfigError(f"is {new.get(changed[0])!r} here, {old.get(changed[0])!r} in the run "
                                       f"being resumed; only {', '.join(_RESUMABLE)} may change on --resume",
                                       key=changed[0], file=self.c.file)
            opt: dict[str, Any] = {"step": state["optimizer_step"]}
            for key, value in moments.items():
                which, _, param = key.partition(".")
                opt.setdefault(which, {})[param] = value
            if self.dp is None:
                self.model.load_state_dict({"parameters": weights, "optimizer": opt})
            else:  # a whole model's state: this rank takes its slices and its share
                from kiln.dist import scatter_state

                scatter_state(self.model, {"parameters": weights, "optimizer": opt})
            if "model" in state["rng"] and hasattr(self.model, "set_rng_state"):
                self.model.set_rng_state(state["rng"]["model"])
            data = state["data"]
            if state.get("data_files") == self.data_files():  # the dataset's own fingerprint holds the
                data = {**data, "fingerprint": self.ds.state()["fingerprint"]}  # files' absolute paths
            self.ds.load_state(data)
            self.elapsed, self.t0 = float(state.get("elapsed", 0.0)), time.perf_counter()
            step = int(state["step"])
            self.say(f"resuming from {path} (step {step})")
            if step > self.steps:
                self.say(f"note: the run being resumed has done {step} steps, more than train.steps = "
                         f"{self.steps}: nothing is trained; the model of step {step} is saved")
            return step
        self.say("no checkpoint to resume from: starting at step 0")
        return 0

    # -- training

    def evaluate(self) -> float:
        """The mean loss over the first ``eval_batches`` held-out batches (the same every time)."""
        val = self.ds.validation()
        if val.num_sequences < val.batch_size:
            val.drop_last = False  # one smaller batch rather than none
        total, count = 0.0, 0
        for i, batch in enumerate(val):
            if i == self.c["train"]["eval_batches"]:
                break
            n = int(np.count_nonzero(batch["labels"] != self.model.ignore_index))
            ids, labels, positions = batch["input_ids"], batch["labels"], batch.get("position_ids")
            total += self.model.loss(ids, labels, position_ids=positions) * n
            count += n
        return total / max(count, 1)

    def batches(self) -> Iterator[dict[str, np.ndarray]]:
        while True:
            yield from self.ds

    def nonfinite(self, step: int, stats: Mapping[str, float], batch: Mapping[str, Any],
                  before: Mapping[str, np.ndarray] | None) -> TrainingError:
        what, value = ("loss", stats["loss"]) if not math.isfinite(stats["loss"]) else \
            ("gradient norm", stats["grad_norm"])
        message = f"non-finite {what} ({value}) at step {step}; {self.kept()}"
        if before is None:
            return TrainingError(message, hint="run again with --resume --debug-nans to find the first op "
                                               "that produced a non-finite value")
        with np.errstate(all="ignore"):
            return TrainingError(f"{message}\n{first_nonfinite(self.model, batch, before, self.model.step)}")

    def kept(self) -> str:
        found = _checkpoint.checkpoints(self.ckpts)
        return f"the last good checkpoint, {found[-1]}, is kept" if found else "no checkpoint was written yet"

    def run(self) -> dict[str, Any]:
        found = _checkpoint.checkpoints(self.ckpts)
        if found and not self.resume:
            raise TrainConfigError(f"{str(self.dir)!r} holds the checkpoints of an earlier run (the last is "
                                   f"{found[-1].name})", key="train.output_dir", file=self.c.file,
                                   hint="pass --resume to continue it, or choose another output_dir")
        created = None  # the outermost folder this run creates
        if not self.dir.exists():
            created = self.dir
            while not created.parent.exists():
                created = created.parent
        main = threading.current_thread() is threading.main_thread()
        previous = {sig: signal.signal(sig, self.on_signal) for sig in _SIGNALS} if main else {}
        try:
            return self.stages()
        except BaseException as e:  # a failed or interrupted run: no half-made output folder
            if created and not self.rank and not _checkpoint.checkpoints(self.ckpts):
                shutil.rmtree(created, ignore_errors=True)
            if isinstance(e, KeyboardInterrupt):
                signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
                found = _checkpoint.checkpoints(self.ckpts)
                left = (f"the last checkpoint, {found[-1]}, is intact (continue with --resume)" if found else
                        "no checkpoint was written, so there is nothing to resume"
                        + (f" ({created} was removed)" if created else ""))
                raise Interrupted(signum, f"interrupted by {signal.Signals(signum).name}: {left}") from None
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def stages(self) -> dict[str, Any]:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TrainConfigError(f"cannot be created: {e.strerror or e}", key="train.output_dir",
                                   file=self.c.file) from None
        if not self.rank:
            _checkpoint.clean(self.ckpts)
        tokenizer, eos = self.tokenizer()
        self.data(tokenizer, eos)
        self.model = self.build_model(tokenizer.get_vocab_size(with_added_tokens=True))
        self.say(plan_summary(self.model, self.c["train"]["batch_size"], self.c["train"]["seq_len"]))
        start = self.restore() if self.resume else 0
        trackers = [] if self.rank else open_trackers(self.c["train"]["report_to"], self.dir, start)
        metrics = _Metrics(None if self.rank else self.dir / "metrics.jsonl", start if start else -1,
                           trackers)
        try:
            self.training = True
            self.loop(start, metrics)
        finally:
            self.training = False
            if self.progress is not None:
                self.progress.close()
                self.progress = None
            metrics.close()
        if self.dp is not None and self.c["parallel"]["tensor"] > 1:
            weights = self.state_dict()["parameters"]  # every rank's slices, gathered
            if self.whole is not None:
                self.whole.set_parameters(weights)
        if self.rank:  # rank 0 writes the outputs
            return {"output_dir": self.dir, "losses": [r["loss"] for r in metrics.records if "loss" in r],
                    "signal": self.stop or None}
        return self.finish(metrics.records, tokenizer, eos)

    def on_signal(self, signum: int, frame: Any) -> None:
        """SIGINT or SIGTERM: while training, stop after the current step with a checkpoint; at
        start-up, or a second time, stop at once (the last checkpoint is intact)."""
        if not self.training or self.stop:
            raise Interrupted(signum)
        self.stop = signum
        if self.progress is not None:  # the bar is not drawn again
            self.progress.close()
            self.progress = None
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        self.say(f"{name}: saving a checkpoint after this step (Ctrl-C again to quit at once)")

    def loop(self, start: int, metrics: _Metrics) -> None:
        """Train from step ``start`` to the last, or to the step a signal came in."""
        t = self.c["train"]
        evals, saves = t["eval_every"], t["checkpoint_every"]
        self.progress = Progress(self.steps, start=start, stream=self.stream, every=t["log_every"])
        if start == 0:
            loss = self.evaluate()
            metrics.write({"step": 0, "eval_loss": loss})
            self.say(f"eval loss before training: {loss:.4f}")
        saved, batches = start, self.batches()
        for step in range(start + 1, self.steps + 1):
            batch = next(batches)
            before = self.model.parameters() if self.debug_nans else None
            with np.errstate(all="ignore"):  # a non-finite loss is reported below, naming its step
                stats = self.model.train_step(batch, micro_batches=self.c["train"]["grad_accum_steps"])
            if not (math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"])):
                raise self.nonfinite(step, stats, batch, before)
            if self.debug_nans:
                self.check_weights(step)
            record = {"step": step, "loss": stats["loss"], "grad_norm": stats["grad_norm"], "lr": stats["lr"],
                      "tokens": int(stats["tokens"])}
            if (evals and step % evals == 0) or step == self.steps:
                record["eval_loss"] = self.evaluate()
            record["elapsed"] = round(self.clock(), 3)
            metrics.write(record)
            if self.progress is not None:
                self.progress.update(step, stats["loss"], stats["tokens"], record.get("eval_loss"),
                                     lr=stats["lr"], grad_norm=stats["grad_norm"], elapsed=record["elapsed"])
            if self.world is not None:  # a signal stops every rank after the same step
                flag = np.array([float(self.stop)])
                self.world.all_reduce(flag)
                self.stop = self.stop or (signal.SIGTERM if flag[0] else 0)
            if (saves and step % saves == 0) or step == self.steps or self.stop:
                self.save(step, record.get("eval_loss"))
                saved = step
            if self.stop:
                self.say(f"interrupted: checkpoint of step {step} saved in {self.ckpts}")
                return
        if saved < self.steps and start < self.steps:
            self.save(self.steps)

    def check_weights(self, step: int) -> None:
        """--debug-nans: the optimizer's update of step ``step`` left every weight finite."""
        for name, value in self.model.parameters().items():
            bad = value.size - int(np.isfinite(value).sum())
            if bad:
                raise TrainingError(f"non-finite weight {name!r} after the optimizer's update of step {step} "
                                    f"({bad} of its {value.size} values; the loss and gradient norm were "
                                    f"finite); {self.kept()}",
                                    hint="lower optimizer.lr, or clip gradients with optimizer.max_grad_norm")

    def finish(self, records: list[dict[str, Any]], tokenizer: Any, eos: str) -> dict[str, Any]:
        from kiln.hf._plot import loss_curve

        train = [(r["step"], r["loss"]) for r in records if "loss" in r]
        evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
        png = loss_curve(self.dir / "loss.png", [s for s, _ in train], [v for _, v in train],
                         [s for s, _ in evals], [v for _, v in evals])
        found = _checkpoint.checkpoints(self.ckpts)
        summary: dict[str, Any] = {
            "output_dir": self.dir, "tokenizer": self.dir / "tokenizer",
            "metrics": self.dir / "metrics.jsonl", "loss_curve": png,
            "checkpoint": found[-1] if found else None, "best_checkpoint": _checkpoint.best(found),
            "interrupted": bool(self.stop), "signal": self.stop or None,
            "eval_loss_before": evals[0][1] if evals and evals[0][0] == 0 else None,
            "eval_loss_after": evals[-1][1] if evals else None, "losses": [v for _, v in train],
            "data": getattr(self.ds, "stats", None)}
        if self.stop:
            return summary
        if self.mode == "lora":
            out = summary["adapter"] = _replace_dir(self.dir / "adapter", self.model.save_pretrained)
        else:
            model = self.model if self.whole is None else self.whole
            out = summary["model"] = _replace_dir(self.dir / "model", lambda d: save_pretrained(model, d))
        self.save_tokenizer(tokenizer, out, eos)
        if self.mode != "lora":
            _generation_config(out, tokenizer.token_to_id(eos))
        before, after = summary["eval_loss_before"], summary["eval_loss_after"]
        if before is not None and after is not None:
            self.say(f"eval loss {before:.4f} -> {after:.4f} ({100 * (1 - after / before):.0f}% lower) in "
                     f"{duration(self.clock())}")
        what = "adapter" if self.mode == "lora" else "model"
        self.say(f"saved the {what} to {out}, the loss curve to {png}")
        return summary


def train(config: TrainConfig | str | Path | Mapping[str, Any], *, resume: bool = False,
          debug_nans: bool = False, stream: TextIO | None = None) -> dict[str, Any]:
    """Run ``kiln train`` on a config (a :class:`TrainConfig`, a TOML file, or its content as a dict).

    ``resume`` continues from the newest intact checkpoint in the output folder, bit for bit as if
    the run had never stopped; ``debug_nans`` replays a step whose loss is not finite op by op and
    names the first op that produced a NaN or an infinity. Progress goes to ``stream`` (stdout).
    Returns a summary: ``output_dir``, ``model`` (or ``adapter``), ``tokenizer``, ``metrics``,
    ``loss_curve``, ``checkpoint`` (the newest), ``best_checkpoint`` (the lowest eval loss),
    ``eval_loss_before``, ``eval_loss_after``, ``losses``, ``data`` (the counts of a
    :class:`~kiln.hf.SampleDataset`), ``interrupted`` and ``signal`` (SIGINT or
    SIGTERM stopped the run after a step: a checkpoint was saved, and no model). A signal at start-up,
    or a second one, raises :class:`Interrupted` at once.
    """
    if not isinstance(config, TrainConfig):
        config = load_train_config(config)
    return _Run(config, resume=resume, debug_nans=debug_nans, stream=stream or sys.stdout).run()


def launch(args: Any) -> int:
    """``kiln train --nproc N``: the same command as N data-parallel ranks through kiln-dist's MPI
    launcher, each with its share of the cores; the exit status is the launcher's."""
    if isinstance(args.nproc, bool) or not isinstance(args.nproc, int) or args.nproc < 1:
        raise KilnError(f"--nproc {args.nproc}: expected a number of ranks >= 1")
    config = load_train_config(args.config)  # a bad config is reported once, before any rank starts
    _check_parallel(config, args.nproc, f"--nproc {args.nproc}")
    try:
        from kiln.dist import launch as start_ranks
        from kiln.dist import launched
    except ImportError:
        raise KilnError("--nproc needs kiln-dist, which is not installed",
                        hint="pip install kiln-dist") from None
    if launched():
        raise KilnError("--nproc starts the ranks itself; under mpiexec or srun leave it out")
    argv = ["-m", "kiln.core", "train", str(args.config), *(["--resume"] if args.resume else []),
            *(["--debug-nans"] if args.debug_nans else [])]
    threads = max(1, (os.cpu_count() or 1) // args.nproc)
    return start_ranks(args.nproc, argv, env={"KILN_NUM_THREADS": str(threads)})


def run(args: Any) -> int:
    """``kiln train``: 0 when the run ends, 128 + the signal's number when SIGINT (130) or SIGTERM (143)
    stopped it; an error exits with its ``exit_code`` (``EXIT_*``, 2 by default)."""
    if getattr(args, "nproc", 1) != 1:
        return launch(args)
    try:
        summary = train(args.config, resume=args.resume, debug_nans=args.debug_nans)
    except Interrupted as e:
        print(f"\n{e.message}", file=sys.stderr)
        return e.exit_code
    except Exception as e:
        if isinstance(e, DataError):
            e.exit_code = EXIT_DATA  # type: ignore[attr-defined]
        _stop_the_other_ranks(e)
        raise
    return 128 + summary["signal"] if summary["signal"] else 0


def _stop_the_other_ranks(error: Exception) -> None:
    """In a rank of a job of several: stop the job with ``error`` now. The other ranks would wait for
    this one in their next collective until the timeout (``KILN_DIST_TIMEOUT``, 5 minutes)."""
    try:
        from kiln.dist import launched, stop_job
    except ImportError:
        return
    if not launched() or get_registry("communicators")["mpi"].world_size == 1:  # kiln-dist's MPI world
        return
    if isinstance(error, KilnError):
        stop_job(f"kiln: error: {error}", int(getattr(error, "exit_code", 2)))
    stop_job("".join(traceback.format_exception(error)).rstrip("\n"), 1)
