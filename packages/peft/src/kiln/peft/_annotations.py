"""``@adapter("lora" | "ia3", ...)`` annotations (seed 004 §7.3.2) as a :class:`LoraConfig` or an
:class:`IA3Config`."""

from __future__ import annotations

import re
from typing import Any

from kiln.core.ir import Bundle
from kiln.peft._config import LoraConfig
from kiln.peft._errors import AdapterError
from kiln.peft._ia3 import IA3Config
from kiln.peft._lora import _candidates, _template


def _annotated(bundle: Bundle, kind: str) -> dict[str, Any]:
    """Module path -> the ``@adapter(kind)`` annotation of each projection the annotations select."""
    ann = {
        (m.name, a.target): a
        for m in bundle.modules
        for a in m.annotated("adapter", "param")
        if a.args.get("type") == kind
    }
    if not ann:
        raise AdapterError(
            f"the model has no @adapter({kind!r}) annotation",
            key="@adapter",
            hint=f'annotate a weight: Param(Tensor[...]) @ adapter("{kind}")',
        )
    paths: dict[str, Any] = {}
    for module, stack, layers, _, spec, mapping, var in _candidates(bundle):
        a = ann.get((module.name, spec.name))
        if a is None:
            continue
        chosen = a.args.get("targets") or [t.name for t in spec.lora_targets]
        for j, lt in enumerate(spec.lora_targets):
            if lt.name not in chosen:
                continue
            template = _template(mapping, j, len(spec.lora_targets))
            own = f"{stack}.{{}}.{spec.name}.{lt.name}" if stack is not None else f"{spec.name}.{lt.name}"
            for i, layer in enumerate(layers):
                path = (
                    own.format(i) if template is None else template.replace(var, layer) if var else template
                )
                paths[path] = a
    return paths


def annotated_lora_config(bundle: Bundle) -> LoraConfig:
    """The LoRA config that adapts what the model's ``@adapter("lora", rank=, alpha=, dropout=,
    targets=)`` annotations name: each annotated weight (its ``targets``, else all its LoRA targets)
    with its rank and alpha (``rank_pattern``/``alpha_pattern`` where they differ). Raises
    :class:`AdapterError` when nothing is annotated or the dropouts differ (PEFT has one)."""
    annotated = _annotated(bundle, "lora")
    paths = {p: (int(a.args.get("rank", 16)), float(a.args.get("alpha", 32.0))) for p, a in annotated.items()}
    dropouts = {float(a.args.get("dropout", 0.0)) for a in annotated.values()}
    if len(dropouts) > 1:
        raise AdapterError(
            f"@adapter('lora') annotations give dropouts {sorted(dropouts)}; a LoRA config has one",
            key="dropout",
        )
    values = list(paths.values())
    r, alpha = max(set(values), key=values.count)
    return LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropouts.pop(),
        target_modules="|".join(re.escape(p) for p in paths),
        rank_pattern={re.escape(p): v[0] for p, v in paths.items() if v[0] != r},
        alpha_pattern={re.escape(p): v[1] for p, v in paths.items() if v[1] != alpha},
    )


def annotated_ia3_config(bundle: Bundle) -> IA3Config:
    """The IA³ config that rescales the outputs of what the model's ``@adapter("ia3", targets=)``
    annotations name (each annotated weight: its ``targets``, else all its LoRA targets)."""
    return IA3Config(target_modules="|".join(re.escape(p) for p in _annotated(bundle, "ia3")))
