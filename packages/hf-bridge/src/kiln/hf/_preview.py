"""``kiln data CONFIG``: what a run of that config trains on, without training or writing anything:
the counts, token statistics and packing efficiency of its data, and its first samples rendered
with the tokens that are not trained (the prompt, the padding) set apart."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from kiln.hf._errors import DataError

#: how tokens left out of the loss are set apart: dimmed on a terminal, else between these marks
MASK_OPEN, MASK_CLOSE = "⟦", "⟧"
_DIM, _RESET = "\x1b[2m", "\x1b[0m"


def marked(tokenizer: Any, ids: Sequence[int] | np.ndarray, trained: Sequence[bool] | np.ndarray, *,
           color: bool = False) -> str:
    """The text of ``ids``, the runs of tokens not trained dimmed (``color``) or between
    :data:`MASK_OPEN` and :data:`MASK_CLOSE`."""
    out, start = [], 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or trained[end] != trained[start]:
            text = tokenizer.decode([int(i) for i in ids[start:end]], skip_special_tokens=False)
            if not trained[start]:
                text = f"{_DIM}{text}{_RESET}" if color else f"{MASK_OPEN}{text}{MASK_CLOSE}"
            out.append(text)
            start = end
    return "".join(out)


def preview(config: Any, *, samples: int = 3, color: bool | None = None,
            stream: TextIO | None = None) -> dict[str, Any]:
    """Print what ``kiln train`` would train on (see the module's docstring); return ``{"summary",
    "stats", "efficiency", "samples"}`` (the rendered samples as printed)."""
    from kiln.hf._samples import SampleDataset
    from kiln.hf._train import (
        TrainConfig,
        build_dataset,
        build_tokenizer,
        chat_template,
        data_summary,
        load_train_config,
    )

    out = stream or sys.stdout
    if color is None:
        color = out.isatty() and "NO_COLOR" not in os.environ
    c = config if isinstance(config, TrainConfig) else load_train_config(config)

    def say(text: str = "") -> None:
        print(text, file=out, flush=True)

    tokenizer, eos = build_tokenizer(c, say)
    template = chat_template(c, eos)
    ds = build_dataset(c, tokenizer, eos, template, None)  # text tokens: cached in a temporary folder
    summary = data_summary(c, ds)
    say(f"data: {summary}")
    shown: list[str] = []
    if isinstance(ds, SampleDataset):
        s = ds.stats
        stats = dict(s)
        say(f"tokens per sample: min {s['min_tokens']}, mean {s['mean_tokens']:.1f}, max {s['max_tokens']}; "
            f"trained: {s['trained_tokens']:,} of {s['tokens']:,} ({s['trained_tokens'] / s['tokens']:.1%})")
        if s["truncated"] or s["dropped_too_long"] or s["dropped_untrained"]:
            say(f"of {s['records']:,} records: {s['truncated']} cut to seq_len, {s['dropped_too_long']} "
                f"longer than seq_len dropped, {s['dropped_untrained']} dropped with no trained token left")
        items: list[tuple[str, np.ndarray, np.ndarray]] = [
            (f"{Path(r.file).name}:{r.line}", ids, np.concatenate([[False], mask[1:]]))
            for r, ids, mask in ds.samples[:samples]]
    else:
        tokens = np.asarray(ds.tokens)
        documents = int(np.count_nonzero(tokens == ds.eos_id))
        stats = {"tokens": len(tokens), "documents": documents}
        say(f"tokens: {len(tokens):,} in {documents:,} documents ({len(tokens) / max(documents, 1):.1f} per "
            "document, with its end-of-text token)")
        batch = next(iter(ds), None)
        rows = [] if batch is None else range(min(samples, len(batch["input_ids"])))
        items = [(f"sequence {i + 1} of the first batch", batch["input_ids"][i],  # type: ignore[index]
                  np.concatenate([[False], batch["labels"][i][:-1] != ds.ignore_index]))  # type: ignore[index]
                 for i in rows]
    say(f"efficiency: {ds.efficiency:.1%} of the positions of the training sequences hold tokens")
    if items:
        say()
        say("the first samples, " + ("tokens not trained dimmed" if color else
                                     f"tokens not trained between {MASK_OPEN} and {MASK_CLOSE}") + ":")
    for name, ids, trained in items:
        text = marked(tokenizer, ids, trained, color=color)
        shown.append(text)
        say(f"--- {name} ({len(ids)} tokens, {int(np.count_nonzero(trained))} trained)")
        say(text)
    return {"summary": summary, "stats": stats, "efficiency": ds.efficiency, "samples": shown}


def run(args: Any) -> int:
    """``kiln data CONFIG``; a data error exits with ``kiln train``'s code for one (3)."""
    from kiln.core import KilnError
    from kiln.hf._train import EXIT_DATA

    if args.samples < 0:
        raise KilnError(f"--samples {args.samples}: expected a number of samples >= 0")
    try:
        preview(args.config, samples=args.samples)
    except DataError as e:
        e.exit_code = EXIT_DATA  # type: ignore[attr-defined]
        raise
    return 0
