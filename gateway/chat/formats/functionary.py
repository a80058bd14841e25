"""Functionary v3.2 (MeetKai): the template lists the tools as a TypeScript namespace, and every
message of the model goes to a recipient: `>>>all\\n` text for the user, `>>>NAME\\n{json}` a call
of NAME, several in a row. The generation prompt already ends with `>>>`, so the answer starts
with its first recipient: `all\\nHello` or `get_weather\\n{"city": "Paris"}>>>get_time\\n{}`.
Past calls are written the same way (the template wants each call's arguments as JSON text);
results come back in `tool` turns."""

from __future__ import annotations

import json
import re
from typing import Any

from engines.base import Constraint, Tagged, literal
from gateway.chat.formats.base import (
    ArgumentsDelta,
    Calls,
    CallStarted,
    ContentDelta,
    Event,
    Format,
    JsonEnd,
    Parser,
    coalesce,
    partial_suffix,
    tagged,
)
from gateway.chat.template import ChatMessage, ChatTemplate, template_message
from gateway.chat.thinking import render_thinking

SEP = ">>>"  # starts every message: its recipient, then a newline
TEXT = "all"  # the recipient of text for the user
_NAME = re.compile(r"[\w.\-]*")


class Functionary(Format):
    name = "functionary-v3.2"
    title = "Functionary v3.2 >>>recipient"

    def detects(self, template: str) -> bool:
        return SEP + TEXT in template

    def render(self, template: ChatTemplate, messages: list[ChatMessage], tools: list[dict[str, Any]] | None,
               thinking: bool | None, effort: str | None = None) -> str:
        """The template appends each call's arguments to its text: they go in as JSON text."""
        turns = []
        for m in messages:
            turn = template_message(m)
            for record, call in zip(m.tool_calls, turn.get("tool_calls", ()), strict=True):
                call["function"]["arguments"] = record.arguments or "{}"
            turns.append(turn)
        return render_thinking(lambda kw: template.render_turns(turns, tools, True, kw), thinking)

    def parser(self, calls: Calls) -> Parser:
        return FunctionaryParser()

    def constraint(self, calls: Calls, lazy: bool) -> Constraint | None:
        # The prompt ends with `>>>`: the first call is `NAME\n{...}`, each further one follows
        # `>>>`. Under auto the constraint starts at `NAME\n`, the recipient of a call, where it
        # opens the answer or follows a `>>>` the model wrote after its text (`all\n...>>>`); a
        # tool's name at the end of a line of text is text.
        items = [Tagged(f"{t.name}\n", json.dumps(t.parameters)) for t in calls.callable]
        return tagged(calls, items, separator=SEP, lazy=lazy,
                      patterns=[f"(?:^|{literal(SEP)})({literal(t.name)}\n)" for t in calls.callable])


class FunctionaryParser:
    """Reads a Functionary v3.2 answer character by character (any split gives the same events):
    messages `RECIPIENT\\n...` separated by `>>>` (one may open the answer too). `all` messages
    are content; any other recipient is a call whose arguments are the JSON object that follows,
    copied byte for byte. An answer that names no recipient is text."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.content = ""
        self._mode = "recipient"  # recipient | text | lead | args | raw | after
        self._buf = ""
        self._end = JsonEnd()  # where the call's JSON object ends

    @property
    def done(self) -> bool:
        """No call is open: its arguments' object closed (or, not JSON, the next `>>>` came)."""
        return self._mode not in ("lead", "args", "raw")

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        for ch in text:
            self._char(ch, out)
        return coalesce(out)

    def flush(self) -> list[Event]:
        out: list[Event] = []
        if self._mode in ("recipient", "text"):
            self._text(self._buf, out)  # a recipient never finished, or a possible `>>>`: text
        elif self._mode == "raw":
            self._arguments(self._buf, out)
            self._mode = "after"
        self._buf = ""
        return out

    def _text(self, text: str, out: list[Event]) -> None:
        if text:
            self.content += text
            out.append(ContentDelta(text))

    def _arguments(self, text: str, out: list[Event]) -> None:
        if text:
            idx = len(self.calls) - 1
            self.calls[idx] = (self.calls[idx][0], self.calls[idx][1] + text)
            out.append(ArgumentsDelta(idx, text))

    def _char(self, ch: str, out: list[Event]) -> None:
        mode = self._mode
        if mode == "recipient":
            self._recipient(ch, out)
        elif mode == "args":
            self._json(ch, out)
        elif mode == "lead":
            if ch == "{":
                self._mode, self._end = "args", JsonEnd()
                self._json(ch, out)
            elif not ch.isspace():
                self._mode, self._buf = "raw", ""
                self._until_sep(ch, out)
        elif mode == "after":
            self._buf += ch
            head = self._buf.lstrip()
            if head.startswith(SEP):
                self._mode, self._buf = "recipient", ""
            elif head and not SEP.startswith(head):
                self._mode, text, self._buf = "text", self._buf, ""
                self._until_sep(text, out)
        else:
            self._until_sep(ch, out)

    def _recipient(self, ch: str, out: list[Event]) -> None:
        """The recipient up to its newline (a `>>>` before it is the message's start)."""
        self._buf += ch
        name = self._buf[len(SEP):] if self._buf.startswith(SEP) else self._buf
        if ch == "\n":
            self._buf = ""
            name = name.strip()
            if name in (TEXT, ""):
                self._mode = "text"
            else:
                self.calls.append((name, ""))
                out.append(CallStarted(len(self.calls) - 1, name))
                self._mode = "lead"
        elif not (SEP.startswith(self._buf) or _NAME.fullmatch(name.strip())):
            self._mode, text, self._buf = "text", self._buf, ""  # not a recipient: plain text
            self._until_sep("", out, text)

    def _until_sep(self, ch: str, out: list[Event], pending: str | None = None) -> None:
        """Text (or a call's arguments that are not JSON) up to the next `>>>`, held back while the
        end may be its start."""
        text = (self._buf if pending is None else pending) + ch
        raw = self._mode == "raw"
        i = text.find(SEP)
        if i >= 0:
            (self._arguments if raw else self._text)(text[:i], out)
            self._mode, self._buf = "recipient", ""
            for c in text[i + len(SEP):]:
                self._char(c, out)
            return
        keep = partial_suffix(text, SEP)
        (self._arguments if raw else self._text)(text[: len(text) - keep], out)
        self._buf = text[len(text) - keep:]

    def _json(self, ch: str, out: list[Event]) -> None:
        """One character of a call's arguments object, up to its close."""
        self._arguments(ch, out)
        if self._end.step(ch):
            self._mode, self._buf = "after", ""
