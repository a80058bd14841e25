"""Mistral: the template lists the tools in `[AVAILABLE_TOOLS]` and returns results in
`[TOOL_RESULTS]`; the model starts its calls with the `[TOOL_CALLS]` token. Two variants:

- "mistral" (tokenizer v3: Mistral 7B v0.3, Nemo 2407, Small 3.0/3.1, Ministral 8B 2410): one JSON
  array of calls, `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
- "mistral-v11" (tokenizer v11 and later: Small 3.2 2506, Devstral 2507+, Magistral, Ministral 3):
  one `[TOOL_CALLS]NAME[ARGS]{...}` per call (Small 3.2's template writes past calls with
  `[CALL_ID]ID` before `[ARGS]`, which the parser also reads). Magistral and Ministral 3 reason in
  `[THINK]...[/THINK]`.

Both templates refuse call ids that are not 9 alphanumeric characters, so `turns` maps the
client's ids ("call_8f3a...") to such ids, the same for a call and its result.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import string
from typing import Any

from engines.base import Constraint, Tagged
from gateway.chat.formats.base import (
    EMPTY_PARAMETERS,
    ArgumentsDelta,
    Calls,
    CallStarted,
    ContentDelta,
    Event,
    Format,
    JsonEnd,
    Parser,
    call_schema,
    coalesce,
    partial_suffix,
    tagged,
)
from gateway.chat.formats.jsonscan import StreamParser
from gateway.chat.template import ChatMessage, ChatTemplate
from gateway.chat.thinking import BRACKET_THINK
from gateway.conversation import Conversation

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
PLACEHOLDER = "\x00gateway: no answer\x00"  # an answer that is taken out of the prompt after rendering
_ALPHABET = string.ascii_letters + string.digits
ID_LENGTH = 9


def mistral_id(call_id: str) -> str:
    """A call id as Mistral templates take it: 9 letters and digits; an id that already is one is
    kept, any other is mapped by its hash (the same id gives the same result every time)."""
    if len(call_id) == ID_LENGTH and all(c in _ALPHABET for c in call_id):
        return call_id
    n = int.from_bytes(hashlib.sha256(call_id.encode()).digest(), "big")
    out = []
    for _ in range(ID_LENGTH):
        n, k = divmod(n, len(_ALPHABET))
        out.append(_ALPHABET[k])
    return "".join(out)


class _Mistral(Format):
    def turns(self, conv: Conversation, calls: Calls | None) -> list[ChatMessage]:
        return [
            dataclasses.replace(
                m, tool_calls=tuple(dataclasses.replace(c, id=mistral_id(c.id)) for c in m.tool_calls),
                tool_call_id=mistral_id(m.tool_call_id) if m.tool_call_id is not None else None)
            for m in super().turns(conv, calls)
        ]

    def render(self, template: ChatTemplate, messages: list[ChatMessage], tools: list[dict[str, Any]] | None,
               thinking: bool | None, effort: str | None = None) -> str:
        """Most Mistral templates refuse a user turn right after a tool result (their check wants
        user and assistant turns to alternate), which Mistral's own tokenizer writes as
        `[/TOOL_RESULTS][INST]…`. Such a turn gets a placeholder answer before it, which is taken
        out of the prompt again (with the end-of-turn token the template wrote after it)."""
        padded: list[ChatMessage] = []
        for prev, m in zip([None, *messages], messages, strict=False):
            if m.role == "user" and prev is not None and prev.role == "tool":
                padded.append(ChatMessage(role="assistant", content=PLACEHOLDER))
            padded.append(m)
        text = template.render(padded, tools, thinking)
        if len(padded) == len(messages):
            return text
        return text.replace(PLACEHOLDER + template.source.eos_token, "").replace(PLACEHOLDER, "")


class MistralV11(_Mistral):
    name = "mistral-v11"
    title = "Mistral [TOOL_CALLS]NAME[ARGS]{...}"
    tags = (TOOL_CALLS, ARGS, CALL_ID)
    think = BRACKET_THINK

    def detects(self, template: str) -> bool:
        return TOOL_CALLS in template and ARGS in template

    def parser(self, calls: Calls) -> Parser:
        return NamedArgsParser()

    def constraint(self, calls: Calls, lazy: bool) -> Constraint | None:
        items = [Tagged(f"{TOOL_CALLS}{t.name}{ARGS}", json.dumps(t.parameters or EMPTY_PARAMETERS))
                 for t in calls.callable]
        return tagged(calls, items, triggers=[TOOL_CALLS], lazy=lazy)


class Mistral(_Mistral):
    name = "mistral"
    tags = (TOOL_CALLS,)
    title = "Mistral [TOOL_CALLS][{...}] JSON array"

    def detects(self, template: str) -> bool:
        return TOOL_CALLS in template

    def parser(self, calls: Calls) -> Parser:
        return JsonArrayParser(TOOL_CALLS)

    def constraint(self, calls: Calls, lazy: bool) -> Constraint | None:
        return array_constraint(calls, TOOL_CALLS, lazy)


def array_constraint(calls: Calls, trigger: str, lazy: bool) -> Constraint | None:
    """`trigger` then a JSON array of call objects, one alternative per tool."""
    items = [Tagged("", json.dumps(call_schema([t]))) for t in calls.callable]
    return tagged(calls, items, prefix=trigger + "[", suffix="]", separator=", ", triggers=[trigger], lazy=lazy)


class _TextParser:
    """Free text until `trigger`; a subclass reads what follows. After a call, the whitespace
    that separates it from the next is no content."""

    def __init__(self, trigger: str) -> None:
        self.trigger = trigger
        self.content = ""
        self._state = "text"  # "text" | "after" | a subclass's states (inside a call)
        self._held = ""

    @property
    def done(self) -> bool:
        """Every call opened was closed (an answer without calls is plain text, always whole)."""
        return self._state in ("text", "after")

    def _text(self, text: str, out: list[Event]) -> None:
        if text:
            self.content += text
            out.append(ContentDelta(text))

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        s, self._held = self._held + text, ""
        while s:
            if self._state == "after":
                s = s.lstrip()
                if not s:
                    break
                self._state = "text"
            if self._state == "text":
                i = s.find(self.trigger)
                if i < 0:
                    keep = partial_suffix(s, self.trigger)
                    self._text(s[: len(s) - keep], out)
                    self._held = s[len(s) - keep :]
                    break
                self._text(s[:i], out)
                s = s[i + len(self.trigger) :]
                self._opened(out)
            else:
                s = self._call(s, out)
        return coalesce(out)

    def flush(self) -> list[Event]:
        """At the end of the answer: text held back as a possible trigger's start is text after all."""
        out: list[Event] = []
        if self._state == "text":
            self._text(self._held, out)
        self._held = ""
        return out

    def _opened(self, out: list[Event]) -> None:
        raise NotImplementedError

    def _call(self, s: str, out: list[Event]) -> str:
        """Read what a call's state takes of `s`; the rest (held back in `_held` when it needs more)."""
        raise NotImplementedError


class JsonArrayParser(_TextParser):
    """`trigger` then a JSON array of call objects (`[TOOL_CALLS][{...}, ...]`, Granite's
    `<|tool_call|>[...]`); the array's items go through StreamParser as `{"tool_calls": [...]}`.
    A bare object after the trigger counts as an array of one."""

    def __init__(self, trigger: str) -> None:
        super().__init__(trigger)
        self.inner = StreamParser()
        self._json = JsonEnd()
        self._arrays = 0
        self._bare = False

    @property
    def calls(self) -> list[tuple[str, str]]:
        return self.inner.calls

    def _opened(self, out: list[Event]) -> None:
        out += self.inner.feed('{"tool_calls": [' if not self._arrays else ", ")
        self._arrays += 1
        self._state = "start"

    def _call(self, s: str, out: list[Event]) -> str:
        if self._state == "start":
            s = s.lstrip()
            if not s:
                return ""
            self._json, self._bare = JsonEnd(), s[0] != "["
            self._state = "array"
            if not self._bare:
                s = s[1:]
        j = self._json
        for k, ch in enumerate(s):
            if not j.in_string and ch in "}]" and j.depth == 0:  # the array's own end
                out += self.inner.feed(s[:k])
                self._state = "after"
                return s[k + 1 :]
            if j.step(ch) and self._bare:
                out += self.inner.feed(s[: k + 1])
                self._state = "after"
                return s[k + 1 :]
        out += self.inner.feed(s)
        return ""


class NamedArgsParser(_TextParser):
    """`[TOOL_CALLS]NAME[ARGS]{...}` per call (a `[CALL_ID]ID` before `[ARGS]` is skipped): the
    arguments are copied verbatim until their JSON value ends."""

    def __init__(self) -> None:
        super().__init__(TOOL_CALLS)
        self.calls: list[tuple[str, str]] = []
        self._json = JsonEnd()
        self._literal = False  # the arguments are a bare literal (ends at a space or a tag)

    def _opened(self, out: list[Event]) -> None:
        self._state = "name"

    def _call(self, s: str, out: list[Event]) -> str:
        if self._state in ("name", "id"):
            tags = (ARGS, CALL_ID) if self._state == "name" else (ARGS,)
            found = [(i, t) for t in tags if (i := s.find(t)) >= 0]
            if not found:
                self._held = s  # the name (or id) is whole only at its tag
                return ""
            i, tag = min(found)
            if self._state == "name":
                self.calls.append((s[:i].strip(), ""))
                out.append(CallStarted(len(self.calls) - 1, self.calls[-1][0]))
            self._state = "id" if tag == CALL_ID else "start"
            return s[i + len(tag) :]
        if self._state == "start":
            s = s.lstrip()
            if not s:
                return ""
            self._json, self._state = JsonEnd(), "args"
            self._literal = s[0] not in '{["'
        j, k, end = self._json, 0, -1
        for k, ch in enumerate(s):
            if self._literal and (ch.isspace() or ch == "["):
                end = k
                break
            if j.step(ch) and not self._literal:
                end = k + 1
                break
        part = s if end < 0 else s[:end]
        if part:
            idx = len(self.calls) - 1
            self.calls[idx] = (self.calls[idx][0], self.calls[idx][1] + part)
            out.append(ArgumentsDelta(idx, part))
        if end < 0:
            return ""
        self._state = "after"
        return s[end:]
