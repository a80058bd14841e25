"""Thin HTTP routes: read app.state, call a service, return."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from gateway.api import capabilities, reasoning
from gateway.api.adapter import respond
from gateway.api.capabilities import Report
from gateway.api.errors import APIError
from gateway.api.openai.adapters import OPENAI
from gateway.api.openai.chat import ChatService
from gateway.api.openai.completions import CompletionService
from gateway.api.openai.protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    CheckFinding,
    CheckReport,
    Completion,
    CompletionRequest,
    EmbeddingList,
    EmbeddingRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    StreamOptions,
)
from gateway.api.serving import Prepared, model_spec
from gateway.api.sse import until_disconnect
from gateway.chat import formats
from gateway.chat.template import template_of, traits_of

router = APIRouter()

# What each error status means here; every one carries the OpenAI error envelope.
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": what}
    for status, what in (
        (400, "Invalid request: bad JSON, an unknown or invalid parameter, a prompt over the context or limits"),
        (401, "Missing or wrong API key (`WWW-Authenticate: Bearer`)"),
        (403, "Origin or Host not allowed (CORS policy, DNS-rebinding guard)"),
        (404, "Unknown model"),
        (413, "Request body over `--max-body`"),
        (429, "Overloaded: the model's queue is full or the wait would exceed `--max-queue-wait` "
              "(`Retry-After` gives seconds)"),
        (500, "The engine failed, or an unexpected error (logged with the request id, which the message repeats)"),
        (502, "The engine's worker process crashed or hung while serving the request (`code: engine_failed`); "
              "it is restarted, and a request that had not started yet is retried on it"),
        (503, "Model loading or failed to load, or the server is draining (`Retry-After`)"),
    )
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The documented error responses of a route that can answer with these statuses."""
    return {status: _ERRORS[status] for status in statuses}


def _stream_doc(chunk: type[Any]) -> dict[str, Any]:
    # OpenAPI 3.1: for text/event-stream, `schema` describes one event.
    return {
        "schema": {
            "type": "object",
            "description": (
                "Server-sent events, when the request sets `stream: true`. Each event's `data` is a "
                f"`{chunk.__name__}` in JSON; an error that happens after the first event arrives in-band "
                "as the error envelope; the stream always ends with `data: [DONE]`."
            ),
            "required": ["data"],
            "properties": {
                "event": {"type": "string"},
                "data": {
                    "anyOf": [
                        {"const": "[DONE]"},
                        {
                            "type": "string",
                            "contentMediaType": "application/json",
                            "contentSchema": {"anyOf": [{"$ref": f"#/components/schemas/{chunk.__name__}"},
                                                        {"$ref": "#/components/schemas/ErrorResponse"}]},
                        },
                    ]
                },
            },
        },
    }


def _generation_responses(whole: type[Any], chunk: type[Any]) -> dict[int | str, dict[str, Any]]:
    return {
        200: {"model": whole, "description": "The completion (JSON), or its stream (SSE) when `stream` is true",
              "content": {"text/event-stream": _stream_doc(chunk)}},
        **_ERRORS,
    }


def openapi_schema(app: Any, extra_models: tuple[type[Any], ...] = (ChatCompletionChunk,)) -> dict[str, Any]:
    """The app's OpenAPI document, made to describe what the server really does: request errors
    are 400 in the OpenAI envelope (never FastAPI's 422), and stream chunks have their schema."""
    if app.openapi_schema:
        return dict(app.openapi_schema)
    from fastapi.openapi.utils import get_openapi

    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="OpenAI-compatible API of llm-gateway. Errors use the OpenAI envelope "
                                  "`{\"error\": {\"message\", \"type\", \"param\", \"code\"}}`.")
    for item in doc["paths"].values():
        for op in item.values():
            op.get("responses", {}).pop("422", None)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for model in extra_models:
        found = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(found.pop("$defs", {}))
        schemas[model.__name__] = found
    app.openapi_schema = doc
    return doc


async def _respond(
    request: Request, service: ChatService | CompletionService, p: Prepared, model: str, stream: bool,
    options: StreamOptions | None,
) -> Response:
    # vLLM's continuous_usage_stats counts only with include_usage.
    include = bool(options and options.include_usage)
    continuous = include and bool(options and options.continuous_usage_stats)
    return await respond(request, OPENAI, stream=stream, frames=lambda: service.stream(p, model, include, continuous),
                         whole=lambda: service.complete(p, model), headers=lambda: p.headers,
                         release=p.release)


@router.post("/v1/chat/completions", response_model=None,
             responses=_generation_responses(ChatCompletion, ChatCompletionChunk))
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    received = time.perf_counter()
    service: ChatService = request.app.state.chat
    p = await until_disconnect(request, service.prepare_chat(body, received))
    request.state.observer = p.observer
    return await _respond(request, service, p, body.model, body.stream, body.stream_options)


class AppliedTemplate(BaseModel):
    prompt: str = Field(description="The prompt the model's chat template renders the request to")


@router.post("/apply-template", response_model=AppliedTemplate, responses=error_responses(400, 401, 403, 404))
async def apply_template(body: ChatCompletionRequest, request: Request) -> AppliedTemplate:
    """A chat request rendered by the model's own template, tools and reasoning switch included:
    exactly the text the engine gets (llama-server's /apply-template)."""
    service: ChatService = request.app.state.chat
    return AppliedTemplate(prompt=await until_disconnect(request, service.apply_template(body)))


@router.post("/v1/completions", response_model=None, responses=_generation_responses(Completion, Completion))
async def completions(body: CompletionRequest, request: Request) -> Response:
    received = time.perf_counter()
    service: CompletionService = request.app.state.completions
    p = await until_disconnect(request, service.prepare_completion(body, received))
    request.state.observer = p.observer
    return await _respond(request, service, p, body.model, body.stream, body.stream_options)


def _card(request: Request, spec: Any) -> ModelCard:
    manager = request.app.state.manager
    # The context the engine really allocated once loaded (a models.yaml value above the model's
    # trained context is served at the trained context).
    loaded = manager.entry(spec.id)
    fmt = formats.serving(spec.tool_format, template_of(loaded.engine.info)) if loaded is not None else None
    return ModelCard(
        id=spec.id,
        created=request.app.state.started,
        context_length=loaded.engine.info.context_length if loaded is not None else spec.context_length,
        formats=sorted(spec.formats),
        available=manager.available(spec),
        loaded=manager.is_loaded(spec.id),
        endpoints=spec.endpoints(),
        images=spec.mmproj is not None,
        description=spec.description,
        tool_format=fmt.name if fmt is not None else spec.tool_format,
        reasoning_format=(reasoning.format_name(spec, traits_of(loaded.engine.info), fmt)
                          if loaded is not None and fmt is not None
                          else None if spec.reasoning_format == "auto" else spec.reasoning_format),
        checks=_findings(request.app.state.checks.get(spec.id)),
    )


def _findings(report: Report | None) -> list[CheckFinding] | None:
    if report is None:
        return None
    return [CheckFinding(name=f.name, ok=f.ok, detail=f.detail) for f in report.findings]


def _anthropic_card(request: Request, spec: Any) -> dict[str, Any]:
    created = datetime.fromtimestamp(request.app.state.started, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"type": "model", "id": spec.id, "display_name": spec.description or spec.id, "created_at": created}


@router.get("/v1/models", response_model=ModelList, responses=error_responses(401, 403))
async def list_models(request: Request) -> Any:
    """OpenAI's model list; Anthropic's shape when the request carries `anthropic-version`."""
    specs = list(request.app.state.manager.registry.current().values())
    if "anthropic-version" in request.headers:
        data = [_anthropic_card(request, s) for s in specs]
        return JSONResponse({"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None})
    return ModelList(data=[_card(request, spec) for spec in specs])


@router.get("/v1/checks/{model_id:path}", response_model=CheckReport, responses=error_responses(401, 403, 404))
async def get_check(model_id: str, request: Request) -> Any:
    """The last capability check of a model (404 when it has none yet: `POST` runs one)."""
    spec = model_spec(request.app.state.manager.registry, model_id)
    report = request.app.state.checks.get(spec.id)
    if report is None:
        raise APIError(404, f"model {spec.id!r} has not been checked yet; POST /v1/checks/{spec.id} runs the check",
                       param="model", code="not_found")
    return _check_out(report)


@router.post("/v1/checks/{model_id:path}", response_model=CheckReport, responses=error_responses(401, 403, 404))
async def run_check(model_id: str, request: Request) -> Any:
    """Probe what the model really does here (tools, parallel and streamed calls, tool_choice,
    JSON schema output, stop strings, reasoning on and off), and keep the report."""
    service = request.app.state.chat
    spec = service.spec(model_id)
    report = await until_disconnect(request, capabilities.check(service, spec))
    request.app.state.checks.put(report)
    return _check_out(report)


def _check_out(report: Report) -> CheckReport:
    return CheckReport(model=report.model, format=report.format, checked_at=int(report.at), seconds=report.seconds,
                       summary=report.summary(), findings=_findings(report) or [])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=error_responses(401, 403, 404))
async def get_model(model_id: str, request: Request) -> Any:
    spec = model_spec(request.app.state.manager.registry, model_id)
    if "anthropic-version" in request.headers:
        return JSONResponse(_anthropic_card(request, spec))
    return _card(request, spec)


@router.post("/v1/embeddings", responses={200: {"model": EmbeddingList, "description": "One vector per input"},
                                          **_ERRORS})
async def embeddings(body: EmbeddingRequest, request: Request) -> EmbeddingList:
    received = time.perf_counter()
    result: EmbeddingList = await until_disconnect(request, request.app.state.embeddings.embed(body, received))
    return result


@router.get("/metrics", response_class=Response, responses={
    200: {"description": "Prometheus text format", "content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}},
    **error_responses(401, 403)})
async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
