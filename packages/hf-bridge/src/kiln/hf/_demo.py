"""``kiln demo``: kiln's main job end to end on the NumPy backend, with nothing to download.

1. Text: the help topics of Python's ``help()`` (``pydoc_data.topics``) and the docstrings of
   Python's built-in functions and types, both of which ship with every Python; and for the LoRA
   phase, kiln's own small instruction set (``demo_data/instructions.jsonl``: questions about
   Python and their answers, as chat records).
2. ``kiln train`` from scratch: a BPE tokenizer and a tiny Qwen3 under the automatic recompute
   planner; eval loss before and after, the plan, an HF checkpoint, a greedy continuation.
3. ``kiln train`` in LoRA mode on that checkpoint (with kiln-peft) on the chat records, rendered with
   the built-in ``zephyr`` chat template, the loss on the answers only: a PEFT adapter, and the
   adapted model's answer to a question.

Everything goes to ``./kiln-demo/``, including the two configs, which ``kiln train`` runs again.
"""

from __future__ import annotations

import builtins
import inspect
import shutil
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from kiln.core import KilnError
from kiln.hf._progress import duration

PROMPT = 'The "for" statement is used to'
QUESTION = "What does the built-in function len() do?"

PRETRAIN = """\
# kiln demo, phase 1: a tiny Qwen3 trained from scratch on Python's help topics and docstrings.
# To train longer, raise steps and run: kiln train {root}/pretrain.toml --resume
[model]
name = "Qwen3Model"
size = "tiny"

[data]
files = ["data/pydoc-topics.txt", "data/builtins-docstrings.txt"]
vocab_size = 1024
separator = "\\n\\n"

[train]
output_dir = "pretrain"
steps = {steps}
batch_size = 16
seq_len = 64
recompute = "auto"
eval_every = {eval_every}
eval_batches = 8
checkpoint_every = {eval_every}

[optimizer]
lr = 3e-3
warmup_steps = {warmup}
schedule = "cosine"
min_lr_ratio = 0.1
"""

LORA = """\
# kiln demo, phase 2: LoRA adapters on the phase-1 model, trained on questions about Python and their
# answers (chat records in the zephyr chat template; the loss counts the answers only).
# To see what it trains on: kiln data {root}/lora.toml
# To train longer, raise steps and run: kiln train {root}/lora.toml --resume
[model]
checkpoint = "pretrain/model"

[data]
files = ["data/instructions.jsonl"]
format = "chat"
chat_template = "zephyr"

[train]
mode = "lora"
output_dir = "lora"
steps = {steps}
batch_size = 8
seq_len = 128
recompute = "auto"
eval_every = {eval_every}
checkpoint_every = {eval_every}

[optimizer]
lr = 1e-2
warmup_steps = {warmup}

[lora]
r = 8
lora_alpha = 16
target_modules = "all-linear"
"""


def pydoc_topics() -> str:
    """The text of Python's ``help()`` topics (the language reference, in sections)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise KilnError("this Python has no pydoc_data (the help() topics): the demo trains on them",
                        hint="install the full standard library (e.g. the python3-doc or libpython3-stdlib "
                             "package of your distribution)") from None
    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def builtins_docstrings() -> str:
    """The docstrings of Python's built-in functions and types, and of the types' methods."""
    docs = []
    for name in sorted(dir(builtins)):
        obj = getattr(builtins, name)
        if name.startswith("_") or (isinstance(obj, type) and issubclass(obj, BaseException)):
            continue
        doc = inspect.getdoc(obj)
        if doc:
            docs.append(f"{name}\n{doc}")
        if isinstance(obj, type):
            for attr in sorted(vars(obj)):
                method = vars(obj)[attr]
                doc = None if attr.startswith("_") else inspect.getdoc(method)
                if doc:
                    docs.append(f"{name}.{attr}\n{doc}")
    text = "\n\n".join(docs)
    if len(text) < 20_000:
        raise KilnError("this Python's builtins have (almost) no docstrings, which the LoRA phase trains on",
                        hint="run the demo without python -OO")
    return text


def greedy(model: Any, tokenizer: Any, prompt: str, tokens: int = 40, window: int = 64,
           stop: int | None = None) -> str:
    """``prompt``'s continuation, the most likely token each time, from repeated ``logits`` calls,
    up to ``tokens`` tokens or the token ``stop`` (not included).

    Every call has the shape ``[1, window]`` (the context left-aligned, padded after it: attention
    is causal, so the padding cannot change the logits read), so one Program serves all of them.
    """
    ids = list(tokenizer.encode(prompt).ids)
    start = len(ids)
    x = np.zeros((1, window), np.int64)
    for _ in range(tokens):
        ctx = ids[-window:]
        x[0, :] = 0
        x[0, :len(ctx)] = ctx
        ids.append(int(np.argmax(model.logits(x)[0, len(ctx) - 1])))
        if ids[-1] == stop:
            ids.pop()
            break
    return str(tokenizer.decode(ids[start:]))


def instructions() -> str:
    """kiln's demo instruction set: chat records, one JSON object a line."""
    from importlib.resources import files

    return (files("kiln.hf") / "demo_data" / "instructions.jsonl").read_text(encoding="utf-8")


def demo(root: str | Path = "kiln-demo", *, steps: int = 400, lora_steps: int = 200,
         stream: TextIO | None = None) -> dict[str, Any]:
    """Run the demo in folder ``root`` (phase 1 for ``steps`` steps, phase 2 for ``lora_steps``).

    Returns ``{"pretrain": <kiln train summary>, "lora": <summary or None>, "continuation": str,
    "answer": <the adapted model's answer to QUESTION, or None>}``.
    Earlier demo runs in ``root`` are replaced.
    """
    from kiln.hf import from_pretrained, load_tokenizer
    from kiln.hf._train import Interrupted, train

    out = stream or sys.stdout
    started = time.perf_counter()
    root = Path(root)

    def say(text: str = "") -> None:
        print(text, file=out, flush=True)

    def heading(text: str) -> None:
        say()
        say(f"== {text} " + "=" * max(0, 76 - len(text)))

    for old in ("pretrain", "lora"):
        shutil.rmtree(root / old, ignore_errors=True)
    (root / "data").mkdir(parents=True, exist_ok=True)
    (root / "data" / "pydoc-topics.txt").write_text(pydoc_topics(), encoding="utf-8")
    (root / "data" / "builtins-docstrings.txt").write_text(builtins_docstrings(), encoding="utf-8")
    (root / "data" / "instructions.jsonl").write_text(instructions(), encoding="utf-8")
    pretrain = root / "pretrain.toml"
    pretrain.write_text(PRETRAIN.format(root=root, steps=steps, eval_every=max(steps // 4, 1),
                                        warmup=max(steps // 15, 1)), encoding="utf-8")

    def stopped(summary: dict[str, Any], config: Path) -> None:
        if summary["signal"]:  # SIGINT or SIGTERM after a step: the phase's checkpoint is saved
            raise Interrupted(summary["signal"], f"interrupted: the checkpoint {summary['checkpoint']} is "
                                                 f"kept; kiln train {config} --resume continues that phase")

    heading("1. a tiny Qwen3 from scratch, on Python's help() topics and docstrings")
    first = train(pretrain, stream=out)
    stopped(first, pretrain)
    model_dir = first["model"]

    heading("2. the trained model, loaded back from its HF checkpoint")
    model = from_pretrained(model_dir)
    tokenizer = load_tokenizer(model_dir)
    text = greedy(model, tokenizer, PROMPT)
    say(f"greedy continuation of {PROMPT!r}:")
    say(f"  {PROMPT}{text}".replace("\n", "\n  "))

    second = answer = None
    heading("3. LoRA adapters on that checkpoint, on questions about Python and their answers")
    try:
        import kiln.peft  # noqa: F401
    except ImportError:
        say("skipped: LoRA needs kiln-peft (pip install kiln-peft)")
    else:
        lora = root / "lora.toml"
        lora.write_text(LORA.format(root=root, steps=lora_steps, eval_every=max(lora_steps // 2, 1),
                                    warmup=max(lora_steps // 10, 1)), encoding="utf-8")
        second = train(lora, stream=out)
        stopped(second, lora)
        answer = ask(model_dir, second["adapter"], QUESTION)
        heading("4. the adapted model, asked a question in the chat template it was trained on")
        say(f"user: {QUESTION}")
        say(f"assistant: {answer}".replace("\n", "\n  "))

    heading(f"done in {duration(time.perf_counter() - started)}: everything is in {root}/")
    rows = [("data/", "the training texts and the instruction set"),
            ("pretrain.toml" + (", lora.toml" if second else ""), "the configs of the two runs"),
            ("pretrain/model/", "the trained model: a HF checkpoint folder with its tokenizer"),
            ("pretrain/metrics.jsonl", "loss, eval loss, learning rate and gradient norm per step"),
            ("pretrain/loss.png", "the loss curve"),
            ("pretrain/checkpoints/", "training checkpoints (kiln train CONFIG --resume continues)")]
    if second:
        rows += [("lora/adapter/", "the LoRA adapter, in PEFT's format"), ("lora/loss.png", "its loss curve")]
    for path, what in rows:
        say(f"  {path:<28} {what}")
    return {"pretrain": first, "lora": second, "continuation": text, "answer": answer}


def ask(model_dir: Path, adapter_dir: Path, question: str) -> str:
    """The greedy answer of the model in ``model_dir`` with the LoRA adapter in ``adapter_dir`` to
    ``question``, asked in the built-in ``zephyr`` template; up to the end-of-text token."""
    from kiln.hf import BUILTIN_TEMPLATES, EOS_TOKEN, ChatTemplate, from_pretrained, load_tokenizer
    from kiln.peft import PeftModel

    model = PeftModel.from_pretrained(from_pretrained(model_dir), adapter_dir)
    tokenizer = load_tokenizer(adapter_dir)
    template = ChatTemplate(BUILTIN_TEMPLATES["zephyr"], specials={"eos_token": EOS_TOKEN})
    prompt = template.render([{"role": "user", "content": question}], add_generation_prompt=True)[0]
    return greedy(model, tokenizer, prompt, tokens=48, window=128, stop=tokenizer.token_to_id(EOS_TOKEN))


def run(args: Any) -> int:
    """``kiln demo``: 0, or 128 + the signal's number when SIGINT or SIGTERM stopped it."""
    from kiln.hf._train import Interrupted

    try:
        demo()
    except Interrupted as e:
        print(f"\n{e.message}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # outside a training run
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 0
