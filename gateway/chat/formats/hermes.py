"""Hermes (NousResearch Hermes 2/3, Qwen2.5, Qwen3, QwQ, SmolLM3, Granite 4): the template lists the
tools in `<tools>`, and the model writes each call as
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`; reasoning in `<think>`."""

from __future__ import annotations

import json

from engines.base import Constraint, Tagged
from gateway.chat.formats.base import (
    Calls,
    ContentDelta,
    Event,
    Format,
    Parser,
    call_schema,
    coalesce,
    partial_suffix,
    tagged,
)
from gateway.chat.formats.jsonscan import StreamParser

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class Hermes(Format):
    name = "hermes"
    title = "Hermes <tool_call> JSON"
    tags = (OPEN, CLOSE)

    def detects(self, template: str) -> bool:
        return OPEN in template

    def parser(self, calls: Calls) -> Parser:
        return TaggedJsonParser(OPEN, CLOSE)

    def constraint(self, calls: Calls, lazy: bool) -> Constraint | None:
        item = Tagged(OPEN + "\n", json.dumps(call_schema(calls.callable)), "\n" + CLOSE)
        return tagged(calls, [item], separator="\n", triggers=[OPEN], lazy=lazy)


class TaggedJsonParser:
    """Free text, then calls as JSON objects between `open` and `close` tags. The calls' JSON goes
    through StreamParser as if it were {"tool_calls": [...]}, so every JSON format yields the same
    events. `keys`: the call object's name and arguments keys."""

    def __init__(self, open_tag: str, close_tag: str, keys: tuple[str, str] = ("name", "arguments")) -> None:
        self.inner = StreamParser(*keys)
        self.content = ""
        self._open, self._close = open_tag, close_tag
        self._buf = ""
        self._in_call = False
        self._opened = 0

    @property
    def calls(self) -> list[tuple[str, str]]:
        return self.inner.calls

    @property
    def done(self) -> bool:
        """Every call opened was closed (an answer without calls is plain text, always whole)."""
        return not self._in_call

    def _text(self, text: str, out: list[Event]) -> None:
        if self._opened and not text.strip():
            return  # whitespace between calls is not content
        self.content += text
        if text:
            out.append(ContentDelta(text))

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        buf = self._buf + text
        while True:
            tag = self._close if self._in_call else self._open
            i = buf.find(tag)
            if i < 0:
                keep = partial_suffix(buf, tag)
                head, buf = buf[: len(buf) - keep], buf[len(buf) - keep :]
                if self._in_call:
                    out += self.inner.feed(head)
                else:
                    self._text(head, out)
                break
            if self._in_call:
                out += self.inner.feed(buf[:i])
            else:
                self._text(buf[:i], out)
                out += self.inner.feed('{"tool_calls": [' if not self._opened else ", ")
                self._opened += 1
            self._in_call = not self._in_call
            buf = buf[i + len(tag) :]
        self._buf = buf
        return coalesce(out)

    def flush(self) -> list[Event]:
        """At the end of the answer: text held back as a possible tag start is text after all."""
        out: list[Event] = []
        if self._buf and not self._in_call:
            self._text(self._buf, out)
        self._buf = ""
        return out
