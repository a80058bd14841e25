"""Llama 3.1 / 3.2 / 3.3: the template lists the tools as JSON ("Environment: ipython" and
'Respond in the format {"name": function name, "parameters": ...}'), and the model answers a call
with one JSON object `{"name": ..., "parameters": {...}}`, sometimes after `<|python_tag|>`. The
built-in tools are written as `<|python_tag|>brave_search.call(query="...")`. Results come back
in `ipython` turns (the template takes role "tool" too). One call per answer: the template refuses
an assistant turn with several calls, so such a turn is split into one turn per call, each followed
by its result."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from engines.base import Constraint, Tagged, literal
from gateway.chat.formats.base import (
    Calls,
    ContentDelta,
    Event,
    Format,
    JsonEnd,
    Parser,
    call_arguments,
    call_schema,
    coalesce,
    partial_suffix,
    tagged,
)
from gateway.chat.formats.jsonscan import StreamParser
from gateway.chat.template import ChatMessage, ChatTemplate, ToolCallRecord, template_message
from gateway.chat.thinking import render_thinking
from gateway.conversation import Conversation, Turn

PYTHON_TAG = "<|python_tag|>"
CALL_OPEN = '{"name"'  # how a call object starts, as the model writes it
CALL_AT_START = rf"^\s*({literal(CALL_OPEN)})"  # the trigger of a call: the answer opens with one
# Built-in tools the model calls as `NAME.call(query="...")` after <|python_tag|>.
BUILTINS = ("brave_search", "wolfram_alpha")
# The start of an answer that is a call object: `{"name"` or `{"type": "function", "name"`.
_CALL_START = re.compile(r'\{\s*"(?:name|type)"')
_BUILTIN = re.compile(r"\s*([A-Za-z_]\w*)\.call\((.*)\)\s*", re.DOTALL)


class Llama3(Format):
    name = "llama3"
    title = 'Llama 3.x {"name", "parameters"} JSON'
    tags = (PYTHON_TAG,)
    parallel = False

    def detects(self, template: str) -> bool:
        return "<|start_header_id|>" in template and (
            "Environment: ipython" in template or '"parameters": dictionary of argument name' in template)

    def turns(self, conv: Conversation, calls: Calls | None) -> list[ChatMessage]:
        out: list[ChatMessage] = []
        turns = conv.turns
        i = 0
        while i < len(turns):
            t = turns[i]
            i += 1
            if t.role != "assistant" or len(t.tool_calls) < 2:
                out.append(_message(t))
                continue
            # Several calls: one assistant turn per call, each followed by its result.
            results: list[Turn] = []
            while i < len(turns) and turns[i].role == "tool":
                results.append(turns[i])
                i += 1
            for c in t.tool_calls:
                out.append(ChatMessage("assistant", "", (ToolCallRecord(c.id, c.name,
                                                                       call_arguments(c.kind, c.arguments)),)))
                for r in [r for r in results if r.tool_call_id == c.id]:
                    out.append(_message(r))
                    results.remove(r)
            out += [_message(r) for r in results]  # results that answer no call of the turn
        return out

    def render(self, template: ChatTemplate, messages: list[ChatMessage], tools: list[dict[str, Any]] | None,
               thinking: bool | None, effort: str | None = None) -> str:
        """A result goes into its `ipython` turn as the tool wrote it: the template encodes text
        (which Jinja counts as iterable) as a JSON string otherwise."""
        turns = [template_message(m) for m in messages]
        for t in turns:
            if t["role"] in ("tool", "ipython"):
                t["content"] = _Verbatim(t["content"])
        return render_thinking(lambda kw: template.render_turns(turns, tools, True, kw), thinking)

    def parser(self, calls: Calls) -> Parser:
        return Llama3Parser(tuple(t.name for t in calls.callable))

    def constraint(self, calls: Calls, lazy: bool) -> Constraint | None:
        schema = json.dumps(call_schema(calls.callable, arguments="parameters"))
        items = [Tagged("", schema), Tagged(PYTHON_TAG, schema)]
        items += [Tagged(f"{PYTHON_TAG}{t.name}.call(query=", '{"type": "string"}', ")")
                  for t in calls.callable if t.name in BUILTINS and _query_tool(t.parameters)]
        # Under auto a call is an answer that opens with `{"name"` (a JSON object in the middle
        # of prose is prose, as in llama-server), or <|python_tag|> wherever the model writes it.
        return tagged(calls, items, triggers=[PYTHON_TAG], patterns=[CALL_AT_START], lazy=lazy)


class _Verbatim:
    """A text the template writes as it is (neither a mapping nor iterable to Jinja)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text


def _query_tool(parameters: dict[str, object]) -> bool:
    """A built-in tool's parameters are one string `query`."""
    props = parameters.get("properties")
    return isinstance(props, dict) and list(props) == ["query"]


def _message(t: Turn) -> ChatMessage:
    return ChatMessage(t.role, t.text,
                       tuple(ToolCallRecord(c.id, c.name, call_arguments(c.kind, c.arguments)) for c in t.tool_calls),
                       t.tool_call_id)


def builtin_call(text: str) -> tuple[str, str] | None:
    """`NAME.call(key="value", ...)` as (NAME, JSON arguments); None when it is not (yet) one."""
    m = _BUILTIN.fullmatch(text)
    if m is None:
        return None
    try:
        node = ast.parse(f"f({m.group(2)})", mode="eval").body
        assert isinstance(node, ast.Call) and not node.args
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        assert len(args) == len(node.keywords)
    except (SyntaxError, ValueError, AssertionError, TypeError, MemoryError, RecursionError):
        return None
    return m.group(1), json.dumps(args, ensure_ascii=False)


class Llama3Parser:
    """Reads a Llama 3.x answer character by character (so any split gives the same events):
    text, or a call object `{"name": ..., "parameters": ...}` at the answer's start, after
    <|python_tag|> or where the text writes `{"name"` (where a lazy constraint starts a call),
    or a built-in call `<|python_tag|>NAME.call(...)` of a tool of the request. The calls' JSON
    goes through StreamParser, so the events are those of every JSON format."""

    def __init__(self, tools: tuple[str, ...]) -> None:
        self.inner = StreamParser("name", "parameters")
        self.content = ""
        self._tools = tools
        self._mode = "lead"  # lead | text | tag | json | builtin
        self._buf = ""  # lead: the undecided start; text: a possible tag's start; builtin: its text
        self._end = JsonEnd()  # where the call's JSON object ends
        self._opened = 0

    @property
    def calls(self) -> list[tuple[str, str]]:
        return self.inner.calls

    @property
    def done(self) -> bool:
        """No call object is open (a built-in call starts only once it is whole)."""
        return self._mode != "json"

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        for ch in text:
            self._char(ch, out)
        return coalesce(out)

    def flush(self) -> list[Event]:
        out: list[Event] = []
        if self._mode == "text" or (self._mode == "lead" and (self._buf.strip() or not self._opened)):
            self._text(self._buf, out)  # a possible tag's start (or an answer's whitespace) is text after all
        elif self._mode == "builtin":
            self._text(self._buf, out)  # not a call of the request's tools
            self._mode = "text"
        self._buf = ""
        return out

    def _text(self, text: str, out: list[Event]) -> None:
        if text:
            self.content += text
            out.append(ContentDelta(text))

    def _char(self, ch: str, out: list[Event]) -> None:
        mode = self._mode
        if mode == "json":
            self._json(ch, out)
        elif mode == "builtin":
            self._builtin(ch, out)
        elif mode == "tag":
            if ch == "{":
                self._start_call("{", out)
            elif not ch.isspace():
                self._mode, self._buf = "builtin", ch
        elif mode == "lead":
            self._lead(ch, out)
        else:
            self._plain(ch, out)

    def _lead(self, ch: str, out: list[Event]) -> None:
        """The answer's start (or what follows a call): a call object, <|python_tag|>, or text.
        Whitespace before a call is dropped."""
        self._buf += ch
        head = self._buf.lstrip()
        if head.startswith(PYTHON_TAG):
            self._mode, self._buf = "tag", ""
            return
        if _CALL_START.match(head):
            self._buf = ""
            self._start_call(head, out)
            return
        if not head or PYTHON_TAG.startswith(head) or _could_open(head):
            return
        self._mode, text, self._buf = "text", self._buf, ""
        self._plain_text(text, out)

    def _plain(self, ch: str, out: list[Event]) -> None:
        self._plain_text(self._buf + ch, out)

    def _plain_text(self, text: str, out: list[Event]) -> None:
        """Free text: content, up to <|python_tag|> (held back while it may be one). A call
        object in the middle of text is text: a call opens the answer."""
        i = text.find(PYTHON_TAG)
        if i >= 0:
            self._text(text[:i], out)
            self._buf, self._mode = "", "tag"
            for ch in text[i + len(PYTHON_TAG):]:
                self._char(ch, out)
            return
        keep = partial_suffix(text, PYTHON_TAG)
        self._text(text[: len(text) - keep], out)
        self._buf = text[len(text) - keep:]

    def _start_call(self, head: str, out: list[Event]) -> None:
        out += self.inner.feed('{"tool_calls": [' if not self._opened else ", ")
        self._opened += 1
        self._mode, self._end = "json", JsonEnd()
        for ch in head:
            self._json(ch, out)

    def _json(self, ch: str, out: list[Event]) -> None:
        """One character of a call object, passed on until the object closes."""
        out += self.inner.feed(ch)
        if self._end.step(ch):
            self._mode, self._buf = "lead", ""

    def _builtin(self, ch: str, out: list[Event]) -> None:
        self._buf += ch
        if ch != ")":
            return
        call = builtin_call(self._buf)
        if call is None:
            return
        name, arguments = call
        if name not in self._tools:
            self._mode, text, self._buf = "text", self._buf, ""
            self._plain_text(text, out)
            return
        self._buf = ""
        self._start_call(f'{{"name": {json.dumps(name)}, "parameters": {arguments}}}', out)


def _could_open(head: str) -> bool:
    """`head` may still become the start of a call object."""
    if head[0] != "{":
        return False
    rest = head[1:].lstrip()
    return not rest or any(k.startswith(rest) for k in ('"name"', '"type"'))
