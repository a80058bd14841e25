"""A model's chat template, rendered the way Hugging Face transformers renders it.

Every runtime's model carries its template (a GGUF's `tokenizer.chat_template`, a converted model's
`tokenizer_config.json` or `chat_template.jinja`, or models.yaml's `chat_template`); the engine
reports it (`EngineInfo.template`) and the gateway renders it here, once, for every runtime. The
environment is transformers': sandboxed, `trim_blocks`, `lstrip_blocks`, loop controls,
`{% generation %}` blocks passed through, `tojson` without ASCII escapes, `raise_exception` and
`strftime_now`; the variables are `messages`, `tools`, `add_generation_prompt`, `bos_token`,
`eos_token` and the request's template kwargs (`enable_thinking`, ...).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engines.base import EngineInfo, TemplateSource
from gateway.chat.thinking import THINK_CLOSE, THINK_OPEN, THINK_TAGS, render_thinking


@dataclass(frozen=True)
class ToolCallRecord:
    """A tool call made in an earlier assistant turn (arguments as JSON text)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[ToolCallRecord, ...] = ()  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call this result answers


def arguments_value(arguments: str) -> Any:
    """A tool call's arguments text as the JSON it holds ({} when empty), or the text itself when
    it is not JSON: history is rendered as the client sent it, never refused."""
    try:
        return json.loads(arguments) if arguments else {}
    except ValueError:
        return arguments


# Harmony's reasoning channel (gpt-oss): its templates name it, and its output writes it.
ANALYSIS = "<|channel|>analysis"


class TemplateError(ValueError):
    """The template refused the conversation (its `raise_exception`, or a Jinja error)."""


@dataclass(frozen=True)
class Traits:
    """What a template does with reasoning: `reasons` when it knows reasoning tags (`tags`:
    `<think>`, or Magistral's `[THINK]`) or harmony's analysis channel, `toggle` when it reads
    `enable_thinking`, `opens` when its generation prompt opens the block."""

    reasons: bool = False
    toggle: bool = False
    opens: bool = False
    tags: tuple[str, str] = (THINK_OPEN, THINK_CLOSE)


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' marker of trained-on text): its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """One model's compiled template with its special-token texts."""

    def __init__(self, source: TemplateSource) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        self.source = source
        self._template = env.from_string(source.text)
        self.traits = self._traits()

    def render(self, messages: Sequence[ChatMessage], tools: list[dict[str, Any]] | None = None,
               thinking: bool | None = None, add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages`, with `tools` (OpenAI's chat shape, as templates expect
        them) and thinking as asked (gateway/chat/thinking.py). Raises TemplateError."""
        turns = [template_message(m) for m in messages]
        return render_thinking(lambda kw: self.render_turns(turns, tools, add_generation_prompt, kw), thinking,
                               self.traits.tags)

    def render_turns(self, turns: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                     add_generation_prompt: bool = True, kwargs: dict[str, Any] | None = None) -> str:
        """The template applied to messages already in its shape. Raises TemplateError."""
        try:
            return self._template.render(messages=turns, tools=tools, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.source.bos_token, eos_token=self.source.eos_token,
                                         **(kwargs or {}))
        except TemplateError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the template's code trips on
            raise TemplateError(str(exc)) from exc

    def _traits(self) -> Traits:
        """Read once: the tags in the source, and the generation prompt of a one-message chat."""
        text = self.source.text
        if ANALYSIS in text:  # harmony (gpt-oss): it always reasons, in its analysis channel, whatever the prompt
            return Traits(reasons=True)
        tags = next((t for t in THINK_TAGS if t[1] in text), None)
        if tags is None:
            return Traits()
        try:
            opens = self.render_turns([{"role": "user", "content": "Hi"}]).rstrip().endswith(tags[0])
        except TemplateError:  # a template that cannot render a plain turn: nothing to learn
            opens = False
        return Traits(reasons=True, toggle="enable_thinking" in text, opens=opens, tags=tags)


@functools.lru_cache(maxsize=32)
def compiled(source: TemplateSource) -> ChatTemplate:
    """The template of `source`, compiled once per process (engines of one model share it)."""
    return ChatTemplate(source)


def template_of(info: EngineInfo) -> ChatTemplate | None:
    """The template an engine's model is served with, compiled (None: it has none)."""
    return compiled(info.template) if info.template is not None else None


def traits_of(info: EngineInfo) -> Traits:
    template = template_of(info)
    return template.traits if template is not None else Traits()


def template_message(m: ChatMessage) -> dict[str, Any]:
    """A message as chat templates expect it (tool calls with parsed arguments)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": arguments_value(c.arguments)}}
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out
