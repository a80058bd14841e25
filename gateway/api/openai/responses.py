"""The OpenAI Responses API (`POST /v1/responses` and the stored-response routes) over the
conversation model: input items -> `Conversation`, neutral output events -> output items, whole or
as the Responses stream events, in order, each with its `sequence_number`.

What the gateway cannot honour is accepted and named, never a 400 for the whole request: request
fields in `X-Ignored-Fields`, built-in tools it cannot run (web search, file search, computer use …)
in `X-Skipped-Tools`. Custom (freeform) tools such as Codex's `apply_patch` are served as free-text
tools: their input is a string the grammar keeps well-formed; a `lark` or `regex` grammar they carry
is not compiled (named in `X-Ignored-Fields`).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, cast

from gateway.api.errors import APIError, invalid, to_api_error
from gateway.api.images import image_part
from gateway.api.notes import Notes
from gateway.api.openai.adapters import RESPONSES
from gateway.api.openai.common import effort_level
from gateway.api.openai.responses_schema import (
    ResponseCreateRequest,
)
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

# Built-in tools OpenAI runs on its side; the gateway has none of them.
HOSTED_TOOLS = {"web_search", "web_search_preview", "web_search_preview_2025_03_11", "file_search",
                "computer_use_preview", "computer_use", "code_interpreter", "image_generation", "mcp",
                "local_shell", "shell", "apply_patch"}
# Output items of hosted tools a client may send back in its history: nothing to render.
HOSTED_ITEMS = {"web_search_call", "file_search_call", "computer_call", "computer_call_output",
                "code_interpreter_call", "image_generation_call", "mcp_call", "mcp_list_tools",
                "mcp_approval_request", "mcp_approval_response", "local_shell_call", "local_shell_call_output",
                "shell_call", "shell_call_output", "apply_patch_call", "apply_patch_call_output", "item_reference"}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# --- input items -> conversation ---------------------------------------------------------------


def _text_of(content: Any, param: str) -> str:
    """A tool output's content: a string or a list of text parts."""
    parts = _parts_of(content, param, images_allowed=False)
    return "".join(p.text for p in parts)


def _parts_of(content: Any, param: str, images_allowed: bool = True) -> tuple[Part, ...]:
    """A message's content: a string or a list of content parts (text, and input_image with a
    data: URL), in order."""
    if isinstance(content, str):
        return (Part("text", content),) if content else ()
    if not isinstance(content, list):
        raise invalid("content must be a string or a list of content parts", param=param)
    out: list[Part] = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise invalid("each content part needs a type", param=f"{param}[{j}]")
        kind = part["type"]
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            if not isinstance(part.get("text"), str):
                raise invalid(f"a {kind} part needs text", param=f"{param}[{j}].text")
            out.append(Part("text", part["text"]))
        elif kind == "refusal":
            continue  # an earlier refusal, as our own responses could carry it: not shown to the model
        elif kind == "input_image" and images_allowed:
            url = part.get("image_url")
            if not isinstance(url, str):
                raise invalid("an input_image part needs image_url (a data: URL); file_id is not supported",
                              param=f"{param}[{j}].image_url", code="unsupported_content")
            out.append(image_part(partial(images.from_url, url), f"{param}[{j}].image_url"))
        elif kind in ("input_image", "input_file", "input_audio"):
            raise invalid(f"{kind} content is not supported here", param=f"{param}[{j}].type",
                          code="unsupported_content")
        else:
            raise invalid(f"unknown content part type {kind!r}", param=f"{param}[{j}].type")
    return tuple(out)


def _call_id_of(item: dict[str, Any], param: str) -> str:
    """A call's id. Codex CLI sends some of its own tools' outputs with a name and no call_id: those
    are matched by name (an empty id); a call_id that is there must be a string."""
    if item.get("call_id") is None and isinstance(item.get("name"), str):
        return ""
    return _str_field(item, "call_id", param)


def _str_field(item: dict[str, Any], key: str, param: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise invalid(f"{key} must be a string", param=f"{param}.{key}")
    return v


def input_turns(items: str | list[dict[str, Any]] | None, notes: Notes) -> tuple[tuple[Turn, ...], list[dict[str, Any]]]:
    """The request's input as turns, and its items with ids (for GET .../input_items)."""
    if items is None:
        return (), []
    if isinstance(items, str):
        return (Turn.of("user", items),), [{"type": "message", "id": _id("msg"), "role": "user", "status": "completed",
                                            "content": [{"type": "input_text", "text": items}]}]
    turns: list[Turn] = []
    listed: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        param = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid("role must be user, system, developer or assistant", param=f"{param}.role")
            parts = _parts_of(item.get("content"), f"{param}.content")
            turns.append(Turn("system" if role == "developer" else role, parts))
        elif kind in ("function_call", "custom_tool_call"):
            call = ToolCall(_call_id_of(item, param), _str_field(item, "name", param),
                            _str_field(item, "arguments" if kind == "function_call" else "input", param),
                            "function" if kind == "function_call" else "custom")
            if turns and turns[-1].role == "assistant" and (turns[-1].tool_calls or not turns[-1].text):
                last = turns[-1]
                turns[-1] = Turn("assistant", last.parts, (*last.tool_calls, call))
            elif turns and turns[-1].role == "assistant":
                last = turns[-1]
                turns[-1] = Turn("assistant", last.parts, (call,))
            else:
                turns.append(Turn("assistant", (), (call,)))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = _call_id_of(item, param)
            turns.append(Turn.of("tool", _text_of(item.get("output"), f"{param}.output"), tool_call_id=call_id))
        elif kind == "reasoning":
            pass  # accepted, not re-rendered: the served models do not reason in a hidden channel
        elif kind in HOSTED_ITEMS:
            notes.ignored.add(f"input item {kind}")
        else:
            raise invalid(f"unknown input item type {kind!r}", param=f"{param}.type")
        listed.append({**item, "type": kind, "id": item.get("id") or _id("msg" if kind == "message" else "item")})
    return tuple(turns), listed


def _tools(req: ResponseCreateRequest, notes: Notes) -> tuple[ToolSpec, ...] | None:
    if req.tools is None:
        return None
    out = []
    for i, t in enumerate(req.tools):
        kind = t.get("type")
        param = f"tools[{i}]"
        if kind == "function":
            name = t.get("name")
            if not isinstance(name, str) or not name:
                raise invalid("a function tool needs a name", param=f"{param}.name")
            params = t.get("parameters")
            if params is not None and not isinstance(params, dict):
                raise invalid("parameters must be a JSON schema object", param=f"{param}.parameters")
            out.append(ToolSpec(name, t.get("description") or "", params))
        elif kind == "custom":
            name = t.get("name")
            if not isinstance(name, str) or not name:
                raise invalid("a custom tool needs a name", param=f"{param}.name")
            fmt = t.get("format") or {}
            if isinstance(fmt, dict) and fmt.get("type") == "grammar":
                notes.ignored.add(f"tools[{i}].format ({fmt.get('syntax', 'grammar')} grammar, served as free text)")
            out.append(ToolSpec(name, t.get("description") or "", None, "custom"))
        elif isinstance(kind, str) and kind:
            # Built-in tools the gateway cannot run, and kinds it does not know (agents add new ones,
            # e.g. Codex's "namespace"): skipped and named, never a 400 for the whole request.
            notes.skipped_tools.add(kind)
        else:
            raise invalid("each tool needs a type", param=f"{param}.type")
    # An empty list is no tools (the Agents SDK sends `tools: []` for an agent without tools).
    return tuple(out) or None


def _choice(req: ResponseCreateRequest, tools: tuple[ToolSpec, ...] | None, notes: Notes) -> ToolChoice | None:
    c = req.tool_choice
    if c is None:
        return None
    if isinstance(c, str):
        if c not in ("auto", "none", "required"):
            raise invalid("tool_choice must be auto, none, required or a tool", param="tool_choice")
        return ToolChoice(cast(Literal["auto", "none", "required"], c)) if tools is not None else None
    kind = c.get("type")
    if kind in ("function", "custom"):
        if not isinstance(c.get("name"), str):
            raise invalid("a named tool_choice needs the tool's name", param="tool_choice.name")
        return ToolChoice("named", c["name"])
    if kind == "allowed_tools":
        notes.ignored.add("tool_choice.allowed_tools")
        return ToolChoice("required" if c.get("mode") == "required" else "auto")
    if isinstance(kind, str) and kind in HOSTED_TOOLS:
        notes.skipped_tools.add(kind)
        return None
    raise invalid(f"unknown tool_choice type {kind!r}", param="tool_choice.type")


def _output(req: ResponseCreateRequest) -> Output | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None:
        return None
    if fmt.type == "json_schema" and fmt.schema_ is None:
        raise invalid("text.format json_schema needs schema", param="text.format.schema")
    return Output(fmt.type, fmt.schema_, fmt.name or "response", fmt.strict)


def _note_ignored(req: ResponseCreateRequest, notes: Notes) -> None:
    if req.reasoning and req.reasoning.get("summary") not in (None, "none"):
        notes.ignored.add("reasoning.summary")  # the reasoning itself is returned, not a summary of it
    for name in ("include", "service_tier", "user", "safety_identifier", "prompt_cache_retention",
                 "stream_options", "conversation", "prompt", "top_logprobs", "max_tool_calls", "client_metadata"):
        if getattr(req, name) not in (None, [], {}):
            notes.ignored.add(name)
    if req.truncation == "auto":
        notes.ignored.add("truncation")  # nothing is truncated: a prompt too long is a 400
    if req.background:
        notes.ignored.add("background")  # answered in the foreground
    if req.text is not None and req.text.verbosity is not None:
        notes.ignored.add("text.verbosity")


def conversation(req: ResponseCreateRequest, earlier: tuple[Turn, ...], notes: Notes
                 ) -> tuple[Conversation, tuple[Turn, ...], list[dict[str, Any]]]:
    """(the conversation to run, the turns to store (without instructions), the input items)."""
    if req.input is None and not earlier:
        raise invalid("input is required", param="input")
    new, listed = input_turns(req.input, notes)
    history = (*earlier, *new)
    if not any(t.role != "system" for t in history):
        raise invalid("input needs at least one message", param="input")
    turns = ((Turn.of("system", req.instructions),) if req.instructions else ()) + history
    tools = _tools(req, notes)
    choice = _choice(req, tools, notes)
    _note_ignored(req, notes)
    effort = (req.reasoning or {}).get("effort")
    conv = Conversation(turns, tools, choice, req.parallel_tool_calls is not False, _output(req),
                        thinking=False if effort == "none" else None,
                        sampling=Sampling(temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                                          max_tokens=req.max_output_tokens), params={"output.schema": "text.format.schema", "messages": "input"},
                        effort=effort_level(effort if isinstance(effort, str) else None))
    return conv, history, listed


# --- output -> response object -------------------------------------------------------------------


def usage_obj(usage: Usage | None, reasoning_tokens: int = 0) -> dict[str, Any]:
    u = usage or Usage(0, 0)
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" or text else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """The model's reasoning as it wrote it (`reasoning_text`); no summary is made of it."""
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" or text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict[str, Any]:
    if call.kind == "custom":
        return {"type": "custom_tool_call", "id": item_id, "call_id": call.id, "name": call.name,
                "input": custom_input(call.arguments), "status": status}
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


def custom_input(arguments: str) -> str:
    """A custom tool's input text from the constrained {"input": ...} object."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return arguments
    return str(value.get("input", "")) if isinstance(value, dict) else str(value)


@dataclass
class Run:
    """One create request on its way: the prepared generation and what the response echoes."""

    req: ResponseCreateRequest
    prepared: Any  # serving.Prepared
    conv: Conversation
    history: tuple[Turn, ...]
    input_items: list[dict[str, Any]]
    notes: Notes
    store: bool = True
    rid: str = field(default_factory=lambda: _id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    # Called with the final response object and the output turn before the last event goes out
    # (stored responses are written first: a client that saw "completed" can continue from it).
    on_final: Callable[[dict[str, Any], Turn], Awaitable[None]] | None = None
    in_band: bool = True  # a failure after the start is a response.failed event (streams), else raised

    def response(self, status: str, output: list[dict[str, Any]], usage: Usage | None = None,
                 incomplete: str | None = None, error: dict[str, Any] | None = None,
                 reasoning_tokens: int = 0) -> dict[str, Any]:
        r = self.req
        fmt: dict[str, Any] = {"type": "text"}
        if r.text is not None and r.text.format is not None:
            fmt = r.text.format.model_dump(by_alias=True, exclude_none=True)
        tool_choice: Any = r.tool_choice if r.tool_choice is not None else "auto"
        return {
            "id": self.rid, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "max_tool_calls": r.max_tool_calls,
            "model": r.model, "output": output, "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id, "prompt_cache_key": r.prompt_cache_key,
            "reasoning": {"effort": (r.reasoning or {}).get("effort"), "summary": None},
            "safety_identifier": r.safety_identifier,
            "service_tier": "default", "store": self.store,
            "temperature": self.prepared.temperature,
            "text": {"format": fmt, "verbosity": (r.text.verbosity if r.text else None) or "medium"},
            "tool_choice": tool_choice, "tools": r.tools or [], "top_logprobs": r.top_logprobs or 0,
            "top_p": self.prepared.top_p, "truncation": r.truncation or "disabled",
            "usage": usage_obj(usage, reasoning_tokens) if status in ("completed", "incomplete") else None,
            "user": r.user, "metadata": r.metadata or {},
        }


class Assembler:
    """Neutral output events -> Responses output items and stream events, in OpenAI's order."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.items: list[dict[str, Any]] = []
        self.seq = 0
        self._msg: dict[str, Any] | None = None  # the open message item
        self._thought: dict[str, Any] | None = None  # the open reasoning item
        self.reasoning_tokens = 0
        self._calls: dict[int, dict[str, Any]] = {}  # call index -> open call item
        self._args: dict[int, tuple[ToolCall, str]] = {}  # call index -> (the call, its arguments so far)
        self.text = ""
        self.calls: list[ToolCall] = []
        self.finish = "stop"
        self.usage: Usage | None = None

    def event(self, kind: str, **data: Any) -> tuple[str, dict[str, Any]]:
        out = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return kind, out

    def _close_message(self) -> list[tuple[str, dict[str, Any]]]:
        m, self._msg = self._msg, None
        return self._close(m, "response.output_text", lambda text: {
            "type": "output_text", "text": text, "annotations": [], "logprobs": []}, logprobs=[])

    def _close_reasoning(self) -> list[tuple[str, dict[str, Any]]]:
        r, self._thought = self._thought, None
        return self._close(r, "response.reasoning_text", lambda text: {"type": "reasoning_text", "text": text})

    def _close(self, item: dict[str, Any] | None, kind: str, part_of: Callable[[str], dict[str, Any]],
               **done: Any) -> list[tuple[str, dict[str, Any]]]:
        """Complete an item opened by `_open`: its text's done event (`kind`.done), then its part's and its own."""
        if item is None:
            return []
        idx = self.items.index(item)
        text = item.pop("_text")
        part = part_of(text)
        item.update(status="completed", content=[part])
        return [self.event(f"{kind}.done", item_id=item["id"], output_index=idx, content_index=0, text=text, **done),
                self.event("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=idx, item=dict(item))]

    def _close_calls(self, final: dict[int, ToolCall]) -> list[tuple[str, dict[str, Any]]]:
        out = []
        for k, item in sorted(self._calls.items()):
            idx = self.items.index(item)
            call = final.get(k)
            if call is None:  # cut short or dropped as a repeat: not part of the answer
                self.items.remove(item)
                continue
            done = call_item(item["id"], call)
            item.clear()
            item.update(done)
            if call.kind == "custom":
                out.append(self.event("response.custom_tool_call_input.delta", item_id=done["id"], output_index=idx,
                                      delta=done["input"]))
                out.append(self.event("response.custom_tool_call_input.done", item_id=done["id"], output_index=idx,
                                      input=done["input"]))
            else:
                out.append(self.event("response.function_call_arguments.done", item_id=done["id"], output_index=idx,
                                      name=call.name, arguments=call.arguments))
            out.append(self.event("response.output_item.done", output_index=idx, item=dict(done)))
        self._calls = {}
        self._args = {}
        return out

    def _open(self, item: dict[str, Any], part: dict[str, Any], out: list[tuple[str, dict[str, Any]]]
              ) -> dict[str, Any]:
        """Add an item with one content part that text will stream into (its text kept in `_text`)."""
        opened = {**item, "_text": ""}
        self.items.append(opened)
        idx = len(self.items) - 1
        out.append(self.event("response.output_item.added", output_index=idx, item=item))
        out.append(self.event("response.content_part.added", item_id=item["id"], output_index=idx, content_index=0,
                              part=part))
        return opened

    def feed(self, e: Any) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        if isinstance(e, ReasoningDelta):
            if not e.text:
                return out
            if self._thought is None:
                self._thought = self._open(reasoning_item(_id("rs"), "", "in_progress"),
                                           {"type": "reasoning_text", "text": ""}, out)
            self._thought["_text"] += e.text
            out.append(self.event("response.reasoning_text.delta", item_id=self._thought["id"],
                                  output_index=self.items.index(self._thought), content_index=0, delta=e.text))
            return out
        if isinstance(e, TextDelta) and not e.text:
            return out
        out += self._close_reasoning()
        if isinstance(e, TextDelta):
            if self._msg is None:
                self._msg = self._open(message_item(_id("msg"), "", "in_progress"),
                                       {"type": "output_text", "text": "", "annotations": [], "logprobs": []}, out)
            self._msg["_text"] += e.text
            self.text += e.text
            out.append(self.event("response.output_text.delta", item_id=self._msg["id"],
                                  output_index=self.items.index(self._msg), content_index=0, delta=e.text, logprobs=[]))
        elif isinstance(e, CallStarted):
            out += self._close_message()
            # Calls arrive whole (released once complete), so the next call's start ends the open ones:
            # each item is done before the next is added, as OpenAI streams them.
            out += self._close_calls({k: ToolCall(c.id, c.name, args, c.kind) for k, (c, args) in self._args.items()})
            self._args[e.call] = (ToolCall(e.id, e.name, "", e.kind), "")
            item = call_item(_id("fc" if e.kind == "function" else "ctc"), ToolCall(e.id, e.name, "", e.kind),
                             "in_progress")
            if e.kind == "custom":
                item["input"] = ""
            self._calls[e.call] = item
            self.items.append(item)
            out.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item)))
        elif isinstance(e, ArgumentsDelta):
            if e.call in self._args:
                c, args = self._args[e.call]
                self._args[e.call] = (c, args + e.text)
            found = self._calls.get(e.call)
            if found is not None and found["type"] == "function_call":
                found["arguments"] += e.text
                out.append(self.event("response.function_call_arguments.delta", item_id=found["id"],
                                      output_index=self.items.index(found), delta=e.text))
        elif isinstance(e, Finished):
            self.finish = e.reason
            self.usage = e.usage
            self.reasoning_tokens = e.reasoning_tokens
            self.calls = list(e.calls)
            out += self._close_message()
            out += self._close_calls(dict(enumerate(e.calls)))
            for call in e.calls:  # calls never streamed (a whole answer parsed at the end)
                if not any(it.get("call_id") == call.id for it in self.items):
                    item = call_item(_id("fc" if call.kind == "function" else "ctc"), call)
                    self.items.append(item)
                    out.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=item))
                    out.append(self.event("response.output_item.done", output_index=len(self.items) - 1, item=item))
        return out

    def status(self) -> tuple[str, str | None]:
        if self.finish == "length" and not self.calls:
            return "incomplete", "max_output_tokens"
        if self.finish == "content_filter":
            return "incomplete", "content_filter"
        return "completed", None

    def output_turn(self) -> Turn:
        return Turn.of("assistant", self.text, tool_calls=tuple(self.calls))


async def generate(service: Any, run: Run) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """The response as stream events (kind, data); the last is response.completed / .incomplete, or
    response.failed when the engine fails after the stream started. Errors before the first output
    event propagate (the route answers them with a status)."""
    asm = Assembler(run)
    events = service.conversation_events(run.prepared)
    try:
        first = await anext(events)
    except StopAsyncIteration:
        first = None
    except BaseException:
        await events.aclose()
        raise
    yield asm.event("response.created", response=run.response("in_progress", []))
    yield asm.event("response.in_progress", response=run.response("in_progress", []))
    try:
        if first is not None:
            for out in asm.feed(first[1]):
                yield out
            async with contextlib.aclosing(events) as rest:
                async for _i, e in rest:
                    for out in asm.feed(e):
                        yield out
    except Exception as exc:
        if not run.in_band:
            raise
        body = RESPONSES.answer(to_api_error(exc))[1]["error"]
        yield asm.event("response.failed", response=run.response(
            "failed", asm.items, error={"code": body.get("code") or "server_error", "message": body["message"]}))
        return
    status, why = asm.status()
    final = run.response(status, asm.items, asm.usage, why, reasoning_tokens=asm.reasoning_tokens)
    if run.on_final is not None:
        await run.on_final(final, asm.output_turn())
    yield asm.event(f"response.{status}", response=final)


def not_found(rid: str) -> APIError:
    return APIError(404, f"No response found with id '{rid}'.", param="response_id", code="response_not_found")
