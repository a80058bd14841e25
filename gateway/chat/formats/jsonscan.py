"""An incremental scanner of a tool answer's JSON: `{"tool_calls": [{"name": ..., "arguments": ...}, ...]}`,
`{"tool_call": {...}}` or `{"response": ...}`. Formats whose calls are JSON objects feed it their
calls' text as if it were that object, so every such format yields the same events.

It works character by character, so any split of the text gives the same events (only their
grouping differs); a call's arguments are copied byte for byte, so their fragments concatenate to
exactly its arguments text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.chat.formats.base import ArgumentsDelta, CallStarted, ContentDelta, Event, JsonEnd, coalesce

_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_SPACE = " \t\r\n"


@dataclass
class _Frame:
    kind: str  # "obj" | "arr"
    role: str  # "root" | "calls" | "call" | "" (anything else)
    key: str | None = None  # the key whose value comes next (objects)
    expect_key: bool = True


@dataclass
class _Raw:
    """A value copied through verbatim (a call's arguments; a structured response)."""

    role: str  # "args" | "response"
    end: JsonEnd = field(default_factory=JsonEnd)
    literal: bool = False


class StreamParser:
    """Incremental scanner of the constrained answer: `calls` holds (name, arguments text) per
    call, `content` the response. `keys` names the call object's keys (name, arguments)."""

    def __init__(self, name: str = "name", arguments: str = "arguments") -> None:
        self._keys = {name: "name", arguments: "args"}
        self.calls: list[tuple[str, str]] = []
        self.content = ""
        self.done = False  # the root object closed
        self._stack: list[_Frame] = []
        self._raw: _Raw | None = None
        self._string: str | None = None  # the string being read (keys, names, the response)
        self._string_role = ""
        self._escape = False
        self._hex: str | None = None  # the hex digits of a \\u escape being read
        self._high = ""  # a UTF-16 high surrogate waiting for its pair

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        for ch in text:
            self._char(ch, out)
        return coalesce(out)

    def flush(self) -> list[Event]:
        return []  # nothing is held back

    def _value_role(self) -> str:
        if not self._stack:
            return "root"
        top = self._stack[-1]
        if top.kind == "arr":
            return "call" if top.role == "calls" else ""
        if top.role == "root":
            return {"tool_calls": "calls", "tool_call": "call", "response": "response"}.get(top.key or "", "")
        if top.role == "call":
            return self._keys.get(top.key or "", "")
        return ""

    def _emit(self, role: str, ch: str, out: list[Event]) -> None:
        if role == "args":
            idx = len(self.calls) - 1
            self.calls[idx] = (self.calls[idx][0], self.calls[idx][1] + ch)
            out.append(ArgumentsDelta(idx, ch))
        else:
            self.content += ch
            out.append(ContentDelta(ch))

    def _raw_char(self, ch: str, out: list[Event]) -> bool:
        """Copy one character of a verbatim value; False when `ch` ended a bare literal unconsumed."""
        r = self._raw
        assert r is not None
        if r.literal:
            if ch in _SPACE or ch in ",}]":
                self._raw = None
                self._after_value()
                return False
            self._emit(r.role, ch, out)
            return True
        self._emit(r.role, ch, out)
        if r.end.step(ch):
            self._raw = None
            self._after_value()
        return True

    def _char(self, ch: str, out: list[Event]) -> None:
        if self.done:
            return
        if self._raw is not None and self._raw_char(ch, out):
            return
        if self._string is not None:
            self._string_char(ch, out)
            return
        if ch in _SPACE or ch == ":":
            return
        top = self._stack[-1] if self._stack else None
        if ch == ",":
            if top is not None and top.kind == "obj":
                top.expect_key = True
            return
        if ch in "}]":
            if self._stack:
                self._stack.pop()
            self._after_value()
            self.done = not self._stack
            return
        if top is not None and top.kind == "obj" and top.expect_key:
            if ch == '"':
                self._string, self._string_role = "", "key"
            return
        role = self._value_role()
        if role == "args" or (role == "response" and ch != '"'):
            # Copied verbatim: what the arguments (or a structured response) say, byte for byte.
            self._raw = _Raw(role, literal=ch not in '{["')
            self._raw_char(ch, out)
            return
        if ch in "{[":
            if role == "call":
                self.calls.append(("", ""))
            self._stack.append(_Frame("obj" if ch == "{" else "arr", role))
        elif ch == '"':
            self._string, self._string_role = "", role

    def _string_char(self, ch: str, out: list[Event]) -> None:
        if self._hex is not None:  # inside \\uXXXX
            self._hex += ch
            if len(self._hex) == 4:
                code, self._hex = self._hex, None
                self._decoded(chr(int(code, 16)), out)
            return
        if self._escape:
            self._escape = False
            if ch == "u":
                self._hex = ""
            else:
                self._decoded(_ESCAPES.get(ch, ch), out)
            return
        if ch == "\\":
            self._escape = True
        elif ch == '"':
            self._end_string(out)
        else:
            self._decoded(ch, out)

    def _decoded(self, ch: str, out: list[Event]) -> None:
        """One character of a string's value, escapes resolved."""
        if self._high:
            ch = (self._high + ch).encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            self._high = ""
        elif "\ud800" <= ch <= "\udbff":
            self._high = ch
            return
        assert self._string is not None
        self._string += ch
        if self._string_role == "response":
            self.content += ch
            out.append(ContentDelta(ch))

    def _end_string(self, out: list[Event]) -> None:
        text, role = self._string or "", self._string_role
        self._string = None
        top = self._stack[-1] if self._stack else None
        if role == "key" and top is not None:
            top.key = text
            top.expect_key = False
            return
        if role == "name" and self.calls:
            idx = len(self.calls) - 1
            self.calls[idx] = (text, self.calls[idx][1])
            out.append(CallStarted(idx, text))
        self._after_value()

    def _after_value(self) -> None:
        top = self._stack[-1] if self._stack else None
        if top is not None and top.kind == "obj":
            top.key = None
