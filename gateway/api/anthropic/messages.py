"""Anthropic's Messages API over the conversation model: a request's `system`, `messages` (text,
`tool_use`, `tool_result` blocks), `tools` and `tool_choice` -> `Conversation`; the neutral output
events -> a message, or Anthropic's stream events in order (`message_start`, `content_block_start`,
`content_block_delta`, `content_block_stop`, `message_delta`, `message_stop`).

The bodies are typed in `schema` (a wrong type or range is a 400 naming the field). What the
gateway cannot honour is accepted and named, never a 400 for the whole request: request fields in
`X-Ignored-Fields`, Anthropic-defined tools (bash, text editor, web search, computer use) in
`X-Skipped-Tools`. Images and documents are a 400 until the gateway serves a vision model.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from gateway.api.anthropic.adapter import ANTHROPIC
from gateway.api.anthropic.schema import (
    BuiltinTool,
    CountTokensRequest,
    CustomTool,
    DocumentBlock,
    ImageBlock,
    MessageParam,
    MessagesRequest,
    OutputConfig,
    TextBlock,
    ThinkingDisabled,
    ThinkingEnabled,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from gateway.api.bodies import unknown_fields
from gateway.api.errors import invalid, to_api_error
from gateway.api.images import image_part
from gateway.api.notes import Notes
from gateway.chat import images
from gateway.conversation import (
    ArgumentsDelta,
    CallStarted,
    Conversation,
    Finished,
    Output,
    Part,
    ReasoningDelta,
    Sampling,
    TextDelta,
    ToolCall,
    ToolChoice,
    ToolSpec,
    Turn,
    Usage,
)

__all__ = ["Assembler", "CountTokensRequest", "MessageObject", "MessageStreamEvent", "MessagesRequest", "TokenCount",
           "conversation", "effort", "generate", "message_id", "note_thinking", "stop_reason", "thinking", "tool_input", "usage_obj"]


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class MessageObject(BaseModel):
    """The message as the SDK parses it (for the OpenAPI document)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: MessageUsage


class MessageStreamEvent(BaseModel):
    """One event of the stream: its `type` is also the SSE `event:` name."""

    model_config = ConfigDict(extra="allow")
    type: Literal["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                  "message_delta", "message_stop", "ping", "error"]


class TokenCount(BaseModel):
    input_tokens: int


# --- request -> conversation ------------------------------------------------------------------------


_DOCUMENT = "document blocks are not supported"


def _text_of(blocks: str | Sequence[BaseModel], param: str, what: str) -> str:
    """A string, or text blocks joined (the form `system` and tool results take)."""
    if isinstance(blocks, str):
        return blocks
    out = []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            out.append(b.text)
        elif isinstance(b, ImageBlock | DocumentBlock):
            raise invalid(f"{what} takes text blocks here (got {b.type})", param=f"{param}[{j}].type",
                          code="unsupported_content")
        else:
            raise invalid(f"{what} takes text blocks (got {getattr(b, 'type', None)!r})", param=f"{param}[{j}].type")
    return "\n".join(out)


def _image(b: ImageBlock, param: str) -> Part:
    """An image block: base64 data of its media type (a `url` source is not fetched)."""
    src = b.source
    if src.get("type") == "url":
        return image_part(lambda: images.from_url(str(src.get("url", ""))), f"{param}.source.url")
    if src.get("type") != "base64" or not isinstance(src.get("data"), str):
        raise invalid("an image block's source is {type: base64, media_type, data}", param=f"{param}.source")
    media = src.get("media_type")
    return image_part(lambda: images.from_base64(src["data"], media if isinstance(media, str) else None),
                      f"{param}.source.data")


def _message(m: MessageParam, i: int) -> list[Turn]:
    """One message as turns: tool results become tool turns (before the message's own text)."""
    param = f"messages[{i}]"
    if m.role == "system":  # Claude Code sends system messages between turns (reminders)
        return [Turn.of("system", _text_of(m.content, f"{param}.content", "a system message"))]
    if isinstance(m.content, str):
        return [Turn.of(m.role, m.content)]
    parts: list[Part] = []
    calls: list[ToolCall] = []
    results: list[Turn] = []
    for j, b in enumerate(m.content):
        bp = f"{param}.content[{j}]"
        if isinstance(b, TextBlock):
            joint = "\n" if m.role == "user" and parts and parts[-1].type == "text" else ""
            parts.append(Part("text", joint + b.text))
        elif isinstance(b, ToolUseBlock):
            if m.role != "assistant":
                raise invalid("tool_use blocks belong to assistant messages", param=f"{bp}.type")
            calls.append(ToolCall(b.id, b.name, json.dumps(b.input, ensure_ascii=False)))
        elif isinstance(b, ToolResultBlock):
            if m.role != "user":
                raise invalid("tool_result blocks belong to user messages", param=f"{bp}.type")
            text = _text_of(b.content, f"{bp}.content", "a tool result's content")
            results.append(Turn.of("tool", f"Error: {text}" if b.is_error else text, tool_call_id=b.tool_use_id))
        elif isinstance(b, ImageBlock):
            parts.append(_image(b, bp))
        elif isinstance(b, DocumentBlock):
            raise invalid(_DOCUMENT, param=bp, code="unsupported_content")
        # thinking, redacted_thinking and server-side tools' blocks: accepted, not re-rendered
    turns = results
    if m.role == "assistant":
        turns.append(Turn("assistant", tuple(parts), tool_calls=tuple(calls)))
    elif parts or not results:
        turns.append(Turn("user", tuple(parts)))
    return turns


def _tools(tools: list[CustomTool | BuiltinTool] | None, notes: Notes) -> tuple[ToolSpec, ...] | None:
    if tools is None:
        return None
    out = []
    for t in tools:
        if isinstance(t, BuiltinTool):
            # Anthropic-defined tools (bash_…, text_editor_…, web_search_…, computer_…): run by
            # Anthropic or described only by their type; skipped and named.
            notes.skipped_tools.add(t.name or t.type)
            continue
        out.append(ToolSpec(t.name, t.description or "", t.input_schema))
    return tuple(out) or None  # an empty list: no tools


def _choice(choice: ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone | None) -> tuple[ToolChoice | None, bool]:
    """(tool choice, parallel calls allowed)."""
    if choice is None:
        return None, True
    if isinstance(choice, ToolChoiceNone):
        return ToolChoice("none"), True
    parallel = not choice.disable_parallel_tool_use
    if isinstance(choice, ToolChoiceTool):
        return ToolChoice("named", choice.name), parallel
    return ToolChoice("auto" if isinstance(choice, ToolChoiceAuto) else "required"), parallel


def _output(config: OutputConfig | None, notes: Notes) -> Output | None:
    """`output_config.format` (structured outputs): the answer must match the JSON schema."""
    if config is None:
        return None
    if config.effort is not None:
        notes.ignored.add("output_config.effort")
    if config.format is None:
        return None
    return Output("json_schema", config.format.schema_, "output", True)


def _note_ignored(req: MessagesRequest | CountTokensRequest, notes: Notes) -> None:
    notes.ignored.update(unknown_fields(req))
    if isinstance(req.thinking, ThinkingEnabled):
        notes.ignored.add("thinking.budget_tokens")  # a model without reasoning levels thinks as long as it does


def conversation(req: MessagesRequest | CountTokensRequest, notes: Notes) -> Conversation:
    system = [_text_of(req.system, "system", "system")] if req.system is not None else []
    turns: list[Turn] = []
    for i, m in enumerate(req.messages):
        for t in _message(m, i):
            # System messages between turns (Claude Code's environment notes) join the system
            # prompt: chat templates expect it first, and a small model shown a system turn last
            # copies it instead of answering the user.
            if t.role == "system":
                system.append(t.text)
            else:
                turns.append(t)
    if any(system):
        turns.insert(0, Turn.of("system", "\n\n".join(s for s in system if s)))
    tools = _tools(req.tools, notes)
    choice, parallel = _choice(req.tool_choice)
    if tools is None and choice is not None:
        choice = None  # the only tools were skipped (or none were given): nothing to choose from
    _note_ignored(req, notes)
    output = _output(req.output_config, notes)
    return Conversation(tuple(turns), tools, choice, parallel, output, thinking(req), _sampling(req),
                        params={"tools": "tools", "tool_choice": "tool_choice", "tool_choice.name": "tool_choice.name"},
                        effort=effort(req))


def thinking(req: MessagesRequest | CountTokensRequest) -> bool | None:
    """`thinking`: disabled answers at once; enabled or adaptive thinks; absent, the model's default
    (a local model that thinks does so unless told not to, and its thinking blocks are returned)."""
    if req.thinking is None:
        return None
    return not isinstance(req.thinking, ThinkingDisabled)


def note_thinking(conv: Conversation, reasons: bool, levels: bool, notes: Notes) -> None:
    """X-Ignored-Fields once the model is known: `thinking` for a model that does not think, and
    `thinking.budget_tokens` only for one without reasoning levels (with levels, it is the level)."""
    if conv.thinking and not reasons:  # the model does not think: nothing to enable
        notes.ignored.discard("thinking.budget_tokens")
        notes.ignored.add("thinking")
    elif conv.effort is not None and levels:
        notes.ignored.discard("thinking.budget_tokens")


def effort(req: MessagesRequest | CountTokensRequest) -> str | None:
    """`thinking.budget_tokens` as a reasoning level, for a model with levels: under 4096 low,
    under 16384 medium, else high (None: no budget given)."""
    if not isinstance(req.thinking, ThinkingEnabled):
        return None
    budget = req.thinking.budget_tokens
    return "low" if budget < 4096 else "medium" if budget < 16384 else "high"


def _sampling(req: MessagesRequest | CountTokensRequest) -> Sampling:
    """The request's sampler settings; counting tokens is a one-token greedy generation (the prompt
    it leaves in the KV cache speeds up the request that usually follows)."""
    if isinstance(req, CountTokensRequest):
        return Sampling(temperature=0.0, max_tokens=1)
    return Sampling(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, max_tokens=req.max_tokens,
                    stop=tuple(req.stop_sequences or ()))


# --- output -> message ------------------------------------------------------------------------------


def usage_obj(usage: Usage | None) -> dict[str, Any]:
    """Anthropic counts the prompt's cached part apart from `input_tokens`."""
    u = usage or Usage(0, 0)
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}


def stop_reason(e: Finished) -> tuple[str, str | None]:
    if e.calls:
        return "tool_use", None
    if e.reason == "length":
        return "max_tokens", None
    if e.stop_sequence:
        return "stop_sequence", e.stop_sequence
    return "end_turn", None


def tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class Assembler:
    """Neutral output events -> content blocks and Anthropic's stream events, in order."""

    def __init__(self, message_id: str, model: str) -> None:
        self.id = message_id
        self.model = model
        self.blocks: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the block being streamed
        self._json = ""  # the open tool_use block's input so far
        self.stop: tuple[str, str | None] = ("end_turn", None)
        self.usage: Usage | None = None

    def message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": self.blocks,
                "stop_reason": self.stop[0], "stop_sequence": self.stop[1], "usage": usage_obj(self.usage)}

    def start(self, prompt_tokens: int = 0, cached_tokens: int = 0) -> dict[str, Any]:
        """`message_start`, with the prompt's tokens as Anthropic sends them there (clients that
        track the context from this event read them; the output count comes in `message_delta`)."""
        return {"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": usage_obj(Usage(prompt_tokens, 0, cached_tokens=cached_tokens))}}

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        b, self._open = self._open, None
        if b is None:
            return []
        if b["type"] == "tool_use":
            b["input"] = tool_input(self._json)
        out: list[tuple[str, dict[str, Any]]] = []
        if b["type"] == "thinking":
            # Anthropic signs thinking so it can be checked when sent back; a local model's is not
            # secret, and the signature is empty (the SDK's accumulator expects the delta).
            out.append(("content_block_delta", {"type": "content_block_delta", "index": self.blocks.index(b),
                                                "delta": {"type": "signature_delta", "signature": ""}}))
        return out + [("content_block_stop", {"type": "content_block_stop", "index": self.blocks.index(b)})]

    def _begin(self, block: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        out = self._close()
        self.blocks.append(block)
        self._open = block
        self._json = ""
        if block["type"] == "tool_use":
            shown = {**block, "input": {}}
        elif block["type"] == "thinking":
            shown = {**block, "thinking": "", "signature": ""}
        else:
            shown = {**block, "text": ""}
        out.append(("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                            "content_block": shown}))
        return out

    def feed(self, e: Any) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        if isinstance(e, ReasoningDelta):
            if not e.text:
                return out
            if self._open is None or self._open["type"] != "thinking":
                out += self._begin({"type": "thinking", "thinking": "", "signature": ""})
            assert self._open is not None
            self._open["thinking"] += e.text
            out.append(("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                                "delta": {"type": "thinking_delta", "thinking": e.text}}))
        elif isinstance(e, TextDelta):
            if not e.text:
                return out
            if self._open is None or self._open["type"] != "text":
                out += self._begin({"type": "text", "text": ""})
            assert self._open is not None
            self._open["text"] += e.text
            out.append(("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                                "delta": {"type": "text_delta", "text": e.text}}))
        elif isinstance(e, CallStarted):
            out += self._begin({"type": "tool_use", "id": e.id, "name": e.name, "input": {}})
        elif isinstance(e, ArgumentsDelta):
            if self._open is not None and self._open["type"] == "tool_use":
                self._json += e.text
                out.append(("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                                    "delta": {"type": "input_json_delta", "partial_json": e.text}}))
        elif isinstance(e, Finished):
            out += self._close()
            streamed = {b.get("id") for b in self.blocks if b["type"] == "tool_use"}
            for call in e.calls:  # calls never streamed (a whole answer parsed at the end)
                if call.id not in streamed:
                    out += self._begin({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
                    self._json = call.arguments
                    out.append(("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                                        "delta": {"type": "input_json_delta",
                                                                  "partial_json": call.arguments}}))
                    out += self._close()
            # A tool answer's text beside native calls is kept; a cut-short answer's JSON is not text.
            self.stop = stop_reason(e)
            self.usage = e.usage
        return out


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


async def generate(service: Any, prepared: Any, asm: Assembler, in_band: bool
                   ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """The message as stream events (kind, data); the last is `message_stop`, or `error` when the
    engine fails after the stream started (`in_band`; else the error propagates). Errors before the
    first output event propagate (the route answers them with a status). Afterwards
    `asm.message()` is the whole message."""
    events = service.conversation_events(prepared)
    try:
        first = await anext(events)
    except StopAsyncIteration:
        first = None
    except BaseException:
        await events.aclose()
        raise
    # The engine's first events (before this first output event) said how long the prompt is.
    yield "message_start", asm.start(prepared.prompt_tokens, prepared.cached_tokens)
    yield "ping", {"type": "ping"}
    try:
        if first is not None:
            for out in asm.feed(first[1]):
                yield out
            async with contextlib.aclosing(events) as rest:
                async for _i, e in rest:
                    for out in asm.feed(e):
                        yield out
    except Exception as exc:
        if not in_band:
            raise
        yield ANTHROPIC.in_band(to_api_error(exc))
        return
    yield "message_delta", {"type": "message_delta",
                            "delta": {"stop_reason": asm.stop[0], "stop_sequence": asm.stop[1]},
                            "usage": usage_obj(asm.usage)}
    yield "message_stop", {"type": "message_stop"}
