"""Ollama's routes on the gateway's port: `/api/chat`, `/api/generate` (NDJSON streams by default),
`/api/embed`, `/api/embeddings`, `/api/tags`, `/api/show`, `/api/ps`, `/api/version`; the routes
that make and remove models are in `manage`. Errors on these paths are Ollama's `{"error": "..."}`
(gateway.api.errors)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from gateway.api import reasoning
from gateway.api.adapter import drain, respond
from gateway.api.errors import APIError, invalid
from gateway.api.notes import Notes
from gateway.api.ollama import api as ol
from gateway.api.ollama.adapter import OLLAMA
from gateway.api.openai.protocol import EmbeddingRequest
from gateway.api.serving import Prepared, Service, model_spec
from gateway.api.sse import until_disconnect
from gateway.chat.template import traits_of
from gateway.conversation import ArgumentsDelta, CallStarted, Finished, ReasoningDelta, TextDelta
from gateway.models.gguf_info import GGUFError, parameter_size, read_gguf
from gateway.models.memory import gguf_info
from gateway.models.pool import ModelBusy, ModelManager, device_of
from gateway.models.registry import ModelSpec

log = logging.getLogger(__name__)
router = APIRouter(tags=["ollama"])


class OllamaError(BaseModel):
    """Ollama's error shape."""

    error: str


ERRORS: dict[int | str, dict[str, Any]] = {
    s: {"model": OllamaError, "description": w} for s, w in (
        (400, "Invalid request"), (401, "Missing or wrong API key"), (404, "Unknown model"),
        (429, "The model's queue is full"), (500, "The engine failed"), (503, "Loading or draining"))}


def named_spec(request: Request, name: str) -> ModelSpec:
    """Ollama names carry a tag (`model:latest`); the gateway's ids have none."""
    registry = request.app.state.manager.registry
    found: ModelSpec | None = registry.get(name) or (
        registry.get(name.removesuffix(":latest")) if name.endswith(":latest") else None)
    if found is None:
        return model_spec(registry, name)  # the 404
    if found.embedding_only and request.url.path in ("/api/chat", "/api/generate"):
        raise APIError(400, f"\"{name}\" does not support generate", param="model")
    return found


# --- keep_alive -----------------------------------------------------------------------------------


class KeepAlive:
    """A request's keep_alive: the model stays loaded that long after it (the manager's reaper unloads
    it; 0: at once; negative: until evicted). Without one, the model's default (--keep-alive)."""

    def __init__(self, manager: ModelManager) -> None:
        self.manager = manager

    def set(self, model_id: str, seconds: float | None) -> None:
        if seconds is None:
            return
        if seconds == 0:
            asyncio.get_running_loop().create_task(self._unload(model_id))
            return
        self.manager.set_keep_alive(model_id, seconds)

    async def _unload(self, model_id: str) -> None:
        for _ in range(100):  # a request still finishing: try again shortly
            try:
                await self.manager.unload(model_id)
                return
            except ModelBusy:
                await asyncio.sleep(0.1)
        log.info("keep_alive: %s is still busy; left loaded", model_id)


def _keep_alive(request: Request) -> KeepAlive:
    ka: KeepAlive | None = getattr(request.app.state, "ollama_keep_alive", None)
    if ka is None:
        ka = request.app.state.ollama_keep_alive = KeepAlive(request.app.state.manager)
    return ka


# --- chat and generate -------------------------------------------------------------------------------


async def _load_only(request: Request, spec: ModelSpec, name: str, keep: float | None, key: str) -> JSONResponse:
    """An empty chat/generate: load the model (or, with keep_alive 0, unload it), as Ollama does."""
    manager: ModelManager = request.app.state.manager
    if keep == 0:
        with contextlib.suppress(ModelBusy):
            await manager.unload(spec.id)
        reason = "unload"
    else:
        await until_disconnect(request, manager.get(spec))
        _keep_alive(request).set(spec.id, keep)
        reason = "load"
    body = {"model": name, "created_at": ol.now(), key: {"role": "assistant", "content": ""} if key == "message" else "",
            "done_reason": reason, "done": True}
    return JSONResponse(body)


async def _check_think(request: Request, spec: ModelSpec, body: ol.ChatRequest | ol.GenerateRequest) -> None:
    """`think` for a model that does not think is a 400, as Ollama answers it."""
    if body.think in (None, False):
        return
    manager: ModelManager = request.app.state.manager
    loaded = await until_disconnect(request, manager.get(spec))
    if not reasoning.reasons(spec, traits_of(loaded.engine.info)):
        raise invalid(f'"{body.model}" does not support thinking', param="think")


async def _lines(service: Service, p: Prepared, name: str, key: str, timing: ol.Timing, answer: ol.Answer
                 ) -> AsyncGenerator[dict[str, Any], None]:
    """The answer as Ollama's stream objects; `answer` holds the whole of it at the end."""

    def piece(text: str, thought: str = "") -> dict[str, Any]:
        if key == "message":
            msg = {"role": "assistant", "content": text, **({"thinking": thought} if thought else {})}
            return {"model": name, "created_at": ol.now(), "message": msg, "done": False}
        return {"model": name, "created_at": ol.now(), "response": text, **({"thinking": thought} if thought else {}),
                "done": False}

    async with contextlib.aclosing(service.conversation_events(p)) as events:
        async for _i, e in events:
            if not timing.first and not isinstance(e, Finished):
                timing.first = time.perf_counter()
            if isinstance(e, TextDelta):
                if e.text:
                    answer.text += e.text
                    yield piece(e.text)
            elif isinstance(e, ReasoningDelta):
                if e.text:
                    answer.thinking += e.text
                    yield piece("", e.text)
            elif isinstance(e, CallStarted | ArgumentsDelta):
                continue  # Ollama sends calls whole: at the end
            elif isinstance(e, Finished):
                answer.calls = e.calls
                answer.done_reason = ol.done_reason(e.reason)
                u = e.usage
                answer.fields = timing.done_fields(u.prompt_tokens if u else 0, u.cached_tokens if u else 0,
                                                   u.completion_tokens if u else 0)
                if e.calls:
                    yield {"model": name, "created_at": ol.now(), "message": {
                        "role": "assistant", "content": "", "tool_calls": ol.tool_calls_out(e.calls)}, "done": False}


def _final(name: str, key: str, answer: ol.Answer, whole: bool) -> dict[str, Any]:
    if key == "message":
        msg: dict[str, Any] = {"role": "assistant", "content": answer.text if whole else ""}
        if whole and answer.thinking:
            msg["thinking"] = answer.thinking
        if whole and answer.calls:
            msg["tool_calls"] = ol.tool_calls_out(answer.calls)
        out: dict[str, Any] = {"model": name, "created_at": ol.now(), "message": msg}
    else:
        out = {"model": name, "created_at": ol.now(), "response": answer.text if whole else "",
               **({"thinking": answer.thinking} if whole and answer.thinking else {})}
    return {**out, "done_reason": answer.done_reason, "done": True, **answer.fields}


async def _answer(request: Request, p: Prepared, name: str, key: str, stream: bool, timing: ol.Timing,
                  headers: dict[str, str], spec: ModelSpec, keep: float | None) -> Response:
    service: Service = request.app.state.chat
    answer = ol.Answer()

    async def lines() -> AsyncIterator[dict[str, Any]]:
        async with contextlib.aclosing(_lines(service, p, name, key, timing, answer)) as each:
            async for obj in each:
                yield obj
        yield _final(name, key, answer, False)

    async def whole() -> dict[str, Any]:
        await drain(_lines(service, p, name, key, timing, answer))
        return _final(name, key, answer, True)

    return await respond(request, OLLAMA, stream=stream, frames=lines, whole=whole, headers=headers,
                         release=p.release, finish=lambda: _keep_alive(request).set(spec.id, keep))


NDJSON = {"application/x-ndjson": {"schema": {"type": "string", "description": "one JSON object per line"}}}


@router.post("/api/chat", responses={200: {"description": "The answer (JSON), or NDJSON lines unless `stream` "
                                           "is false; the last line has `done: true` and the timings",
                                           "content": NDJSON},
                                     **ERRORS})
async def chat(body: ol.ChatRequest, request: Request) -> Response:
    received = time.perf_counter()
    service: Service = request.app.state.chat
    spec = named_spec(request, body.model)
    keep = ol.keep_alive_seconds(body.keep_alive)
    if not body.messages:
        return await _load_only(request, spec, body.model, keep, "message")
    notes = Notes()
    conv = ol.chat_conversation(body, notes)
    await _check_think(request, spec, body)
    timing = ol.Timing(received)
    was_loaded = service.manager.is_loaded(spec.id)
    p = await until_disconnect(request, service.prepare_conversation(spec, conv, 1, "ollama", received))
    timing.started = time.perf_counter()
    timing.load_s = 0.0 if was_loaded else p.loaded.load_seconds
    request.state.observer = p.observer
    notes.skipped_tools.update(p.skipped_tools)
    return await _answer(request, p, body.model, "message", body.stream, timing, {**p.headers, **notes.headers()},
                         spec, keep)


@router.post("/api/generate", responses={200: {"description": "The completion (JSON), or NDJSON lines unless "
                                               "`stream` is false", "content": NDJSON}, **ERRORS})
async def generate(body: ol.GenerateRequest, request: Request) -> Response:
    received = time.perf_counter()
    service: Service = request.app.state.chat
    spec = named_spec(request, body.model)
    keep = ol.keep_alive_seconds(body.keep_alive)
    if not body.prompt and not body.system:
        return await _load_only(request, spec, body.model, keep, "response")
    notes = Notes()
    for name in ("template", "context"):
        if getattr(body, name):
            notes.ignored.add(name)
    conv = ol.generate_conversation(body, notes)
    await _check_think(request, spec, body)
    timing = ol.Timing(received)
    was_loaded = service.manager.is_loaded(spec.id)
    if body.raw:  # the prompt as it is, no chat template
        if conv.images:
            raise invalid("images go into the prompt through the model's chat template: not with raw true",
                          param="images")
        p = await until_disconnect(request, service.prepare_prompts(spec, [body.prompt], conv.sampling, 1, "ollama",
                                                                    received, conv.output))
    else:
        p = await until_disconnect(request, service.prepare_conversation(spec, conv, 1, "ollama", received))
    timing.started = time.perf_counter()
    timing.load_s = 0.0 if was_loaded else p.loaded.load_seconds
    request.state.observer = p.observer
    return await _answer(request, p, body.model, "response", body.stream, timing, {**p.headers, **notes.headers()},
                         spec, keep)


# --- embeddings ---------------------------------------------------------------------------------------


def _embedding_request(model: str, text: str | list[str], dimensions: int | None = None) -> EmbeddingRequest:
    try:
        return EmbeddingRequest(model=model, input=text, dimensions=dimensions)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = "dimensions" if first.get("loc", ("",))[0] == "dimensions" else "input"
        raise invalid(f"{where}: {first.get('msg', 'invalid value')}", param=where) from None


@router.post("/api/embed", responses={200: {"description": "One vector per input (L2-normalised)"}, **ERRORS})
async def embed(body: ol.EmbedRequest, request: Request) -> JSONResponse:
    received = time.perf_counter()
    spec = named_spec(request, body.model)
    was_loaded = request.app.state.manager.is_loaded(spec.id)
    out = await request.app.state.embeddings.embed(_embedding_request(spec.id, body.input, body.dimensions), received)
    loaded = request.app.state.manager.entry(spec.id)
    _keep_alive(request).set(spec.id, ol.keep_alive_seconds(body.keep_alive))
    return JSONResponse({"model": body.model, "embeddings": [d.embedding for d in out.data],
                         "total_duration": int((time.perf_counter() - received) * 1e9),
                         "load_duration": int(loaded.load_seconds * 1e9) if loaded and not was_loaded else 0,
                         "prompt_eval_count": out.usage.prompt_tokens})


@router.post("/api/embeddings", responses={200: {"description": "The prompt's vector (the older route)"}, **ERRORS})
async def embeddings(body: ol.LegacyEmbeddingRequest, request: Request) -> JSONResponse:
    spec = named_spec(request, body.model)
    out = await request.app.state.embeddings.embed(_embedding_request(spec.id, body.prompt), time.perf_counter())
    _keep_alive(request).set(spec.id, ol.keep_alive_seconds(body.keep_alive))
    return JSONResponse({"embedding": out.data[0].embedding})


# --- models -------------------------------------------------------------------------------------------


def _gguf_path(request: Request, spec: ModelSpec) -> Path | None:
    """Where the model's GGUF is (or would be) on disk; None for a model without one."""
    found: Path | None = request.app.state.manager.registry.local_path(spec, "gguf") if "gguf" in spec.formats else None
    return found


def _file_facts(request: Request, spec: ModelSpec) -> tuple[int, str, str] | None:
    """(size, digest, modified_at) of the model's GGUF, or None when it is not on disk."""
    path = _gguf_path(request, spec)
    if path is None or not path.exists():
        return None
    st = path.stat()
    # A digest of the file's identity (path, size, time), not of its bytes: hashing gigabytes per listing is
    # what a cache would be for; clients only compare digests.
    digest = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()
    modified = datetime.fromtimestamp(st.st_mtime, tz=UTC).isoformat()
    return st.st_size, digest, modified


def _details(spec: ModelSpec) -> dict[str, Any]:
    parent = spec.created.parent if spec.created is not None else ""
    if spec.pulled is not None:  # `gateway pull` read these from the GGUF
        p = spec.pulled
        return {"parent_model": parent, "format": "gguf", "family": p.architecture, "families": [p.architecture],
                "parameter_size": parameter_size(p.parameters), "quantization_level": p.quant}
    src = spec.formats.get("gguf")
    if src is not None and src.path and spec.created is not None and spec.created.files:
        try:  # made from uploaded files: their header says
            facts = _gguf_facts(src.path, Path(src.path).stat().st_mtime_ns)
        except OSError:
            facts = None
        if facts is not None:
            arch, params, quant = facts
            return {"parent_model": parent, "format": "gguf", "family": arch, "families": [arch],
                    "parameter_size": parameter_size(params), "quantization_level": quant}
    quant = next((q for q in ("Q4_K_M", "Q4_1", "Q4_0", "Q5_K_M", "Q8_0", "F16") if q.lower() in
                  json.dumps(gguf.model_dump() if (gguf := spec.formats.get("gguf")) else "").lower()), "")
    return {"parent_model": parent, "format": "gguf", "family": spec.id.split("-")[0],
            "families": [spec.id.split("-")[0]], "parameter_size": "", "quantization_level": quant}


@functools.lru_cache(maxsize=64)
def _gguf_facts(path: str, mtime_ns: int) -> tuple[str, int, str] | None:
    """(architecture, parameters, quantisation) from a GGUF's header (None when unreadable); cached per
    file version."""
    try:
        info = read_gguf(path)
    except GGUFError:
        return None
    return info.arch, info.parameters, info.quantization


# Ollama's parameter names for the model defaults the gateway keeps.
_PARAMETER_NAMES = {"max_tokens": "num_predict"}


def _parameters(spec: ModelSpec) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in spec.defaults.model_dump(exclude_defaults=True).items():
        for v in (value if isinstance(value, list) else [value]):
            out.append((_PARAMETER_NAMES.get(key, key), v))
    return out


def _modelfile(spec: ModelSpec, parameters: list[tuple[str, Any]]) -> str:
    """The model as a Modelfile would make it (for reading: `/api/create` takes fields, not this)."""
    src = spec.formats.get("gguf")
    origin = spec.created.parent if spec.created is not None and spec.created.parent else (
        src.path if src is not None and src.path else spec.id)
    lines = [f"# Modelfile of {spec.id}", f"FROM {origin}"]
    if spec.system:
        lines.append(f'SYSTEM """{spec.system}"""')
    lines += [f"PARAMETER {k} {json.dumps(v) if isinstance(v, str) else v}" for k, v in parameters]
    lines += [f'MESSAGE {m.role} """{m.content}"""' for m in spec.messages]
    if spec.license:
        lines.append(f'LICENSE """{spec.license}"""')
    return "\n".join(lines) + "\n"


def _entry(request: Request, spec: ModelSpec) -> dict[str, Any] | None:
    facts = _file_facts(request, spec)
    if facts is None:
        return None
    size, digest, modified = facts
    return {"name": spec.id, "model": spec.id, "modified_at": modified, "size": size, "digest": digest,
            "details": _details(spec)}


@router.get("/api/tags", responses={200: {"description": "The models on disk"}, **ERRORS})
async def tags(request: Request) -> JSONResponse:
    specs = request.app.state.manager.registry.current().values()
    models = [e for e in (await asyncio.gather(*(asyncio.to_thread(_entry, request, s) for s in specs))) if e]
    return JSONResponse({"models": models})


def _template(request: Request, spec: ModelSpec) -> str:
    """The chat template the model is served with: models.yaml's, else its GGUF's own (Jinja where
    Ollama shows its Go template; clients such as LiteLLM look in it for tool support)."""
    if spec.chat_template:
        return spec.chat_template
    path = _gguf_path(request, spec)
    info = gguf_info(path) if path is not None else None  # None too when the file is not there
    return (info.chat_template or "") if info is not None else ""


@router.post("/api/show", responses={200: {"description": "A model's details and capabilities"}, **ERRORS})
async def show(body: ol.ModelRequest, request: Request) -> JSONResponse:
    spec = named_spec(request, body.id)
    manager: ModelManager = request.app.state.manager
    loaded = manager.entry(spec.id)
    context = loaded.engine.info.context_length if loaded is not None else spec.context_length
    caps = ["embedding"] if spec.embedding_only else ["completion", *(["tools"] if spec.tools else []),
                                                       *(["vision"] if spec.mmproj is not None else [])]
    facts = await asyncio.to_thread(_file_facts, request, spec)
    parameters = _parameters(spec)
    body_out: dict[str, Any] = {
        "modelfile": _modelfile(spec, parameters),
        "parameters": "\n".join(f"{k:<30} {json.dumps(v) if isinstance(v, str) else v}" for k, v in parameters),
        "template": await asyncio.to_thread(_template, request, spec), "details": await asyncio.to_thread(_details, spec),
        "model_info": {"general.context_length": context}, "capabilities": caps,
        "modified_at": facts[2] if facts else ol.now()}
    if spec.system:
        body_out["system"] = spec.system
    if spec.license:
        body_out["license"] = spec.license
    if spec.messages:
        body_out["messages"] = [{"role": m.role, "content": m.content} for m in spec.messages]
    return JSONResponse(body_out)


@router.get("/api/ps", responses={200: {"description": "The loaded models"}, **ERRORS})
async def ps(request: Request) -> JSONResponse:
    manager: ModelManager = request.app.state.manager
    out = []
    for m in manager.loaded():
        facts = await asyncio.to_thread(_file_facts, request, m.spec)
        expires = manager.expires(m)
        # Ollama's size is the memory the model takes (RAM + VRAM), size_vram the GPU's share.
        device = device_of(m.candidate, manager.host)
        vram = manager.held(m, device) if device != "cpu" else 0
        size = manager.held(m, "cpu") + vram or (facts[0] if facts else 0)
        out.append({"name": m.spec.id, "model": m.spec.id, "size": size,
                    "digest": facts[1] if facts else "", "details": _details(m.spec),
                    "expires_at": datetime.fromtimestamp(expires, tz=UTC).isoformat() if expires
                    else "2318-01-01T00:00:00Z",  # pinned or no keep_alive: resident until evicted
                    "size_vram": vram,
                    "context_length": m.engine.info.context_length})
    return JSONResponse({"models": out})


@router.get("/api/version", responses={200: {"description": "The Ollama API version these routes follow"}})
async def version() -> JSONResponse:
    return JSONResponse({"version": ol.OLLAMA_API_VERSION})
