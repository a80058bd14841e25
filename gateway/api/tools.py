"""Tool calling for chat templates without native tool support: the prompt rewrite, the JSON
schema that constrains the output (compiled to a grammar by the engine), and the parser that turns
the constrained output back into OpenAI tool calls, whole or streamed.

The model answers with one JSON object:
  {"tool_calls": [{"name": <tool>, "arguments": {...}}, ...]}   (parallel_tool_calls, the default)
  {"tool_call": {"name": <tool>, "arguments": {...}}}            (parallel_tool_calls: false)
  {"response": "..."}                                           (tool_choice auto only)
The grammar makes every call well-formed: the name is one of the tools, the arguments follow that
tool's parameters schema. The parser is pure and incremental: fed any split of the text, it emits
the same events, and the arguments fragments of a call concatenate to exactly its arguments text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engines.base import Constraint
from gateway.chat.template import ChatMessage, ChatTemplate, ToolCallRecord, arguments_value
from gateway.conversation import Conversation, ToolKind, ToolSpec

# The Hermes / Qwen2.5 tool-call format: a chat template that writes these tags renders the tools
# itself, and the model answers with `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks.
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# A custom (freeform) tool is called with one string: its input text.
CUSTOM_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {"input": {"type": "string"}},
                                     "required": ["input"], "additionalProperties": False}


def parameters_of(t: ToolSpec) -> dict[str, Any]:
    return CUSTOM_PARAMETERS if t.kind == "custom" else (t.parameters or EMPTY_PARAMETERS)
# Calls in one parallel answer: at most this many, or one per tool when there are more tools.
MAX_PARALLEL_CALLS = 4


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    kind: ToolKind = "function"  # "custom": called with {"input": <text>}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "auto" | "required" | "named"
    name: str | None = None  # with "named"


class ToolRequestError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses tools: constrained to `schema`, parsed back with `parser()`.

    `native` names a chat template's own tool format ("hermes": the template renders the tools
    and the model writes <tool_call>{call}</tool_call>); "" is the rewrite for other templates.
    """

    tools: list[Tool]
    choice: ToolChoice
    parallel: bool
    schema: dict[str, Any]
    native: str = ""
    max_calls: int = 1

    def parser(self) -> StreamParser | HermesParser:
        return HermesParser() if self.native == "hermes" else StreamParser()

    def constraint(self, lazy: bool) -> Constraint | None:
        """What the output is held to. A native format in auto mode is free text until the model
        opens a call (`lazy`: the engine can start a constraint at a trigger); an engine that
        cannot gets no constraint there, and the parser reads its free text."""
        schema = json.dumps(self.schema)
        if not self.native:
            return Constraint("json", schema=schema, part="tools")
        auto = self.choice.mode == "auto"
        if auto and not lazy:
            return None
        return Constraint("tagged", schema=schema, begin=HERMES_OPEN + "\n", end="\n" + HERMES_CLOSE, separator="\n",
                          max_items=self.max_calls, triggers=(HERMES_OPEN,) if auto else (), part="tools")


def native_format(template: ChatTemplate | None) -> str:
    """The tool-call format a model's template renders itself ("hermes"), or "" for none."""
    return "hermes" if template is not None and HERMES_OPEN in template.source.text else ""


def plan(conv: Conversation, native: str = "") -> ToolPlan | None:
    """The tool plan of a request (None: answer in plain text). Raises ToolRequestError.

    `native` is the serving template's tool format, if it has one."""
    if conv.tools is not None and not conv.tools:
        raise ToolRequestError("tools must not be empty; leave it out for no tools", conv.param("tools"))
    choice = conv.tool_choice
    if choice is not None and not conv.tools:
        raise ToolRequestError("tool_choice is only allowed when tools are given", conv.param("tool_choice"))
    if not conv.tools or (choice is not None and choice.mode == "none"):
        return None
    tools = [Tool(t.name, t.description, parameters_of(t), t.kind) for t in conv.tools]
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ToolRequestError("tool names must be unique", conv.param("tools"))
    tc = ToolChoice(choice.mode if choice is not None else "auto", choice.name if choice is not None else None)
    if tc.mode == "named" and tc.name not in names:
        raise ToolRequestError(f"tool_choice names {tc.name!r}, which is not in tools", conv.param("tool_choice.name"))
    parallel = conv.parallel_tool_calls
    most = call_cap(tools, tc, parallel)
    fmt = conv.output
    if native == "hermes" and (fmt is None or fmt.type == "text"):
        return ToolPlan(tools, tc, parallel, call_schema(tools, tc), native, most)
    response: dict[str, Any] | None = None
    if fmt is not None and fmt.type == "json_object":
        response = {"type": "object"}
    elif fmt is not None and fmt.type == "json_schema":
        response = fmt.schema
    return ToolPlan(tools, tc, parallel, output_schema(tools, tc, parallel, response), max_calls=most)


def _call_arguments(kind: str, arguments: str) -> str:
    """A call's arguments as the model writes them: a custom tool's input text becomes {"input": ...}."""
    return json.dumps({"input": arguments}, ensure_ascii=False) if kind == "custom" else arguments


def render(conv: Conversation, tool_plan: ToolPlan | None) -> list[ChatMessage]:
    """The conversation as plain turns: tool calls and results as JSON text, the tool list and the
    answer format in the system text, consecutive same-role turns merged."""
    names: dict[str, str] = {}
    turns: list[tuple[str, str]] = []
    parallel = tool_plan.parallel if tool_plan else True
    for m in conv.turns:
        if m.role == "assistant" and m.tool_calls:
            for c in m.tool_calls:
                names[c.id] = c.name
            text = call_text([(c.name, _call_arguments(c.kind, c.arguments)) for c in m.tool_calls], parallel)
            turns.append(("assistant", (m.text + "\n" + text) if m.text else text))
        elif m.role == "tool":
            turns.append(("user", result_text(names.get(m.tool_call_id or ""), m.tool_call_id, m.text)))
        else:
            turns.append((m.role, m.text))
    if tool_plan is not None:
        extra = system_text(tool_plan.tools, tool_plan.choice, tool_plan.parallel)
        if turns and turns[0][0] == "system":
            turns[0] = ("system", f"{turns[0][1]}\n\n{extra}")
        else:
            turns.insert(0, ("system", extra))
    return [ChatMessage(role=r, content=t) for r, t in merge_turns(turns)]


def render_native(conv: Conversation) -> list[ChatMessage]:
    """The conversation for a template that renders tools, calls and results itself."""
    return [
        ChatMessage(
            role=m.role,
            content=m.text,
            tool_calls=tuple(ToolCallRecord(c.id, c.name, _call_arguments(c.kind, c.arguments)) for c in m.tool_calls),
            tool_call_id=m.tool_call_id,
        )
        for m in conv.turns
    ]


def template_tools(conv: Conversation) -> list[dict[str, Any]]:
    """The tools as OpenAI's chat format lists them, which chat templates expect."""
    out = []
    for t in conv.tools or ():
        fn: dict[str, Any] = {"name": t.name}
        if t.description:
            fn["description"] = t.description
        if t.kind == "custom" or t.parameters is not None:
            fn["parameters"] = parameters_of(t)
        out.append({"type": "function", "function": fn})
    return out


def uses_tool_history(conv: Conversation) -> bool:
    return conv.uses_tool_history


# --- the prompt -------------------------------------------------------------------------------


def system_text(tools: list[Tool], choice: ToolChoice, parallel: bool) -> str:
    lines = ["You can call these tools (JSON schemas of their arguments):"]
    for t in tools:
        lines.append(json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters},
                                ensure_ascii=False))
    call = '{"name": <tool name>, "arguments": {<arguments>}}'
    form = f'{{"tool_calls": [{call}, ...]}}' if parallel else f'{{"tool_call": {call}}}'
    if choice.mode == "named":
        lines.append(f"Call the tool {choice.name}. Answer with only this JSON object: {form}")
    elif choice.mode == "required":
        lines.append(f"Call one or more tools. Answer with only this JSON object: {form}")
    else:
        lines.append(f"To call tools, answer with only this JSON object: {form}. "
                     'To answer the user directly, answer with only {"response": <your answer>}.')
    return "\n".join(lines)


def call_text(calls: list[tuple[str, str]], parallel: bool) -> str:
    """An assistant turn that called tools, as the JSON the model is asked to write."""
    items = [{"name": n, "arguments": arguments_value(a)} for n, a in calls]
    obj = {"tool_calls": items} if parallel or len(items) != 1 else {"tool_call": items[0]}
    return json.dumps(obj, ensure_ascii=False)


def result_text(name: str | None, call_id: str | None, content: str) -> str:
    who = f"{name} " if name else ""
    return f"Result of tool call {who}({call_id or 'no id'}): {content}"


def merge_turns(messages: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Consecutive turns of one role joined, so strict templates (user/assistant alternation) accept them."""
    out: list[tuple[str, str]] = []
    for role, text in messages:
        if out and out[-1][0] == role:
            out[-1] = (role, f"{out[-1][1]}\n\n{text}")
        else:
            out.append((role, text))
    return out


# --- the constraint ---------------------------------------------------------------------------


def _callable(tools: list[Tool], choice: ToolChoice) -> list[Tool]:
    return [t for t in tools if choice.mode != "named" or t.name == choice.name]


def call_cap(tools: list[Tool], choice: ToolChoice, parallel: bool) -> int:
    """Calls allowed in one answer: one without parallel calls, else MAX_PARALLEL_CALLS, or one
    per callable tool when there are more (small models otherwise repeat a call until max_tokens)."""
    return max(MAX_PARALLEL_CALLS, len(_callable(tools, choice))) if parallel else 1


def call_schema(tools: list[Tool], choice: ToolChoice) -> dict[str, Any]:
    """One call: {"name": <one of the tools>, "arguments": <that tool's parameters>}."""
    chosen = _callable(tools, choice)
    calls = [
        {"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters or EMPTY_PARAMETERS},
         "required": ["name", "arguments"], "additionalProperties": False}
        for t in chosen
    ]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def output_schema(tools: list[Tool], choice: ToolChoice, parallel: bool,
                  response: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON schema every answer must match (compiled to a grammar by the engine)."""
    call = call_schema(tools, choice)
    if parallel:
        most = call_cap(tools, choice, parallel)
        branch = {"type": "object",
                  "properties": {"tool_calls": {"type": "array", "items": call, "minItems": 1, "maxItems": most}},
                  "required": ["tool_calls"], "additionalProperties": False}
    else:
        branch = {"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"],
                  "additionalProperties": False}
    if choice.mode != "auto":
        return branch
    answer = {"type": "object", "properties": {"response": response or {"type": "string"}},
              "required": ["response"], "additionalProperties": False}
    return {"anyOf": [branch, answer]}


# --- the parser -------------------------------------------------------------------------------


@dataclass(frozen=True)
class CallStarted:
    index: int
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


Event = CallStarted | ArgumentsDelta | ContentDelta

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
    depth: int = 0
    in_string: bool = False
    escape: bool = False
    literal: bool = False


class StreamParser:
    """Incremental scanner of the constrained answer.

    It works character by character, so any split of the text gives the same events (only their
    grouping differs). `calls` holds (name, arguments text) per call, `content` the response.
    """

    def __init__(self) -> None:
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
        return _coalesce(out)

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
            return {"name": "name", "arguments": "args"}.get(top.key or "", "")
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
        if r.in_string:
            if r.escape:
                r.escape = False
            elif ch == "\\":
                r.escape = True
            elif ch == '"':
                r.in_string = False
                if r.depth == 0:
                    self._raw = None
                    self._after_value()
        elif ch == '"':
            r.in_string = True
        elif ch in "{[":
            r.depth += 1
        elif ch in "}]":
            r.depth -= 1
            if r.depth == 0:
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


def _coalesce(events: list[Event]) -> list[Event]:
    """Adjacent fragments of one kind joined: one delta per kind per feed."""
    out: list[Event] = []
    for ev in events:
        last = out[-1] if out else None
        if isinstance(ev, ArgumentsDelta) and isinstance(last, ArgumentsDelta) and last.index == ev.index:
            out[-1] = ArgumentsDelta(ev.index, last.text + ev.text)
        elif isinstance(ev, ContentDelta) and isinstance(last, ContentDelta):
            out[-1] = ContentDelta(last.text + ev.text)
        else:
            out.append(ev)
    return out


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class HermesParser:
    """The Hermes / Qwen2.5 format: free text, then `<tool_call>{"name", "arguments"}</tool_call>`
    blocks. The calls' JSON goes through StreamParser as if it were {"tool_calls": [...]}, so both
    formats yield the same events."""

    def __init__(self) -> None:
        self.inner = StreamParser()
        self.content = ""
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
            tag = HERMES_CLOSE if self._in_call else HERMES_OPEN
            i = buf.find(tag)
            if i < 0:
                keep = _partial_suffix(buf, tag)
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
        return _coalesce(out)

    def flush(self) -> list[Event]:
        """At the end of the answer: text held back as a possible tag start is text after all."""
        out: list[Event] = []
        if self._buf and not self._in_call:
            self._text(self._buf, out)
        self._buf = ""
        return out
