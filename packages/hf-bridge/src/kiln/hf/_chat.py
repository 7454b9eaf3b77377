"""Chat templates: a checkpoint's jinja2 ``chat_template``, rendered as transformers renders it, or a
built-in one for models trained from scratch; and which characters of a rendered chat are trained.

The environment is transformers' (``apply_chat_template``): jinja2's ``ImmutableSandboxedEnvironment``
with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and the ``{% generation %}``
tag (its output is what ``return_assistant_tokens_mask`` marks), ``raise_exception``, ``strftime_now``,
a JSON ``tojson`` that escapes no HTML, and the tokenizer's special tokens (``bos_token``,
``eos_token``, ...) as variables beside ``messages``, ``tools``, ``documents`` and
``add_generation_prompt``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kiln.hf._errors import DataError

#: built-in templates for models without one: ``chatml`` (Qwen's; needs ``<|im_start|>`` and
#: ``<|im_end|>`` as tokens) and ``zephyr`` (plain-text role tags, each message ended by the EOS token,
#: so any tokenizer with an EOS token serves). Both mark the assistant's answers with {% generation %}.
BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['role'] == 'assistant' %}"
        "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
        "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
        "{{ '\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    "zephyr": (
        "{% for message in messages %}"
        "{{ '<|' + message['role'] + '|>\n' }}"
        "{% if message['role'] == 'assistant' %}"
        "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
        "{% else %}{{ message['content'] + eos_token }}{% endif %}"
        "{{ '\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"),
}
#: the tokens each built-in template needs in the vocabulary (besides the EOS token)
BUILTIN_TOKENS: dict[str, tuple[str, ...]] = {"chatml": ("<|im_start|>", "<|im_end|>"), "zephyr": ()}
#: the special-token variables a template sees, as transformers' ``special_tokens_map``
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

_tracking: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar("kiln_chat_tracking",
                                                                                   default=None)


def _environment() -> ImmutableSandboxedEnvironment:
    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: records the span of the text rendered inside."""

        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

        def _generation(self, caller: Any) -> str:
            text = caller()
            tracking = _tracking.get()
            if tracking is not None:
                start = len("".join(tracking[0]))
                tracking[1].append((start, start + len(text)))
            return str(text)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    class TemplateDict:  # dict() without attribute access to the type
        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):  # no dunder attributes on a namespace
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, values = args[0], dict(*args[1:], **kwargs)
            for name in values:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, values)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set the attribute {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f),
                       dict=TemplateDict(), namespace=TemplateNamespace)
    return env


class ChatTemplate:
    """A jinja2 chat template, compiled as transformers compiles it.

    ``specials`` are the tokenizer's special tokens (``{"eos_token": "<|endoftext|>", ...}``), passed to
    the template as variables; ``name`` says where the template comes from (for messages).
    """

    def __init__(self, source: str, *, specials: Mapping[str, str] | None = None,
                 name: str = "chat template") -> None:
        self.source, self.name, self.specials = source, name, dict(specials or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise DataError(f"{name}: not a valid jinja2 template: {e.message} (line {e.lineno})") from None
        self.marks_generation = re.search(r"\{%-?\s*generation\s*-?%\}", source) is not None

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """The rendered chat and the character spans of its ``{% generation %}`` blocks."""
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        token = _tracking.set((blocks, spans))
        try:
            variables = {**self.specials, "messages": list(messages), "tools": None, "documents": None,
                         "add_generation_prompt": add_generation_prompt}
            for block in self._template.generate(**variables):
                blocks.append(block)
        except jinja2.TemplateError as e:
            raise DataError(f"{self.name}: {e.message or e}") from None
        finally:
            _tracking.reset(token)
        return "".join(blocks), spans

    def trained_spans(self, messages: Sequence[Mapping[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered chat and the character spans of the assistant's messages: the template's
        ``{% generation %}`` blocks, or, where it has none, what each assistant message adds to the
        chat rendered up to it with the generation prompt (its content and its end-of-turn text)."""
        text, spans = self.render(messages)
        if self.marks_generation:
            return text, spans
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)[0]
            upto = self.render(messages[:i + 1])[0]
            if not (upto.startswith(before) and text.startswith(upto)):
                raise DataError(f"{self.name}: the assistant's messages cannot be told apart (the chat "
                                f"rendered up to message {i} is not the start of the whole chat)",
                                hint="add {% generation %} ... {% endgeneration %} around the assistant's "
                                     "messages in the template, or set data.train_on_prompt = true")
            spans.append((len(before), len(upto)))
        return text, spans


def special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """The special tokens a ``tokenizer_config.json`` names, as template variables."""
    out = {}
    for key in SPECIAL_TOKENS:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[key] = value
    return out


def checkpoint_template(folder: Path) -> str | None:
    """The chat template of a tokenizer folder: its ``chat_template.jinja`` (transformers 5), else
    ``tokenizer_config.json``'s ``chat_template`` (a string, or named templates: the ``default`` one)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = tokenizer_config(folder)
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def tokenizer_config(folder: Path) -> dict[str, Any]:
    """``tokenizer_config.json`` of ``folder`` ({} without one)."""
    file = folder / "tokenizer_config.json"
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read it: {e}", file=file) from None
    return config if isinstance(config, dict) else {}
