"""Qwen3-Coder: the template lists the tools as XML, and the model writes each call as

  <tool_call>
  <function=NAME>
  <parameter=KEY>
  VALUE
  </parameter>
  ...
  </function>
  </tool_call>

A string parameter's value is its raw text; any other value is JSON (the tool's parameter schema
says which). The parser turns each call into JSON arguments, streamed as the values arrive.
"""

from __future__ import annotations

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
    coalesce,
    partial_suffix,
    tagged,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"


class Qwen3Coder(Format):
    name = "qwen3-coder"
    title = "Qwen3-Coder <tool_call> <function=...> XML"
    tags = (OPEN, CLOSE)

    def detects(self, template: str) -> bool:
        return FUNCTION in template and PARAMETER in template

    def parser(self, calls: Calls) -> Parser:
        return XmlCallParser({t.name: t.parameters for t in calls.tools})

    def constraint(self, calls: Calls, lazy: bool) -> Constraint | None:
        items = [Tagged(f"{OPEN}\n{FUNCTION}{t.name}>\n", json.dumps(t.parameters), f"{FUNCTION_END}\n{CLOSE}",
                        body="xml")
                 for t in calls.callable]
        return tagged(calls, items, separator="\n", triggers=[OPEN], lazy=lazy)


def is_string(schema: Any) -> bool:
    """Whether a parameter's value is written as raw text: its schema's type is string (or string
    or null). A parameter the schema does not list is text too."""
    if not isinstance(schema, dict):
        return True
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        return bool(kinds) and all(k == "string" for k in kinds)
    return kind == "string"


def _reject_constant(name: str) -> Any:
    raise ValueError(name)


def json_value(text: str) -> str:
    """A non-string parameter's value as JSON text: the value itself when it is JSON (Python's
    True/False/None as the template writes them taken too), else the text as a JSON string."""
    raw = text.strip()
    try:
        value = json.loads(raw, parse_constant=_reject_constant)
    except ValueError:
        python = {"True": True, "False": False, "None": None}
        if raw not in python:
            return json.dumps(text, ensure_ascii=False)
        value = python[raw]
    return json.dumps(value, ensure_ascii=False)


class XmlCallParser:
    """Free text, then calls as `<function=NAME>` blocks (inside `<tool_call>` tags, or without
    them) whose `<parameter=KEY>` blocks become the keys of JSON arguments. A string value is
    streamed character by character as it arrives; any other value is given whole at its
    `</parameter>`. `schemas`: each tool's parameters schema, by name."""

    def __init__(self, schemas: dict[str, dict[str, Any]]) -> None:
        self.schemas = schemas
        self.calls: list[tuple[str, str]] = []
        self.content = ""
        self._buf = ""
        self._state = "text"  # text | opened | head | params | value_start | value
        self._string = False  # the value being read is raw text
        self._keys = 0  # parameters of the current call so far

    @property
    def done(self) -> bool:
        """No call is open (an answer without calls is plain text, always whole)."""
        return self._state in ("text", "opened")

    def _args(self, text: str, out: list[Event]) -> None:
        idx = len(self.calls) - 1
        self.calls[idx] = (self.calls[idx][0], self.calls[idx][1] + text)
        out.append(ArgumentsDelta(idx, text))

    def _text(self, text: str, out: list[Event]) -> None:
        if self.calls and not text.strip():
            return  # whitespace between and after calls is not content
        self.content += text
        if text:
            out.append(ContentDelta(text))

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._buf += text
        while self._step(out):
            pass
        return coalesce(out)

    def flush(self) -> list[Event]:
        """At the end of the answer: text held back as a possible tag's start is text after all
        (an unfinished call stays unfinished)."""
        out: list[Event] = []
        if self._state == "text" and self._buf:
            self._text(self._buf, out)
            self._buf = ""
        return out

    def _step(self, out: list[Event]) -> bool:
        """One step of reading the buffer; False when it needs more text."""
        buf = self._buf
        if self._state == "text":
            return self._in_text(buf, out)
        if self._state == "opened":
            return self._in_opened(buf)
        if self._state == "head":  # after <function=: the name up to '>'
            end = buf.find(">")
            if end < 0:
                return False
            name = buf[:end].strip()
            self.calls.append((name, ""))
            out.append(CallStarted(len(self.calls) - 1, name))
            self._args("{", out)
            self._buf, self._state, self._keys = buf[end + 1:], "params", 0
            return True
        if self._state == "params":
            return self._in_params(buf, out)
        if self._state == "value_start":  # one newline after <parameter=KEY> is not the value's
            if not buf:
                return False
            self._buf, self._state = buf[1:] if buf[0] == "\n" else buf, "value"
            if self._string:
                self._args('"', out)
            return True
        return self._in_value(buf, out)

    def _in_text(self, buf: str, out: list[Event]) -> bool:
        tags = (OPEN, CLOSE, FUNCTION)
        found = [(i, t) for t in tags if (i := buf.find(t)) >= 0]
        if not found:
            keep = partial_suffix(buf, *tags)
            if self.calls and not buf[: len(buf) - keep].strip():
                self._buf = buf  # whitespace after a call: text only if more text follows
                return False
            self._text(buf[: len(buf) - keep], out)
            self._buf = buf[len(buf) - keep:]
            return False
        i, tag = min(found)
        self._text(buf[:i], out)
        self._buf = buf[i + len(tag):]
        if tag == FUNCTION:
            self._state = "head"
        elif tag == OPEN:
            self._state = "opened"
        return True  # <tool_call> and </tool_call> themselves are dropped

    def _in_opened(self, buf: str) -> bool:
        """After <tool_call>: the whitespace before <function= is not content."""
        body = buf.lstrip()
        if body.startswith(FUNCTION):
            self._buf, self._state = body[len(FUNCTION):], "head"
            return True
        if FUNCTION.startswith(body):
            return False
        self._state = "text"  # not a call after all: the text stays text
        return True

    def _in_params(self, buf: str, out: list[Event]) -> bool:
        body = buf.lstrip()
        if not body:
            self._buf = ""
            return False
        if body.startswith(FUNCTION_END):
            self._args("}", out)
            self._buf, self._state = body[len(FUNCTION_END):], "text"
            return True
        if body.startswith(PARAMETER):
            end = body.find(">")
            if end < 0:
                self._buf = body
                return False
            key = body[len(PARAMETER):end].strip()
            name = self.calls[-1][0]
            props = self.schemas.get(name, {}).get("properties") or {}
            self._string = is_string(props.get(key))
            self._args((", " if self._keys else "") + json.dumps(key, ensure_ascii=False) + ": ", out)
            self._keys += 1
            self._buf, self._state = body[end + 1:], "value_start"
            return True
        if FUNCTION_END.startswith(body) or PARAMETER.startswith(body):
            self._buf = body
            return False
        self._buf = body[1:]  # not a tag: skipped
        return True

    def _in_value(self, buf: str, out: list[Event]) -> bool:
        end = buf.find(PARAMETER_END)
        if end < 0:
            if self._string:  # streamed, but for what may be the start of "\n</parameter>"
                keep = partial_suffix(buf, "\n" + PARAMETER_END, PARAMETER_END)
                if len(buf) > keep:
                    self._args(_escaped(buf[: len(buf) - keep]), out)
                self._buf = buf[len(buf) - keep:]
            return False
        value = buf[:end]
        value = value[:-1] if value.endswith("\n") else value
        self._args(_escaped(value) + '"' if self._string else json_value(value), out)
        self._buf, self._state = buf[end + len(PARAMETER_END):], "params"
        return True


def _escaped(text: str) -> str:
    """Text as the inside of a JSON string (character by character: pieces join to the whole)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]
