"""Command R7B (Cohere): the model plans between `<|START_THINKING|>` and `<|END_THINKING|>`
(its reasoning), then either calls tools,

  <|START_ACTION|>[
      {"tool_call_id": "0", "tool_name": NAME, "parameters": {...}}
  ]<|END_ACTION|>

or answers between `<|START_RESPONSE|>` and `<|END_RESPONSE|>` (the answer is the text inside).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from engines.base import Constraint, Tagged
from gateway.chat.formats.base import (
    ArgumentsDelta,
    Calls,
    CallStarted,
    ContentDelta,
    Event,
    Format,
    Parser,
    Reader,
    coalesce,
    partial_suffix,
    tagged,
)
from gateway.chat.formats.jsonscan import StreamParser
from gateway.chat.template import ChatMessage, ChatTemplate, template_message
from gateway.chat.thinking import Splitter

THINK_OPEN, THINK_CLOSE = "<|START_THINKING|>", "<|END_THINKING|>"
ACTION_OPEN, ACTION_CLOSE = "<|START_ACTION|>", "<|END_ACTION|>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<|START_RESPONSE|>", "<|END_RESPONSE|>"


class CommandR7B(Format):
    name = "command-r7b"
    title = "Command R7B <|START_ACTION|> JSON list"
    tags = (ACTION_OPEN, ACTION_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE)
    think = (THINK_OPEN, THINK_CLOSE)

    def detects(self, template: str) -> bool:
        return ACTION_OPEN in template

    def render(self, template: ChatTemplate, messages: list[ChatMessage], tools: list[dict[str, Any]] | None,
               thinking: bool | None, effort: str | None = None) -> str:
        """Thinking off: an empty plan after the generation prompt, so the model acts at once."""
        kwargs = {"enable_thinking": thinking} if thinking is not None else {}
        prompt = template.render_turns([template_message(m) for m in messages], tools, True, kwargs)
        if thinking is False and not prompt.rstrip().endswith(THINK_CLOSE):
            prompt += THINK_OPEN + THINK_CLOSE
        return prompt

    def parser(self, calls: Calls) -> Parser:
        return ActionParser()

    def reader(self, calls: Calls | None, split: bool, opened: bool,
               think: tuple[str, str] | None = None) -> Reader | None:
        """Always a reader: the answer's tags are never text, and the plan is reasoning."""
        return Reader(ActionParser(), Splitter(opened, think or self.think))

    def constraint(self, calls: Calls, lazy: bool) -> Constraint | None:
        items = [Tagged("", json.dumps(call_object(t.name, t.parameters))) for t in calls.callable]
        return tagged(calls, items, prefix=ACTION_OPEN + "[\n    ", suffix="\n]" + ACTION_CLOSE,
                      separator=",\n    ", triggers=[ACTION_OPEN], lazy=lazy)


def call_object(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """The schema of one call in the action's list."""
    return {"type": "object",
            "properties": {"tool_call_id": {"type": "string", "pattern": "^[0-9]{1,3}$"}, "tool_name": {"const": name},
                           "parameters": parameters},
            "required": ["tool_call_id", "tool_name", "parameters"], "additionalProperties": False}


class ActionParser:
    """The answer: text inside (or outside) the response tags, without them; calls from the action's
    JSON list, read through StreamParser as if it were {"tool_calls": [...]}. An answer with several
    action blocks has the calls of all, numbered on."""

    def __init__(self) -> None:
        self.inner = StreamParser("tool_name", "parameters")
        self._before: list[tuple[str, str]] = []  # the calls of earlier action blocks
        self.content = ""
        self._buf = ""
        self._in_action = False
        self._acted = False

    @property
    def calls(self) -> list[tuple[str, str]]:
        return self._before + self.inner.calls

    def _action(self, text: str) -> list[Event]:
        """The current action block's events, its calls numbered after the earlier blocks' ones."""
        n = len(self._before)
        return [dataclasses.replace(e, index=e.index + n) if isinstance(e, CallStarted | ArgumentsDelta) else e
                for e in self.inner.feed(text)]

    @property
    def done(self) -> bool:
        return not self._in_action

    def _text(self, text: str, out: list[Event]) -> None:
        self.content += text
        if text:
            out.append(ContentDelta(text))

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        buf = self._buf + text
        while True:
            tags = (ACTION_CLOSE,) if self._in_action else (ACTION_OPEN, RESPONSE_OPEN, RESPONSE_CLOSE)
            found = [(i, t) for t in tags if (i := buf.find(t)) >= 0]
            if not found:
                keep = partial_suffix(buf, *tags)
                head, buf = buf[: len(buf) - keep], buf[len(buf) - keep:]
                if self._in_action:
                    out += self._action(head)
                elif self._acted and not head.strip():
                    buf = head + buf  # whitespace after the action: text only if more text follows
                else:
                    self._text(head, out)
                break
            i, tag = min(found)
            if self._in_action:
                out += self._action(buf[:i] + "}")
                self._in_action = False
            else:
                if not (self._acted and not buf[:i].strip()):
                    self._text(buf[:i], out)
                if tag == ACTION_OPEN:
                    if self._acted:  # another block: a list of its own
                        self._before, self.inner = self.calls, StreamParser("tool_name", "parameters")
                    self._in_action = self._acted = True
                    out += self._action('{"tool_calls": ')
            buf = buf[i + len(tag):]
        self._buf = buf
        return coalesce(out)

    def flush(self) -> list[Event]:
        out: list[Event] = []
        if self._buf and not self._in_action and not (self._acted and not self._buf.strip()):
            self._text(self._buf, out)
        self._buf = ""
        return out
