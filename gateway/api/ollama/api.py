"""Ollama's API over the conversation model: `/api/chat` and `/api/generate` requests ->
`Conversation` (or a raw prompt), the neutral output events -> Ollama's messages, whole or as NDJSON
lines, with its timing fields in nanoseconds.

What the gateway cannot honour is accepted and named in `X-Ignored-Fields` (Ollama's own server
ignores unknown options silently): `options` it has no sampler for, `template`, `context`. A model
that thinks returns its reasoning in `thinking`; `think: false` makes it answer at once.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gateway.api.errors import invalid
from gateway.api.notes import Notes
from gateway.conversation import Conversation, Output, Sampling, ToolCall, ToolSpec, Turn
from gateway.models.create import Recipe
from gateway.models.quantize import type_code
from gateway.settings import parse_duration

# options -> what the gateway's sampler reads; num_ctx is the model's (models.yaml), not per request.
_OPTIONS = {"num_predict", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "repeat_penalty",
            "presence_penalty", "frequency_penalty", "num_ctx"}
# The Ollama API version whose routes and fields this module follows (`/api/version`).
OLLAMA_API_VERSION = "0.14.0"


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: bool = True  # Ollama streams unless told not to
    keep_alive: str | int | float | None = None
    think: bool | str | None = None


class ChatRequest(_Request):
    messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(_Request):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    raw: bool = False
    images: list[str] | None = None
    context: list[int] | None = None


class EmbedRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    input: str | list[str]
    truncate: bool = True
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None
    dimensions: int | None = None


class LegacyEmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    prompt: str
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


class ModelRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = ""
    name: str = ""  # older clients send `name`

    @property
    def id(self) -> str:
        return self.model or self.name


class CreateRequest(BaseModel):
    """`POST /api/create` (Ollama 0.5.5 and later: fields, not a Modelfile)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    model: str = ""
    name: str = ""  # older clients send `name`
    from_: str | None = Field(default=None, alias="from")
    files: dict[str, str] | None = None
    adapters: dict[str, str] | None = None
    template: str | None = None
    license: str | list[str] | None = None
    system: str | None = None
    parameters: dict[str, Any] | None = None
    messages: list[dict[str, Any]] | None = None
    quantize: str | None = None
    modelfile: str | None = None  # the API before 0.5.5
    stream: bool = True


class CopyRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    source: str
    destination: str


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
    if fmt == "json":
        return Output("json_object")
    if isinstance(fmt, dict):
        return Output("json_schema", fmt, "output", True)
    raise invalid(f"format must be \"json\" or a JSON schema, got {fmt!r}", param="format")


def _tools(tools: list[dict[str, Any]] | None) -> tuple[ToolSpec, ...] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise invalid("each tool is {\"type\": \"function\", \"function\": {\"name\", ...}}",
                          param=f"tools[{i}].function.name")
        params = fn.get("parameters")
        out.append(ToolSpec(fn["name"], fn.get("description") or "", params if isinstance(params, dict) else None))
    return tuple(out) or None


def _no_images(m: dict[str, Any], param: str) -> None:
    if m.get("images"):
        raise invalid("images are not supported: the gateway serves no vision model yet", param=f"{param}.images")


def chat_conversation(req: ChatRequest, notes: Notes) -> Conversation:
    """Ollama's messages carry no call ids: calls get ids in order, and each tool message answers the
    oldest unanswered call (of its `tool_name` when given)."""
    turns: list[Turn] = []
    open_calls: list[ToolCall] = []
    n = 0
    for i, m in enumerate(req.messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid("each message must be an object", param=param)
        role, content = m.get("role"), m.get("content", "")
        if role not in ("system", "user", "assistant", "tool"):
            raise invalid(f"role must be system, user, assistant or tool, got {role!r}", param=f"{param}.role")
        if not isinstance(content, str):
            raise invalid("content must be a string", param=f"{param}.content")
        _no_images(m, param)
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for j, c in enumerate(m["tool_calls"]):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise invalid("a tool call is {\"function\": {\"name\", \"arguments\"}}",
                                  param=f"{param}.tool_calls[{j}]")
                args = fn.get("arguments") or {}
                calls.append(ToolCall(f"call_{n}", fn["name"], args if isinstance(args, str) else json.dumps(args)))
                n += 1
            open_calls += calls
            turns.append(Turn.of("assistant", content, tool_calls=tuple(calls)))
        elif role == "tool":
            name = m.get("tool_name") or m.get("name")
            answered = next((c for c in open_calls if name is None or c.name == name), None)
            if answered is not None:
                open_calls.remove(answered)
            turns.append(Turn.of("tool", content, tool_call_id=answered.id if answered else None))
        else:
            turns.append(Turn.of(role, content))
    return Conversation(tuple(turns), _tools(req.tools), None, True, _output(req.format), thinking(req),
                        sampling(req.options, notes), params={"tools": "tools", "output.schema": "format"})


def generate_conversation(req: GenerateRequest, notes: Notes) -> Conversation:
    if req.images:
        raise invalid("images are not supported: the gateway serves no vision model yet", param="images")
    if req.suffix:
        raise invalid("suffix (fill-in-the-middle) is not supported", param="suffix")
    turns = ([Turn.of("system", req.system)] if req.system else []) + [Turn.of("user", req.prompt)]
    return Conversation(tuple(turns), None, None, True, _output(req.format), thinking(req),
                        sampling(req.options, notes), params={"output.schema": "format", "messages": "prompt"})


def thinking(req: ChatRequest | GenerateRequest) -> bool | None:
    """`think`: true, or a level ("high", "medium", "low") that a model without levels treats as
    true; false answers at once; absent, the model's default."""
    if req.think is None or isinstance(req.think, bool):
        return req.think
    if req.think in ("high", "medium", "low"):
        return True
    raise invalid(f"think must be true, false, \"high\", \"medium\" or \"low\", not {req.think!r}", param="think")


def sampling(options: dict[str, Any] | None, notes: Notes, where: str = "options") -> Sampling:
    """The sampler settings of Ollama's `options`. `where` names the field in errors (`parameters`
    in /api/create)."""
    o = dict(options or {})
    for key in sorted(set(o) - _OPTIONS):
        notes.ignored.add(f"{where}.{key}")
    if "num_ctx" in o:
        notes.ignored.add(f"{where}.num_ctx")  # the context is the model's (models.yaml context_length)

    def num(key: str, kind: type) -> Any:
        v = o.get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int | float) or (kind is int and not float(v).is_integer()):
            raise invalid(f"{where}.{key} must be a {kind.__name__}", param=f"{where}.{key}")
        return kind(v)

    predict = num("num_predict", int)
    stop = o.get("stop")
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise invalid(f"{where}.stop must be a list of strings", param=f"{where}.stop")
    temperature = num("temperature", float)
    if temperature is not None and not 0 <= temperature <= 2:
        raise invalid(f"{where}.temperature must be between 0 and 2", param=f"{where}.temperature")
    top_p = num("top_p", float)
    if top_p is not None and not 0 <= top_p <= 1:
        raise invalid(f"{where}.top_p must be between 0 and 1", param=f"{where}.top_p")
    top_k = num("top_k", int)
    if top_k is not None and top_k < 0:
        raise invalid(f"{where}.top_k must not be negative", param=f"{where}.top_k")
    # num_predict -1: until the model stops; -2: fill the context (both: no limit here, the context bounds it).
    return Sampling(temperature=temperature, top_p=top_p, top_k=top_k, min_p=num("min_p", float),
                    repeat_penalty=num("repeat_penalty", float), seed=num("seed", int),
                    presence_penalty=num("presence_penalty", float), frequency_penalty=num("frequency_penalty", float),
                    stop=tuple(stop or ()), max_tokens=predict if predict is not None and predict > 0 else None)


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
    params = dict(body.parameters or {})
    if isinstance(params.get("stop"), str):
        params["stop"] = [params["stop"]]
    asked = sampling(params, notes, where="parameters")
    notes.ignored.discard("parameters.num_ctx")
    num_ctx = params.get("num_ctx")
    if num_ctx is not None and (isinstance(num_ctx, bool) or not isinstance(num_ctx, int) or num_ctx < 16):
        raise invalid("parameters.num_ctx must be an integer of at least 16", param="parameters.num_ctx")
    defaults: dict[str, Any] = {k: getattr(asked, k) for k in (
        "temperature", "top_p", "top_k", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty", "seed",
        "max_tokens") if getattr(asked, k) is not None}
    if asked.stop:
        defaults["stop"] = list(asked.stop)
    messages = None
    if body.messages is not None:
        messages = []
        for i, m in enumerate(body.messages):
            role, content = m.get("role"), m.get("content", "")
            if role not in ("system", "user", "assistant") or not isinstance(content, str):
                raise invalid(f"messages[{i}]: a role of system, user or assistant and a string content",
                              param=f"messages[{i}]")
            if set(m) - {"role", "content"}:
                notes.ignored.update(f"messages[{i}].{k}" for k in set(m) - {"role", "content"})
            messages.append({"role": role, "content": content})
    license_ = "\n\n".join(body.license) if isinstance(body.license, list) else body.license
    return Recipe(name=name, files=dict(body.files or {}), system=body.system, messages=messages, license=license_,
                  defaults=defaults, context_length=num_ctx, quantize=body.quantize or None)


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
