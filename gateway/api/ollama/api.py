"""Ollama's API over the conversation model: `/api/chat` and `/api/generate` requests ->
`Conversation` (or a raw prompt), the neutral output events -> Ollama's messages, whole or as NDJSON
lines, with its timing fields in nanoseconds.

The bodies are typed in `schema`. What the gateway cannot honour is accepted and named in
`X-Ignored-Fields` (Ollama's own server ignores unknown fields and options silently): `options` it
has no sampler for, `template`, `context`, fields Ollama's API does not define. A model that thinks
returns its reasoning in `thinking`; `think: false` makes it answer at once.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import Any

from gateway.api.bodies import unknown_fields
from gateway.api.errors import invalid
from gateway.api.images import image_part
from gateway.api.notes import Notes
from gateway.api.ollama.schema import (
    SAMPLER_OPTIONS,
    ChatRequest,
    CopyRequest,
    CreateRequest,
    EmbedRequest,
    GenerateRequest,
    LegacyEmbeddingRequest,
    ModelRequest,
    OllamaMessage,
    OllamaOptions,
    OllamaTool,
)
from gateway.chat import images
from gateway.conversation import Conversation, Output, Part, Sampling, ToolCall, ToolSpec, Turn
from gateway.models.create import Recipe
from gateway.models.quantize import type_code
from gateway.settings import parse_duration

__all__ = ["OLLAMA_API_VERSION", "Answer", "ChatRequest", "CopyRequest", "CreateRequest", "EmbedRequest",
           "GenerateRequest", "LegacyEmbeddingRequest", "ModelRequest", "Timing", "chat_conversation", "done_reason",
           "effort", "generate_conversation", "keep_alive_seconds", "now", "recipe", "sampling", "thinking", "tool_calls_out"]

# The Ollama API version whose routes and fields this module follows (`/api/version`).
OLLAMA_API_VERSION = "0.14.0"


# --- keep_alive ------------------------------------------------------------------------------------


def keep_alive_seconds(value: str | int | float | None) -> float | None:
    """Ollama's keep_alive: seconds as a number, or a Go duration ("5m", "1h30m", "0"); negative keeps
    the model loaded. None: not given (the gateway's own residency applies)."""
    if value is None:
        return None
    if isinstance(value, int | float):
        return _bounded(float(value), value)
    try:
        seconds = parse_duration(value)
    except ValueError as exc:
        raise invalid(f"keep_alive {exc}", param="keep_alive") from None
    return _bounded(seconds, value)


def _bounded(seconds: float, value: Any) -> float:
    if not math.isfinite(seconds):
        raise invalid(f"keep_alive {value!r} is not a finite duration", param="keep_alive")
    return -1.0 if seconds > FOREVER_S else seconds


FOREVER_S = 10 * 365 * 86400.0  # longer than this is "keep it loaded"


# --- request -> conversation --------------------------------------------------------------------------


def _output(fmt: str | dict[str, Any] | None) -> Output | None:
    if fmt is None or fmt == "":
        return None
    if isinstance(fmt, dict):
        return Output("json_schema", fmt, "output", True)
    return Output("json_object")  # "json"


def _tools(tools: list[OllamaTool] | None) -> tuple[ToolSpec, ...] | None:
    if tools is None:
        return None
    return tuple(ToolSpec(t.function.name, t.function.description or "", t.function.parameters) for t in tools) or None


def _images(data: list[str] | None, param: str) -> tuple[Part, ...]:
    """Ollama's images: base64 strings (an empty list is no image)."""
    return tuple(image_part(partial(images.from_base64, d), f"{param}[{k}]") for k, d in enumerate(data or ()))


def _arguments(args: dict[str, Any] | str) -> str:
    return args if isinstance(args, str) else json.dumps(args)


def chat_conversation(req: ChatRequest, notes: Notes) -> Conversation:
    """Ollama's messages carry no call ids: calls get ids in order, and each tool message answers the
    oldest unanswered call (of its `tool_name` when given)."""
    turns: list[Turn] = []
    open_calls: list[ToolCall] = []
    n = 0
    for i, m in enumerate(req.messages):
        pictures = _images(m.images, f"messages[{i}].images")
        content = m.content or ""
        if m.role == "assistant" and m.tool_calls:
            calls = tuple(ToolCall(f"call_{n + j}", c.function.name, _arguments(c.function.arguments))
                          for j, c in enumerate(m.tool_calls))
            n += len(calls)
            open_calls += calls
            turns.append(Turn.of("assistant", content, tool_calls=calls))
        elif m.role == "tool":
            name = m.tool_name or m.name
            answered = next((c for c in open_calls if name is None or c.name == name), None)
            if answered is not None:
                open_calls.remove(answered)
            turns.append(Turn.of("tool", content, tool_call_id=answered.id if answered else None))
        else:  # Ollama's images go before the message's text, as its templates place them
            turns.append(Turn(m.role, (*pictures, *Turn.of(m.role, content).parts)))
    notes.ignored.update(unknown_fields(req))
    return Conversation(tuple(turns), _tools(req.tools), None, True, _output(req.format), thinking(req),
                        sampling(req.options, notes), params={"tools": "tools", "output.schema": "format"},
                        effort=effort(req))


def generate_conversation(req: GenerateRequest, notes: Notes) -> Conversation:
    pictures = _images(req.images, "images")
    if req.suffix:
        raise invalid("suffix (fill-in-the-middle) is not supported", param="suffix")
    turns = ([Turn.of("system", req.system)] if req.system else []) + [
        Turn("user", (*pictures, *Turn.of("user", req.prompt).parts))]
    notes.ignored.update(unknown_fields(req))
    return Conversation(tuple(turns), None, None, True, _output(req.format), thinking(req),
                        sampling(req.options, notes), params={"output.schema": "format", "messages": "prompt"},
                        effort=effort(req))


def thinking(req: ChatRequest | GenerateRequest) -> bool | None:
    """`think`: true, or a level ("high", "medium", "low") that a model without levels treats as
    true; false answers at once; absent, the model's default."""
    if req.think is None or isinstance(req.think, bool):
        return req.think
    if req.think in ("high", "medium", "low"):
        return True
    raise invalid(f"think must be true, false, \"high\", \"medium\" or \"low\", not {req.think!r}", param="think")


def effort(req: ChatRequest | GenerateRequest) -> str | None:
    """`think`'s level, for a model with reasoning levels (None: true, false or absent)."""
    return req.think if isinstance(req.think, str) and req.think in ("high", "medium", "low") else None


def sampling(options: OllamaOptions | None, notes: Notes, where: str = "options") -> Sampling:
    """The sampler settings of Ollama's `options` (checked by the schema); the options it has no
    sampler for are named. `where` names the field (`parameters` in /api/create)."""
    if options is None:
        return Sampling()
    given = options.model_dump(exclude_none=True, exclude=set(SAMPLER_OPTIONS))
    notes.ignored.update(f"{where}.{key}" for key in given)  # num_ctx: the model's (models.yaml context_length)
    o = options
    stop = (o.stop,) if isinstance(o.stop, str) else tuple(o.stop or ())
    # num_predict -1: until the model stops; -2: fill the context (both: no limit here, the context bounds it).
    predict = o.num_predict if o.num_predict is not None and o.num_predict > 0 else None
    return Sampling(temperature=o.temperature, top_p=o.top_p, top_k=o.top_k, min_p=o.min_p,
                    repeat_penalty=o.repeat_penalty, seed=o.seed, presence_penalty=o.presence_penalty,
                    frequency_penalty=o.frequency_penalty, stop=stop, max_tokens=predict)


def _preset(messages: list[OllamaMessage] | None, notes: Notes) -> list[dict[str, str]] | None:
    """/api/create's `messages`: the turns every chat of the model starts with (role and text)."""
    if messages is None:
        return None
    out = []
    for i, m in enumerate(messages):
        if m.role == "tool" or m.content is None:
            raise invalid(f"messages[{i}]: a role of system, user or assistant and a string content",
                          param=f"messages[{i}]")
        others = m.model_dump(exclude_none=True, exclude={"role", "content"})
        notes.ignored.update(f"messages[{i}].{k}" for k in others)
        out.append({"role": m.role, "content": m.content})
    return out


def recipe(body: CreateRequest, notes: Notes) -> Recipe:
    """What `/api/create` asks for, checked (400 for what the gateway cannot make; parameters it has no
    sampler for are kept out and named in X-Ignored-Fields); the parent model is the route's to find."""
    name = body.model or body.name
    if not name:
        raise invalid("model is required", param="model")
    if body.modelfile is not None:
        raise invalid("the Modelfile form of /api/create (before Ollama 0.5.5) is not served: send `from` or "
                      "`files`, with `system`, `parameters`, `messages` (ollama >= 0.5.5 clients do)", param="modelfile")
    if body.template:
        raise invalid("template: Ollama's Go templates are not served; the model's own chat template (its GGUF's) is "
                      "used, or a Jinja `chat_template` in models.yaml", param="template")
    if body.adapters:
        raise invalid("adapters: LoRA adapters are not served yet", param="adapters")
    if body.quantize:
        try:
            type_code(body.quantize)
        except ValueError as exc:
            raise invalid(f"quantize: {exc}", param="quantize") from None
    if body.from_ and body.files:
        raise invalid("give `from` (a model) or `files` (uploaded GGUF blobs), not both", param="from")
    asked = sampling(body.parameters, notes, where="parameters")
    notes.ignored.discard("parameters.num_ctx")
    num_ctx = body.parameters.num_ctx if body.parameters is not None else None
    if num_ctx is not None and num_ctx < 16:
        raise invalid("parameters.num_ctx must be an integer of at least 16", param="parameters.num_ctx")
    defaults: dict[str, Any] = {k: getattr(asked, k) for k in (
        "temperature", "top_p", "top_k", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty", "seed",
        "max_tokens") if getattr(asked, k) is not None}
    if asked.stop:
        defaults["stop"] = list(asked.stop)
    notes.ignored.update(unknown_fields(body))
    license_ = "\n\n".join(body.license) if isinstance(body.license, list) else body.license
    return Recipe(name=name, files=dict(body.files or {}), system=body.system, messages=_preset(body.messages, notes),
                  license=license_, defaults=defaults, context_length=num_ctx, quantize=body.quantize or None)


# --- output -------------------------------------------------------------------------------------------


def now() -> str:
    """Ollama's created_at: RFC 3339 in UTC with nanoseconds."""
    t = time.time_ns()
    return datetime.fromtimestamp(t // 1_000_000_000, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S") + \
        f".{t % 1_000_000_000:09d}Z"


@dataclass
class Timing:
    """Where the time went, for the done message (nanoseconds there)."""

    received: float
    loaded: float = 0.0  # the model was ready (0: it was already loaded)
    started: float = 0.0  # the request had its slot
    first: float = 0.0  # the first output
    load_s: float = 0.0

    def done_fields(self, prompt_tokens: int, cached: int, completion_tokens: int) -> dict[str, Any]:
        end = time.perf_counter()
        first = self.first or end
        start = self.started or self.received

        def ns(s: float) -> int:
            return max(0, int(s * 1e9))

        return {"total_duration": ns(end - self.received), "load_duration": ns(self.load_s),
                "prompt_eval_count": max(prompt_tokens - cached, 0), "prompt_eval_duration": ns(first - start),
                "eval_count": completion_tokens, "eval_duration": ns(end - first)}


def tool_calls_out(calls: tuple[ToolCall, ...]) -> list[dict[str, Any]]:
    out = []
    for i, c in enumerate(calls):
        try:
            args = json.loads(c.arguments or "{}")
        except ValueError:
            args = {}
        out.append({"id": c.id, "function": {"index": i, "name": c.name, "arguments": args}})
    return out


@dataclass
class Answer:
    """The answer collected so far (a stream also sends each piece as it comes)."""

    text: str = ""
    thinking: str = ""
    calls: tuple[ToolCall, ...] = ()
    done_reason: str = "stop"
    fields: dict[str, Any] = field(default_factory=dict)


def done_reason(finish: str) -> str:
    return "length" if finish == "length" else "stop"
