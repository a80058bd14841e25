"""Thin HTTP routes: read app.state, call a service, return."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from gateway.serving import ChatService, CompletionService, Prepared
from gateway.sse import sse_response, until_disconnect

router = APIRouter()


async def _respond(
    request: Request, service: ChatService | CompletionService, p: Prepared, model: str, stream: bool, include_usage: bool
) -> Response:
    try:
        if not stream:
            body = await until_disconnect(request, service.complete(p, model))
            return Response(body.model_dump_json(), media_type="application/json", headers=p.headers)
        frames = service.stream(p, model, include_usage)
        # Wait for the first token before sending headers: errors found before it (context too long,
        # queue full) still get a proper status, and clients measure an honest time to first token.
        first = await until_disconnect(request, anext(frames))
    except BaseException:
        p.release()
        raise
    return sse_response(first, frames, p.headers)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    received = time.perf_counter()
    service: ChatService = request.app.state.chat
    p = await until_disconnect(request, service.prepare_chat(body, received))
    request.state.observer = p.observer
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await _respond(request, service, p, body.model, body.stream, include_usage)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    received = time.perf_counter()
    service: CompletionService = request.app.state.completions
    p = await until_disconnect(request, service.prepare_completion(body, received))
    request.state.observer = p.observer
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await _respond(request, service, p, body.model, body.stream, include_usage)


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    manager = request.app.state.manager
    created = request.app.state.started
    cards = [
        ModelCard(
            id=spec.id,
            created=created,
            context_length=spec.context_length,
            formats=sorted(spec.formats),
            available=any(manager.registry.local_path(spec, f) is not None for f in spec.formats),
            loaded=manager.is_loaded(spec.id),
        )
        for spec in manager.registry.models.values()
    ]
    return ModelList(data=cards)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    manager = request.app.state.manager
    default = manager.registry.default
    models: dict[str, Any] = {}
    gates = request.app.state.admission.gates()
    for entry in manager.loaded():
        h = entry.engine.health()
        c = entry.candidate
        gate = gates.get(entry.spec.id)
        models[entry.spec.id] = {
            "ready": h.ready,
            "engine": c.label,
            "device": c.device,
            "running": h.running,
            "waiting": h.waiting + (gate.waiting if gate else 0),
            "fallback_reason": entry.fallback_reason or None,
        }
    for mid in manager.loading:
        models.setdefault(mid, {"ready": False, "status": "loading"})
    for mid, err in manager.load_errors.items():
        models.setdefault(mid, {"ready": False, "status": "failed", "error": err})
    for mid, failures in manager.attempts.items():
        if mid in models and failures:
            models[mid]["failed_candidates"] = [{"candidate": w, "reason": y} for w, y in failures]
    ready = default in models and models[default].get("ready", False)
    status = "ok" if ready else ("loading" if default in manager.loading or request.app.state.preloading else "error")
    if not request.app.state.preload and not ready and default not in manager.load_errors:
        status, ready = "ok", True  # lazy mode: the default model loads on first request
    body = {"status": status, "default_model": default, "models": models, "uptime_s": round(time.time() - request.app.state.started, 1)}
    if request.app.state.shadow is not None:
        body["parity"] = request.app.state.shadow.status()
    drain = request.app.state.drain
    if drain.draining:
        # Load balancers stop sending traffic here; running requests are being finished.
        body.update(status="draining", inflight=drain.inflight)
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(drain.retry_after)})
    return JSONResponse(body, status_code=200 if ready else 503)
