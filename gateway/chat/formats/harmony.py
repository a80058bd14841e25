"""Harmony (OpenAI gpt-oss): every message has a header and a channel, written with the
official openai-harmony library both ways.

The prompt: a system message (model identity, dates, `Reasoning: low|medium|high`), a developer
message with the instructions (the conversation's system turns) and the tools as a TypeScript-like
`namespace functions`, then the turns; a past call is an assistant message on the commentary
channel `to=functions.NAME` with `<|constrain|>json`, its result a message from `functions.NAME`
to the assistant. The conversation is rendered to token ids and decoded to text: the engine
tokenizes prompts with special tokens parsed, so the text gives back the same ids.

The output, after the prompt's `<|start|>assistant`: messages such as
`<|channel|>analysis<|message|>...<|end|>` (reasoning), `<|start|>assistant<|channel|>final<|message|>...<|return|>`
(the answer), `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` (a call;
the recipient may also stand in the role's part of the header) and commentary without a recipient
(a preamble: text for the user). llama.cpp does not write the text of `<|end|>`, `<|return|>` and
`<|call|>` (control and end-of-generation tokens): a header's `<|start|>` or `<|channel|>` ends the
message before it, and the end of the output ends the last one.

gpt-oss cannot answer without reasoning: thinking off is effort low, and its analysis is then read
and dropped, never shown as content. A call ends the generation (`<|call|>` is an end-of-generation
token), so an answer holds one call at most.
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from engines.base import Constraint, Tagged
from gateway.chat.formats import harmony_vocab
from gateway.chat.formats.base import (
    ArgumentsDelta,
    Calls,
    CallStarted,
    ContentDelta,
    Event,
    Format,
    Parser,
    Reader,
    ReasoningDelta,
    coalesce,
    partial_suffix,
    tagged,
)
from gateway.chat.template import ChatMessage, ChatTemplate, TemplateError

# The harmony tokens a model writes; the other special tokens stay text.
SPECIALS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
ENDS = ("<|end|>", "<|return|>", "<|call|>")
EFFORTS = ("low", "medium", "high")
TRIGGER = " to=functions."  # a call's header, whichever part of it names the recipient


class Harmony(Format):
    name = "harmony"
    title = "OpenAI harmony (gpt-oss)"
    tags = SPECIALS
    levels = True

    def detects(self, template: str) -> bool:
        return all(t in template for t in ("<|start|>", "<|channel|>", "<|message|>"))

    @property
    def ready(self) -> bool:
        return harmony_vocab.loaded() is not None

    def prepare(self, cache_dir: Path, model_path: str | None) -> None:
        harmony_vocab.encoding(cache_dir, model_path)

    def render(self, template: ChatTemplate, messages: list[ChatMessage], tools: list[dict[str, Any]] | None,
               thinking: bool | None, effort: str | None = None) -> str:
        enc = harmony_vocab.required()
        try:
            ids = enc.render_conversation_for_completion(conversation(messages, tools, thinking, effort),
                                                         _role("assistant"))
            return str(enc.decode_utf8(ids))
        except Exception as exc:  # noqa: BLE001 - the library's HarmonyError, or a value it refuses
            raise TemplateError(f"harmony: {exc}") from exc

    def parser(self, calls: Calls) -> Parser:
        return HarmonyReader(harmony_vocab.required(), True)

    def reader(self, calls: Calls | None, split: bool, opened: bool,
               think: tuple[str, str] | None = None) -> Reader:
        """Always a reader: the channels are the format's, with or without tools (`split`: the
        analysis is returned as reasoning, else dropped; no other reasoning tags apply)."""
        return HarmonyReader(harmony_vocab.required(), split)

    def constraint(self, calls: Calls, lazy: bool) -> Constraint | None:
        """Under tool_choice auto, free text (the analysis, a preamble) until ` to=functions.`,
        then the tool's name, the rest of either header form and its arguments; with required or a
        named tool the answer is a call from its first token (no analysis: a constrained answer
        leaves no room to think, as for every family). The call's `<|call|>` is an
        end-of-generation token: the engine ends the output there once the JSON is whole."""
        one = replace(calls, max_calls=1)
        items: list[Tagged] = []
        for t in calls.callable:
            schema = json.dumps(t.parameters)
            if calls.lazy:
                items.append(Tagged(f"{TRIGGER}{t.name} <|constrain|>json<|message|>", schema))
                items.append(Tagged(f"{TRIGGER}{t.name}<|channel|>commentary <|constrain|>json<|message|>", schema))
            else:
                items.append(Tagged(f"<|channel|>commentary{TRIGGER}{t.name} <|constrain|>json<|message|>", schema))
        return tagged(one, items, triggers=[TRIGGER], lazy=lazy)


def _role(name: str) -> Any:
    from openai_harmony import Role

    return Role(name)


def level(effort: str | None, thinking: bool | None) -> str:
    """The reasoning level: the request's effort, else low with thinking off, else medium."""
    if effort in EFFORTS:
        return str(effort)
    return "low" if thinking is False else "medium"


def conversation(messages: list[ChatMessage], tools: list[dict[str, Any]] | None, thinking: bool | None,
                 effort: str | None) -> Any:
    """The conversation as harmony messages: system, developer (instructions and tools), turns."""
    from openai_harmony import (
        Author,
        Conversation,
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
        ToolDescription,
    )

    system = (SystemContent.new().with_reasoning_effort(ReasoningEffort(level(effort, thinking).capitalize()))
              .with_conversation_start_date(datetime.now().strftime("%Y-%m-%d")))
    out = [Message.from_role_and_content(Role.SYSTEM, system)]
    k = 0
    instructions = []
    while k < len(messages) and messages[k].role in ("system", "developer"):
        instructions.append(messages[k].content)
        k += 1
    # A tool without parameters is `() => any`, as the model's own template writes it.
    functions = [ToolDescription.new(f["name"], f.get("description", ""),
                                     f.get("parameters") if (f.get("parameters") or {}).get("properties") else None)
                 for f in (t.get("function", t) for t in tools or ())]
    if instructions or functions:
        dev = DeveloperContent.new()
        if instructions:
            dev = dev.with_instructions("\n\n".join(instructions))
        if functions:
            dev = dev.with_function_tools(functions)
        out.append(Message.from_role_and_content(Role.DEVELOPER, dev))
    called: dict[str, str] = {}  # call id -> tool name
    last = ""
    for m in messages[k:]:
        if m.role in ("system", "developer"):
            out.append(Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions(m.content)))
        elif m.role == "user":
            out.append(Message.from_role_and_content(Role.USER, m.content))
        elif m.role == "assistant":
            if m.content:
                text = Message.from_role_and_content(Role.ASSISTANT, m.content)
                out.append(text.with_channel("commentary" if m.tool_calls else "final"))
            for c in m.tool_calls:
                called[c.id], last = c.name, c.name
                out.append(Message.from_role_and_content(Role.ASSISTANT, c.arguments or "{}").with_channel("commentary")
                           .with_recipient(f"functions.{c.name}").with_content_type("<|constrain|>json"))
        elif m.role == "tool":
            name = called.get(m.tool_call_id or "", last)
            if not name:
                raise TemplateError("a tool result answers no earlier call")
            out.append(Message.from_author_and_content(Author.new(Role.TOOL, f"functions.{name}"), m.content)
                       .with_channel("commentary").with_recipient("assistant"))
    return Conversation.from_messages(out)


Kind = Literal["reasoning", "text", "call", "other"]


class HarmonyReader(Reader):
    """One answer read with harmony's StreamableParser. Each chunk is encoded with the harmony
    tokens allowed (a possible start of one held back, so that any split of the text gives the
    same events) and fed token by token."""

    def __init__(self, enc: Any, split: bool) -> None:
        from openai_harmony import Role, StreamableParser

        super().__init__(None, None)
        self.enc = enc
        self.split = split
        self._parser = StreamableParser(enc, Role.ASSISTANT)
        self._ids = {s: enc.encode(s, allowed_special={s}, disallowed_special=())[0] for s in SPECIALS}
        self._names = {v: k for k, v in self._ids.items()}
        self._assistant = enc.encode("assistant", disallowed_special=())
        self._state: Literal["header", "content", "between"] = "header"
        self._kind: Kind = "text"
        self._calls: list[list[str]] = []
        self._open = False  # a call's arguments are not whole yet
        self._buf = ""
        self._header = ""  # the header so far (the output as text, if it never has one)
        self._harmony = False  # a harmony token was seen
        self._touched = False

    @property
    def calls(self) -> list[tuple[str, str]]:
        return [(n, a) for n, a in self._calls]

    @property
    def done(self) -> bool:
        return not self._open

    @property
    def touched(self) -> bool:
        return self._touched

    def feed(self, text: str) -> list[Event]:
        buf = self._buf + text
        keep = partial_suffix(buf, *SPECIALS)
        head, self._buf = buf[: len(buf) - keep], buf[len(buf) - keep:]
        self._touched = False
        return self._tokens(head)

    def flush(self) -> list[Event]:
        out = self._tokens(self._buf)
        self._buf = ""
        if self._state == "content" and self._kind == "call":
            self._open = not _whole(self._calls[-1][1])
        elif self._state == "header" and not self._harmony and self._header:
            out += self._emit("text", self._header)  # not harmony at all: the text as it is
        return coalesce(out)

    def _tokens(self, text: str) -> list[Event]:
        out: list[Event] = []
        if text:
            for t in self.enc.encode(text, allowed_special=set(SPECIALS), disallowed_special=()):
                self._token(t, out)
        return coalesce(out)

    def _token(self, t: int, out: list[Event]) -> None:
        special = self._names.get(t)
        self._harmony = self._harmony or special is not None
        if self._state == "content" and special in ("<|start|>", "<|channel|>"):
            self._process(self._ids["<|end|>"], out)  # the end token llama.cpp writes no text for
        if self._state == "between" and special == "<|channel|>":
            for x in (self._ids["<|start|>"], *self._assistant):
                self._process(x, out)
        if self._state == "between" and special != "<|start|>":
            return  # text between messages: not part of any
        self._process(t, out)

    def _process(self, t: int, out: list[Event]) -> None:
        from openai_harmony import StreamableParser

        special = self._names.get(t)
        try:
            self._parser.process(t)
        except Exception:  # noqa: BLE001 - a token the parser refuses: it starts over between messages
            self._parser = StreamableParser(self.enc, None)
            self._end()
            return
        if self._state == "header":
            if special == "<|message|>":
                self._start(out)
            else:
                self._header += self.enc.decode([t])
        elif self._state == "content":
            if special in ENDS:
                self._end()
            elif delta := self._parser.last_content_delta:
                out += self._emit(self._kind, delta)
        elif special == "<|start|>":
            self._state, self._header = "header", ""

    def _start(self, out: list[Event]) -> None:
        """A header ended: what its message is."""
        recipient = self._parser.current_recipient or ""
        channel = self._parser.current_channel
        self._state = "content"
        if recipient.startswith("functions."):
            self._kind, self._open = "call", True
            self._calls.append([recipient.removeprefix("functions."), ""])
            out.append(CallStarted(len(self._calls) - 1, self._calls[-1][0]))
        elif recipient and recipient != "all":
            self._kind = "other"  # a built-in tool's call (browser, python): not enabled here
        else:
            self._kind = "reasoning" if channel == "analysis" else "text"
        if self._kind == "reasoning":
            self._touched = True

    def _end(self) -> None:
        if self._state == "content" and self._kind == "call":
            self._open = False
        self._state = "between"

    def _emit(self, kind: Kind, text: str) -> list[Event]:
        if kind == "reasoning":
            self._touched = True
            return [ReasoningDelta(text)] if self.split else []
        if kind == "call":
            self._calls[-1][1] += text
            self.answer += text
            if self._open and text.rstrip().endswith("}") and _whole(self._calls[-1][1]):
                self._open = False
            return [ArgumentsDelta(len(self._calls) - 1, text)]
        if kind == "text":
            self.answer += text
            return [ContentDelta(text)]
        return []


def _whole(arguments: str) -> bool:
    """The arguments are a whole JSON value."""
    try:
        json.loads(arguments)
    except ValueError:
        return False
    return True
