"""Granite 3.x (IBM Granite 3.1-3.3): the template lists the tools in an `available_tools` turn,
and the model writes its calls as one JSON array after `<|tool_call|>`:
`<|tool_call|>[{"name": ..., "arguments": {...}}]`. The template renders an assistant turn's
content only, so past calls are written into it the way the model wrote them; results are `tool`
turns.

Reasoning: Granite 3.3's template reads its own switch, `thinking` (not `enable_thinking`): with it
on (and no tools or documents) the system prompt asks for `<think>...</think>` then
`<response>...</response>`; with it off the model answers at once, so no empty block is added. The
`<response>` tags are taken out of the answer. (Granite 4 speaks Hermes' `<tool_call>`.)
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from engines.base import Constraint
from gateway.chat.formats.base import Calls, Event, Format, Parser, Reader, ReasoningDelta, partial_suffix
from gateway.chat.formats.mistral import JsonArrayParser, array_constraint
from gateway.chat.template import ChatMessage, ChatTemplate, arguments_value, template_message
from gateway.chat.thinking import Splitter
from gateway.conversation import Conversation

TOOL_CALL = "<|tool_call|>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<response>", "</response>"


class Granite(Format):
    name = "granite"
    title = "Granite <|tool_call|>[{...}] JSON array"
    tags = (TOOL_CALL,)

    def detects(self, template: str) -> bool:
        return TOOL_CALL in template

    def turns(self, conv: Conversation, calls: Calls | None) -> list[ChatMessage]:
        out = []
        for m in super().turns(conv, calls):
            if m.tool_calls:
                written = json.dumps([{"name": c.name, "arguments": arguments_value(c.arguments)}
                                      for c in m.tool_calls], ensure_ascii=False)
                m = dataclasses.replace(m, content=m.content + TOOL_CALL + written, tool_calls=())
            out.append(m)
        return out

    def render(self, template: ChatTemplate, messages: list[ChatMessage], tools: list[dict[str, Any]] | None,
               thinking: bool | None, effort: str | None = None) -> str:
        kwargs = {} if thinking is None else {"thinking": thinking}
        return template.render_turns([template_message(m) for m in messages], tools, True, kwargs)

    def parser(self, calls: Calls) -> Parser:
        return JsonArrayParser(TOOL_CALL)

    def constraint(self, calls: Calls, lazy: bool) -> Constraint | None:
        return array_constraint(calls, TOOL_CALL, lazy)

    def reader(self, calls: Calls | None, split: bool, opened: bool,
               think: tuple[str, str] | None = None) -> Reader | None:
        if not split:
            return super().reader(calls, split, opened)
        return ResponseReader(self.parser(calls) if calls is not None else None, Splitter(opened, think or self.think))


class ResponseReader(Reader):
    """A reader that takes Granite's `<response>`/`</response>` tags out of the answer (a tag cut
    across chunks is held back until it is whole or proves not to be one)."""

    def __init__(self, parser: Parser | None, splitter: Splitter | None) -> None:
        super().__init__(parser, splitter)
        self._held = ""

    def _rest(self, text: str) -> list[Event]:
        s, self._held = self._held + text, ""
        s = s.replace(RESPONSE_OPEN, "").replace(RESPONSE_CLOSE, "")
        keep = partial_suffix(s, RESPONSE_OPEN, RESPONSE_CLOSE)
        s, self._held = s[: len(s) - keep], s[len(s) - keep :]
        return super()._rest(s) if s else []

    def flush(self) -> list[Event]:
        out: list[Event] = []
        if self.splitter is not None:
            for kind, part in self.splitter.flush():
                out += [ReasoningDelta(part)] if kind == "reasoning" else self._rest(part)
        held, self._held = self._held, ""
        if held:
            out += super()._rest(held)
        if self.parser is not None:
            out += self.parser.flush()
        return out
