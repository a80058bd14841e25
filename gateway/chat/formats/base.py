"""What every model family's format shares: the tools of a request, the neutral events its output
is read into, and the `Format` a family implements.

A format says how one family writes tool calls and reasoning: how its template wants the
conversation (`turns`), what its output is held to (`constraint`) and how that output is read back
(`parser`), incrementally, into the same events whatever the split of the text into chunks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from engines.base import Constraint, Tagged
from gateway.chat.template import ChatMessage, ChatTemplate, ToolCallRecord
from gateway.chat.thinking import THINK_CLOSE, THINK_OPEN, Splitter
from gateway.conversation import Conversation, ToolKind, ToolSpec

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# A custom (freeform) tool is called with one string: its input text.
CUSTOM_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {"input": {"type": "string"}},
                                     "required": ["input"], "additionalProperties": False}
# Calls in one parallel answer: at most this many, or one per tool when there are more tools.
MAX_PARALLEL_CALLS = 4


def parameters_of(t: ToolSpec) -> dict[str, Any]:
    return CUSTOM_PARAMETERS if t.kind == "custom" else (t.parameters or EMPTY_PARAMETERS)


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


@dataclass(frozen=True)
class Calls:
    """The calls one request may make: which tools, whether it must, and how many at once."""

    tools: tuple[Tool, ...]
    choice: ToolChoice
    parallel: bool
    max_calls: int
    response: dict[str, Any] | None = None  # the answer's JSON schema, when it is not a call (generic format)

    @property
    def callable(self) -> list[Tool]:
        return [t for t in self.tools if self.choice.mode != "named" or t.name == self.choice.name]

    @property
    def lazy(self) -> bool:
        """Free text is allowed before a call (tool_choice auto)."""
        return self.choice.mode == "auto"


def call_cap(tools: Sequence[Tool], choice: ToolChoice, parallel: bool) -> int:
    """Calls allowed in one answer: one without parallel calls, else MAX_PARALLEL_CALLS, or one
    per callable tool when there are more (small models otherwise repeat a call until max_tokens)."""
    n = len([t for t in tools if choice.mode != "named" or t.name == choice.name])
    return max(MAX_PARALLEL_CALLS, n) if parallel else 1


def call_schema(tools: Sequence[Tool], arguments: str = "arguments") -> dict[str, Any]:
    """One call: {"name": <one of the tools>, <arguments>: <that tool's parameters>}."""
    calls = [
        {"type": "object", "properties": {"name": {"const": t.name}, arguments: t.parameters or EMPTY_PARAMETERS},
         "required": ["name", arguments], "additionalProperties": False}
        for t in tools
    ]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


# --- the events an output is read into -----------------------------------------------------------


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


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


Event = CallStarted | ArgumentsDelta | ContentDelta | ReasoningDelta


def coalesce(events: list[Event]) -> list[Event]:
    """Adjacent fragments of one kind joined: one delta per kind per feed."""
    out: list[Event] = []
    for ev in events:
        last = out[-1] if out else None
        if isinstance(ev, ArgumentsDelta) and isinstance(last, ArgumentsDelta) and last.index == ev.index:
            out[-1] = ArgumentsDelta(ev.index, last.text + ev.text)
        elif isinstance(ev, ContentDelta) and isinstance(last, ContentDelta):
            out[-1] = ContentDelta(last.text + ev.text)
        elif isinstance(ev, ReasoningDelta) and isinstance(last, ReasoningDelta):
            out[-1] = ReasoningDelta(last.text + ev.text)
        else:
            out.append(ev)
    return out


def partial_suffix(text: str, *tags: str) -> int:
    """Length of the longest end of `text` that could be the start of one of `tags`."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if tag.startswith(text[-n:]):
                best = n
                break
    return best


class Parser(Protocol):
    """An incremental reader of one answer: any split of the text gives the same events (only
    their grouping differs)."""

    @property
    def calls(self) -> list[tuple[str, str]]:
        """(name, arguments text) of each call so far."""
        ...

    @property
    def done(self) -> bool:
        """Every call opened was closed."""
        ...

    def feed(self, text: str) -> list[Event]: ...

    def flush(self) -> list[Event]:
        """At the end of the answer: what was held back (a possible tag's start)."""
        ...


class Reader:
    """One answer's reader: the reasoning split off (its tags), then the rest through the tool
    parser (or as text, with no tools)."""

    def __init__(self, parser: Parser | None, splitter: Splitter | None) -> None:
        self.parser = parser
        self.splitter = splitter
        self.answer = ""  # the text after the reasoning, as the model wrote it

    @property
    def calls(self) -> list[tuple[str, str]]:
        return self.parser.calls if self.parser is not None else []

    @property
    def done(self) -> bool:
        return self.parser.done if self.parser is not None else True

    @property
    def touched(self) -> bool:
        """The last feed was (partly) reasoning: its tokens count as reasoning tokens."""
        return self.splitter is not None and self.splitter.touched

    def feed(self, text: str) -> list[Event]:
        if self.splitter is None:
            return self._rest(text)
        out: list[Event] = []
        for kind, part in self.splitter.feed(text):
            out += [ReasoningDelta(part)] if kind == "reasoning" else self._rest(part)
        return out

    def flush(self) -> list[Event]:
        out: list[Event] = []
        if self.splitter is not None:
            for kind, part in self.splitter.flush():
                out += [ReasoningDelta(part)] if kind == "reasoning" else self._rest(part)
        if self.parser is not None:
            out += self.parser.flush()
        return out

    def _rest(self, text: str) -> list[Event]:
        self.answer += text
        if self.parser is not None:
            return self.parser.feed(text)
        return [ContentDelta(text)] if text else []


class Format:
    """One family's format. Subclasses set the class variables and override what differs.

    `native`: the template renders tools, calls and results itself (else the gateway rewrites
    them into plain turns: the generic format). `think`: the family's reasoning tags; `tags`:
    those of its calls. `parallel`: the family writes several calls in one answer (else one
    call per answer, whatever the request allows). `levels`: its models reason at a level the
    prompt sets (low, medium, high)."""

    name: ClassVar[str]
    title: ClassVar[str]
    native: ClassVar[bool] = True
    parallel: ClassVar[bool] = True
    think: ClassVar[tuple[str, str]] = (THINK_OPEN, THINK_CLOSE)
    tags: ClassVar[tuple[str, ...]] = ()  # the texts of its calls' tags
    levels: ClassVar[bool] = False  # the model reads a reasoning level (`render`'s effort)

    @property
    def shown(self) -> tuple[str, ...]:
        """The family's tags: shown in the output even where the vocabulary makes them control
        tokens (which engines otherwise leave out of the text)."""
        return (*self.tags, *self.think)

    def detects(self, template: str) -> bool:
        """Whether a chat template's source speaks this format."""
        return False

    def turns(self, conv: Conversation, calls: Calls | None) -> list[ChatMessage]:
        """The conversation as the template wants it (`calls`: the tools of this request, if it
        may call them): calls and results as records."""
        return [
            ChatMessage(role=m.role, content=m.text,
                        tool_calls=tuple(ToolCallRecord(c.id, c.name, call_arguments(c.kind, c.arguments))
                                         for c in m.tool_calls),
                        tool_call_id=m.tool_call_id)
            for m in conv.turns
        ]

    @property
    def ready(self) -> bool:
        """What the format needs of the model is there (`prepare` has nothing left to do)."""
        return True

    def prepare(self, cache_dir: Path, model_path: str | None) -> None:
        """Make what the format needs of the served model (`model_path`: its file, if it has one),
        in the model cache `cache_dir`. Raises FormatUnavailable (engines.base.ModelNotAvailable)."""

    def render(self, template: ChatTemplate, messages: list[ChatMessage], tools: list[dict[str, Any]] | None,
               thinking: bool | None, effort: str | None = None) -> str:
        """The prompt. Raises TemplateError."""
        return template.render(messages, tools, thinking)

    def parser(self, calls: Calls) -> Parser:
        raise NotImplementedError

    def constraint(self, calls: Calls, lazy: bool) -> Constraint | None:
        """What a tool answer is held to. Under tool_choice auto a call starts at a trigger
        (`lazy`: the engine can start a constraint there); an engine that cannot gets no
        constraint, and the parser reads its free text."""
        raise NotImplementedError

    def reader(self, calls: Calls | None, split: bool, opened: bool,
               think: tuple[str, str] | None = None) -> Reader | None:
        """The reader of one answer (None: the text as it is); `think`: the reasoning tags, where
        models.yaml's `reasoning_format` names others than the family's."""
        if calls is None and not split:
            return None
        return Reader(self.parser(calls) if calls is not None else None,
                      Splitter(opened, think or self.think) if split else None)


def call_arguments(kind: str, arguments: str) -> str:
    """A call's arguments as the model writes them: a custom tool's input text becomes {"input": ...}."""
    return json.dumps({"input": arguments}, ensure_ascii=False) if kind == "custom" else arguments


def tagged(calls: Calls, items: Sequence[Tagged], *, prefix: str = "", suffix: str = "", separator: str = "",
           triggers: Sequence[str] = (), patterns: Sequence[str] = (), lazy: bool) -> Constraint | None:
    """The usual constraint of a native format: `items` between `prefix` and `suffix`; under
    tool_choice auto free until one of `triggers` or `patterns` (None where the engine cannot
    start late)."""
    if calls.lazy and not lazy:
        return None
    return Constraint("tagged", items=tuple(items), prefix=prefix, suffix=suffix, separator=separator,
                      max_items=calls.max_calls, triggers=tuple(triggers) if calls.lazy else (),
                      patterns=tuple(patterns) if calls.lazy else (), part="tools")


def first_repeat(calls: list[tuple[str, str]]) -> int | None:
    """The position of the first call identical (name and arguments, ignoring spacing) to an earlier
    one (small models repeat a call until max_tokens)."""
    seen: set[tuple[str, str]] = set()
    for k, (name, args) in enumerate(calls):
        try:
            key = (name, json.dumps(json.loads(args or "{}"), sort_keys=True))
        except ValueError:
            key = (name, args)
        if key in seen:
            return k
        seen.add(key)
    return None


class JsonEnd:
    """Where one JSON value ends, character by character (strings and nesting followed)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False

    def step(self, ch: str) -> bool:
        """Follow `ch`; True when it ends the value (the bracket or quote that closes it at the top)."""
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                return self.depth == 0
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            return self.depth == 0
        return False
