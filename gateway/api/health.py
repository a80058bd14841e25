"""The probes: `/health` (and `/health/ready`, the same verdict under Kubernetes' name) says whether
the default model can serve and how each configured model is doing; `/health/live` says the process
is up. Open without the API key (gateway.api.guards), for load balancers and orchestrators."""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from engines.base import Supervised
from gateway.api.openai.protocol import HealthResponse
from gateway.api.routes import error_responses
from gateway.models.pool import ModelManager

router = APIRouter()

_HEALTH_DOC: dict[int | str, dict[str, Any]] = {
    503: {"model": HealthResponse, "description": "The default model cannot serve: it failed to load or its files "
                                                  "are missing (`error`), the first load at start-up runs "
                                                  "(`loading`), its worker restarts (`degraded`, `Retry-After`), "
                                                  "or the server is draining (`Retry-After`)"},
    **error_responses(403)}


class LiveResponse(BaseModel):
    """`GET /health/live`: the process is up and answering (200), whatever its models do; 503 only
    once a shutdown has run out of drain time and is ending the requests still running."""

    status: Literal["alive", "stopping"]
    uptime_s: float


def _models(request: Request) -> dict[str, dict[str, Any]]:
    """Each configured model: loaded ones with their engine and numbers, the others `loading`,
    `failed` (with the error) or `not_loaded`."""
    manager: ModelManager = request.app.state.manager
    admission = request.app.state.admission
    models: dict[str, dict[str, Any]] = {}
    for entry in manager.loaded():
        h = entry.engine.health()
        c = entry.candidate
        row: dict[str, Any] = {
            "ready": h.ready,
            "engine": c.label,
            "device": c.device,
            "running": h.running,
            "waiting": h.waiting + admission.waiting(entry.spec.id),
            "fallback_reason": entry.fallback_reason or None,
        }
        if not h.ready and h.detail:
            row["detail"] = h.detail
        extra = entry.engine.info.extra
        # llama.cpp: where tokens are sampled, draft settings, the CPU variant, weight repacking, the KV layout
        for key in ("sampling", "speculative", "cpu_variant", "repack", "kv_layout"):
            if key in extra:
                row[key] = extra[key]
        held = {d: manager.held(entry, d) for d in manager.budgets}
        memory: dict[str, Any] = {"held_bytes": {d: b for d, b in held.items() if b}}
        if entry.need is not None:
            memory["estimate"] = {"ram_bytes": entry.need.host, "gpu_bytes": entry.need.gpu, "device": entry.need.device,
                                  "context": entry.need.context, "parallel": entry.need.parallel,
                                  "parts_bytes": dict(entry.need.parts)}
        if entry.need is not None and entry.need.shares:  # one copy over several GPUs: each one's share
            row["split"] = dict(entry.need.shares)
        if entry.need is not None and entry.need.copies:  # a copy on each of these GPUs
            row["replicas"] = list(entry.need.copies)
        if entry.fitted:
            memory["sized_down"] = entry.fitted
        keep = manager.keep_alive_of(entry)
        memory["keep_alive_s"] = keep
        row["memory"] = memory
        if isinstance(entry.engine, Supervised):
            seen = entry.engine.report()
            row[seen.kind] = seen.detail
        models[entry.spec.id] = row
    for mid in manager.loading:
        models.setdefault(mid, {"ready": False, "status": "loading"})
    for mid, err in manager.load_errors.items():
        models.setdefault(mid, {"ready": False, "status": "failed", "error": err})
    for mid in manager.registry.models:
        models.setdefault(mid, {"ready": False, "status": "not_loaded"})
    for mid, failures in manager.attempts.items():
        if mid in models and failures:
            models[mid]["failed_candidates"] = [{"candidate": w, "reason": y} for w, y in failures]
    return models


def _verdict(request: Request, models: dict[str, dict[str, Any]]) -> tuple[str, str | None]:
    """(status, reason) of the default model: `ok` when it serves or a request would load it,
    `loading` during the first load at start-up (or a reload after a failure), `degraded` while its
    worker restarts, `error` when it cannot load."""
    manager: ModelManager = request.app.state.manager
    default = manager.registry.default
    if manager.is_loaded(default):
        if models[default]["ready"]:
            return "ok", None
        # Its worker is restarting (after a crash): it will be back, and says when.
        return "degraded", str(models[default].get("detail", "restarting"))
    failed = manager.load_errors.get(default)
    if request.app.state.preloading or (failed is not None and default in manager.loading):
        return "loading", None
    if failed is not None:
        return "error", f"the default model {default!r} failed to load: {failed}"
    spec = manager.registry.models[default]
    if not manager.loadable(spec):
        return "error", (f"the files of the default model {default!r} are not on this machine "
                         f"(`gateway models --download {default}` fetches them or says what to install)")
    # Unloaded (asked to, or least recently used), or never loaded (--no-preload): a request loads it.
    return "ok", f"{default!r} is {'loading' if default in manager.loading else 'not loaded'}; a request loads it"


def health_response(request: Request) -> JSONResponse:
    """The /health answer: 200 when the default model can serve, else 503 with the reason."""
    manager: ModelManager = request.app.state.manager
    models = _models(request)
    status, reason = _verdict(request, models)
    body: dict[str, Any] = {"status": status, "default_model": manager.registry.default, "models": models,
                            "uptime_s": round(time.time() - request.app.state.started, 1),
                            "memory": manager.memory_status()}
    if manager.pulls:
        body["pulls"] = [p.as_dict() for p in manager.pulls.values()]
    if reason is not None:
        body["reason"] = reason
    if request.app.state.shadow is not None:
        body["parity"] = request.app.state.shadow.status()
    drain = request.app.state.drain
    if drain.draining:
        # Load balancers stop sending traffic here; running requests are being finished.
        body.update(status="draining", inflight=drain.inflight)
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(drain.retry_after)})
    headers = {}
    if status == "degraded":
        entry = manager.entry(manager.registry.default)
        supervised = entry is not None and isinstance(entry.engine, Supervised)
        headers["Retry-After"] = str(max(1, entry.engine.retry_after()) if supervised else 1)  # type: ignore[union-attr]
    return JSONResponse(body, status_code=200 if status == "ok" else 503, headers=headers)


@router.get("/health", response_model=HealthResponse, responses=_HEALTH_DOC)
async def health(request: Request) -> JSONResponse:
    return health_response(request)


@router.get("/health/ready", response_model=HealthResponse, responses=_HEALTH_DOC)
async def ready(request: Request) -> JSONResponse:
    """Kubernetes' readiness probe: the verdict of /health."""
    return health_response(request)


@router.get("/health/live", response_model=LiveResponse, responses={
    503: {"model": LiveResponse, "description": "Shutting down: the drain time ran out"}, **error_responses(403)})
async def live(request: Request) -> JSONResponse:
    """Kubernetes' liveness probe: the process answers. Loading, failed or draining models do not
    make it fail (restarting the process would not fix them, and would cut running streams)."""
    stopping = request.app.state.drain.expired
    body = LiveResponse(status="stopping" if stopping else "alive",
                        uptime_s=round(time.time() - request.app.state.started, 1))
    return JSONResponse(body.model_dump(), status_code=503 if stopping else 200)
