"""Anthropic's Messages API over the conversation model: a request's `system`, `messages` (text,
`tool_use`, `tool_result` blocks), `tools` and `tool_choice` -> `Conversation`; the neutral output
events -> a message, or Anthropic's stream events in order (`message_start`, `content_block_start`,
`content_block_delta`, `content_block_stop`, `message_delta`, `message_stop`).

What the gateway cannot honour is accepted and named, never a 400 for the whole request: request
fields in `X-Ignored-Fields`, Anthropic-defined tools (bash, text editor, web search, computer use)
in `X-Skipped-Tools`. Images and documents are a 400 until the gateway serves a vision model.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.api.anthropic.adapter import ANTHROPIC
from gateway.api.errors import invalid, to_api_error
from gateway.api.notes import Notes
from gateway.conversation import (
    ArgumentsDelta,
    CallStarted,
    Conversation,
    Finished,
    Output,
    ReasoningDelta,
    Sampling,
    TextDelta,
    ToolCall,
    ToolChoice,
    ToolSpec,
    Turn,
    Usage,
)

# Fields the gateway reads; any other field is accepted and named in X-Ignored-Fields.
_HONOURED = {"model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k",
             "tools", "tool_choice", "stream", "output_config"}
# Accepted without effect, and not worth a header on every request.
_QUIET = {"metadata"}


class MessagesRequest(BaseModel):
    """`POST /v1/messages`. Content blocks are checked by `conversation` (their errors name the block)."""

    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int = Field(ge=1, description="required, as Anthropic requires it")
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # `format` (a JSON schema) is enforced; `effort` is not
    stream: bool = False


class CountTokensRequest(BaseModel):
    """`POST /v1/messages/count_tokens`: a Messages request without `max_tokens`."""

    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


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


def _text_of(blocks: Any, param: str, what: str) -> str:
    """A string, or text blocks joined (the form `system` and tool results take)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise invalid(f"{what} must be a string or a list of content blocks", param=param)
    out = []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            out.append(b["text"])
        elif kind in ("image", "document"):
            raise invalid(f"{kind} blocks are not supported: the gateway serves no vision model yet",
                          param=f"{param}[{j}]")
        else:
            raise invalid(f"{what} takes text blocks (got {kind!r})", param=f"{param}[{j}].type")
    return "\n".join(out)


def _message(m: Any, i: int) -> list[Turn]:
    """One message as turns: tool results become tool turns (before the message's own text)."""
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise invalid("each message must be an object", param=param)
    role = m.get("role")
    if role not in ("user", "assistant", "system"):
        raise invalid(f"role must be 'user', 'assistant' or 'system', got {role!r}", param=f"{param}.role")
    content = m.get("content")
    if role == "system":  # Claude Code sends system messages between turns (reminders)
        return [Turn.of("system", _text_of(content, f"{param}.content", "a system message"))]
    if isinstance(content, str):
        return [Turn.of(role, content)]
    if not isinstance(content, list):
        raise invalid("content must be a string or a list of content blocks", param=f"{param}.content")
    texts: list[str] = []
    calls: list[ToolCall] = []
    results: list[Turn] = []
    for j, b in enumerate(content):
        bp = f"{param}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            if not isinstance(b.get("text"), str):
                raise invalid("a text block needs its text", param=f"{bp}.text")
            texts.append(b["text"])
        elif kind == "tool_use":
            if role != "assistant":
                raise invalid("tool_use blocks belong to assistant messages", param=f"{bp}.type")
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise invalid("a tool_use block needs its id and name", param=bp)
            calls.append(ToolCall(b["id"], b["name"], json.dumps(b.get("input") or {}, ensure_ascii=False)))
        elif kind == "tool_result":
            if role != "user":
                raise invalid("tool_result blocks belong to user messages", param=f"{bp}.type")
            if not isinstance(b.get("tool_use_id"), str):
                raise invalid("a tool_result block needs its tool_use_id", param=f"{bp}.tool_use_id")
            text = _text_of(b.get("content", ""), f"{bp}.content", "a tool result's content")
            results.append(Turn.of("tool", f"Error: {text}" if b.get("is_error") else text,
                                   tool_call_id=b["tool_use_id"]))
        elif kind in ("image", "document"):
            raise invalid(f"{kind} blocks are not supported: the gateway serves no vision model yet", param=bp)
        elif kind in ("thinking", "redacted_thinking", "server_tool_use", "web_search_tool_result"):
            continue  # accepted: earlier reasoning and server-side tools are not re-rendered
        else:
            raise invalid(f"unknown content block type {kind!r}", param=f"{bp}.type")
    turns = results
    if role == "assistant":
        turns.append(Turn.of("assistant", "".join(texts), tool_calls=tuple(calls)))
    elif texts or not results:
        turns.append(Turn.of("user", "\n".join(texts)))
    return turns


def _tools(tools: list[dict[str, Any]] | None, notes: Notes) -> tuple[ToolSpec, ...] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(t, dict):
            raise invalid("each tool must be an object", param=param)
        kind = t.get("type")
        if kind not in (None, "custom"):
            # Anthropic-defined tools (bash_…, text_editor_…, web_search_…, computer_…): run by
            # Anthropic or described only by their type; skipped and named.
            notes.skipped_tools.add(str(t.get("name") or kind))
            continue
        name, schema = t.get("name"), t.get("input_schema")
        if not isinstance(name, str) or not name:
            raise invalid("a tool needs a name", param=f"{param}.name")
        if not isinstance(schema, dict):
            raise invalid("a tool needs its input_schema (a JSON schema object)", param=f"{param}.input_schema")
        out.append(ToolSpec(name, t.get("description") or "", schema))
    return tuple(out) or None  # an empty list: no tools


def _choice(choice: dict[str, Any] | None) -> tuple[ToolChoice | None, bool]:
    """(tool choice, parallel calls allowed)."""
    if choice is None:
        return None, True
    kind = choice.get("type")
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind == "auto":
        return ToolChoice("auto"), parallel
    if kind == "any":
        return ToolChoice("required"), parallel
    if kind == "none":
        return ToolChoice("none"), parallel
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise invalid("tool_choice of type 'tool' needs the tool's name", param="tool_choice.name")
        return ToolChoice("named", choice["name"]), parallel
    raise invalid(f"tool_choice.type must be auto, any, tool or none, got {kind!r}", param="tool_choice.type")


def _output(config: dict[str, Any] | None, notes: Notes) -> Output | None:
    """`output_config.format` (structured outputs): the answer must match the JSON schema."""
    if not config:
        return None
    for key in sorted(set(config) - {"format"}):
        notes.ignored.add(f"output_config.{key}")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise invalid("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                      param="output_config.format")
    return Output("json_schema", fmt["schema"], "output", True)


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
    for name in sorted(set(req.model_extra or {}) - _HONOURED - _QUIET):
        notes.ignored.add(name)
    if req.thinking is not None and req.thinking.get("budget_tokens") is not None:
        notes.ignored.add("thinking.budget_tokens")  # the model thinks as long as it does
    output = _output(getattr(req, "output_config", None), notes)
    return Conversation(tuple(turns), tools, choice, parallel, output, thinking(req), _sampling(req),
                        params={"tools": "tools", "tool_choice": "tool_choice", "tool_choice.name": "tool_choice.name"})


def thinking(req: MessagesRequest | CountTokensRequest) -> bool | None:
    """`thinking`: disabled answers at once; enabled or adaptive thinks; absent, the model's default
    (a local model that thinks does so unless told not to, and its thinking blocks are returned)."""
    kind = (req.thinking or {}).get("type")
    if kind is None:
        return None
    if kind == "disabled":
        return False
    if kind in ("enabled", "adaptive"):
        return True
    raise invalid(f"thinking.type must be enabled, adaptive or disabled, not {kind!r}", param="thinking.type")


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
