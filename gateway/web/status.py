"""The JSON the web page reads, usable by scripts too: `/api/status` (models and live numbers),
`/api/devices` (what `gateway devices` shows) and load/unload of a model. Behind the API key like
/v1 (gateway.api.guards)."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel

from engines.base import ModelNotAvailable
from gateway.api.errors import APIError
from gateway.api.openai.protocol import ErrorResponse
from gateway.api.routes import error_responses
from gateway.api.serving import model_spec
from gateway.chat import formats
from gateway.chat.template import template_of
from gateway.host.devices import memory_verdict, placement_of, render, runtime_facts, runtime_reports
from gateway.host.selection import Candidate, Plan, SelectionError
from gateway.metrics import SLO_E2E_S, SLO_TPOT_S, SLO_TTFT_S
from gateway.models.pool import Loaded, ModelBusy, ModelManager, cached_ladder, engine_config, ladder_verdict
from gateway.models.registry import ModelSpec, source_label
from gateway.web.live import HISTORY_S, RATE_WINDOW_S, SAMPLE_S, WINDOW_S, LiveStats, Point, Totals

router = APIRouter(prefix="/api")


class FailedCandidate(BaseModel):
    candidate: str
    reason: str


class ParityEngine(BaseModel):
    """Shadow parity of one serving engine (`gateway serve --parity-reference`)."""

    engine: str
    device: str
    drifted: bool
    reason: str | None
    scored: int
    mean_kl: float | None


class ModelStatus(BaseModel):
    id: str
    description: str
    endpoints: list[str]
    images: bool  # it takes images (a vision projector, models.yaml mmproj)
    available: bool  # its files are on this machine (no download needed)
    state: Literal["loaded", "loading", "failed", "not_loaded"]
    engine: str | None  # runtime/backend serving it, as in X-Engine
    device: str | None  # as in X-Device
    placement: str | None  # loaded on several GPUs: "replicas on cuda:0, cuda:1", "split over cuda:0 (0.5), ..."
    running: int
    waiting: int  # in the engine and in the gateway's queue
    load_seconds: float | None
    fallback_reason: str | None  # why preferred engines are not serving it
    error: str | None  # why the last load failed
    failed_candidates: list[FailedCandidate]
    parity: list[ParityEngine]  # empty when shadow parity is off
    excluded: dict[str, str]  # engine -> why it was taken out of selection (parity drift)
    source: str  # where its files come from: pypi:<package>, hf.co/<repo>, path, remote workers
    memory_bytes: int | None  # loaded: what it holds (RAM + GPU; its estimate or its worker's measured memory)
    memory_detail: str | None  # loaded: the estimate's parts, and what was sized down to fit
    expires_in_s: float | None  # loaded and idle: seconds until keep_alive unloads it; None: it stays
    tool_format: str | None  # its family's format of tool calls and reasoning (models.yaml's, or once loaded)
    check: str | None  # its last capability check (`gateway check`): "6/7 ok"; None: not checked
    check_failed: list[str]  # the probes that were not ok, each with its reason


class DeviceMemory(BaseModel):
    budget_bytes: int
    used_bytes: int


class PullStatus(BaseModel):
    name: str
    status: str  # listing, downloading, verifying, registering, done, failed
    total: int
    completed: int
    file: str
    error: str
    model: str  # the id it is registered as


class Slo(BaseModel):
    """The SLO thresholds of deploy/prometheus/rules.yml (gateway.metrics holds them)."""

    ttft_s: float
    tpot_s: float
    e2e_s: float


class Live(BaseModel):
    window_s: float  # percentiles and 429 counts cover this span
    rate_window_s: float  # tokens per second cover this span
    sample_s: float  # at most one point per this many seconds
    history_s: float  # points kept
    slo: Slo
    totals: Totals
    points: list[Point]  # oldest first; only those newer than `since` when it is given


class StatusResponse(BaseModel):
    """`GET /api/status`: every configured model and the live numbers."""

    time: float  # server time (Unix seconds): pass the last point's `t` as `since` next time
    uptime_s: float
    default_model: str
    draining: bool
    parity_reference: str | None  # the reference engine of shadow parity; None when off
    models: list[ModelStatus]
    memory: dict[str, DeviceMemory]  # per device ("cpu", "cuda:0"): the budget and what models hold
    pulls: list[PullStatus]  # Hub pulls under way or just finished
    live: Live


class CheckOut(BaseModel):
    ok: bool
    reason: str
    tok_s: float | None


class CandidateOut(BaseModel):
    runtime: str
    engine: str
    device: str
    device_key: str
    check: CheckOut | None  # the cached functional check; None when not checked yet
    serving: bool  # this candidate serves the model now
    build: str  # llama.cpp: the side-by-side build's folder that serves it; "" for the installed package
    memory: str | None = None  # what it would take and whether it fits the budgets (as `gateway devices`)


class SkipOut(BaseModel):
    what: str
    why: str
    kind: str  # "unusable": present but cannot serve (a fallback); "absent": nothing of the kind here


class PlanOut(BaseModel):
    candidates: list[CandidateOut] = []
    skipped: list[SkipOut] = []
    error: str | None = None  # no engine can serve the model here
    placement: str | None = None  # over several GPUs: "replicas on cuda:0, cuda:1", "split over ..."


class DevicesResponse(BaseModel):
    """`GET /api/devices`: what `gateway devices --json` prints, for the served host, plus its text."""

    host: dict[str, Any]  # the probe (HostCapabilities)
    ep_matrix: list[dict[str, Any]]
    runtimes: dict[str, list[str]]  # each runtime's lines of the `gateway devices` report, by runtime name
    plans: dict[str, PlanOut]  # per configured model, in preference order
    text: str  # the `gateway devices` table as the command prints it


def _model(request: Request, spec: ModelSpec) -> ModelStatus:
    state = request.app.state
    manager: ModelManager = state.manager
    entry = manager.entry(spec.id)
    usage = next(((h.running, h.waiting) for m, _, _, h in state.live.resident() if m == spec.id), (0, 0))
    shadow = state.shadow.status() if state.shadow is not None else {"engines": [], "excluded": {}}
    report = state.checks.get(spec.id)
    return ModelStatus(
        id=spec.id,
        description=spec.description,
        endpoints=spec.endpoints(),
        images=spec.mmproj is not None,
        available=manager.available(spec),
        state=("loaded" if entry is not None else "loading" if spec.id in manager.loading
               else "failed" if spec.id in manager.load_errors else "not_loaded"),
        engine=entry.candidate.label if entry else None,
        device=entry.candidate.device if entry else None,
        placement=(entry.placement or None) if entry else None,
        running=usage[0],
        waiting=usage[1],
        load_seconds=round(entry.load_seconds, 2) if entry else None,
        fallback_reason=(entry.fallback_reason or None) if entry else None,
        error=manager.load_errors.get(spec.id),
        failed_candidates=[FailedCandidate(candidate=c, reason=r) for c, r in manager.attempts.get(spec.id, [])],
        parity=[ParityEngine(engine=p["engine"], device=p["device"], drifted=p["drifted"], reason=p["reason"],
                             scored=p["scored"], mean_kl=p["mean_kl"])
                for p in shadow["engines"] if p["model"] == spec.id],
        excluded=shadow["excluded"].get(spec.id, {}),
        source=source_label(spec),
        memory_bytes=sum(manager.held(entry, d) for d in {"cpu", *manager.budgets}) if entry else None,
        memory_detail=((entry.need.describe() if entry.need else "")
                       + (f"; sized down to fit: {entry.fitted}" if entry.fitted else "")) or None if entry else None,
        expires_in_s=_expires_in(manager, entry),
        tool_format=spec.tool_format or (formats.detect(template_of(entry.engine.info)).name if entry else None),
        check=report.summary() if report is not None else None,
        check_failed=[f"{f.name}: {f.detail}" for f in report.findings if f.ok is False] if report is not None else [],
    )


def _expires_in(manager: ModelManager, entry: Loaded | None) -> float | None:
    if entry is None:
        return None
    at = manager.expires(entry)
    return None if at is None else round(max(0.0, at - time.time()), 1)


@router.get("/status", responses=error_responses(401, 403))
async def status(request: Request, since: Annotated[float | None, Query(
        description="only live points newer than this server time (the last `t` you have)")] = None) -> StatusResponse:
    state = request.app.state
    live: LiveStats = state.live
    live.sample()
    manager: ModelManager = state.manager
    now = live.points[-1].t if live.points else 0.0
    return StatusResponse(
        time=now,
        uptime_s=round(now - state.started, 1),
        default_model=manager.registry.default,
        draining=state.drain.draining,
        parity_reference=state.shadow.reference if state.shadow is not None else None,
        models=[_model(request, spec) for spec in manager.registry.current().values()],
        memory={d: DeviceMemory(**m) for d, m in manager.memory_status().items()},
        pulls=[PullStatus(**p.as_dict()) for p in manager.pulls.values()],
        live=Live(window_s=WINDOW_S, rate_window_s=RATE_WINDOW_S, sample_s=SAMPLE_S, history_s=HISTORY_S,
                  slo=Slo(ttft_s=SLO_TTFT_S, tpot_s=SLO_TPOT_S, e2e_s=SLO_E2E_S),
                  totals=live.totals(), points=live.since(since)),
    )


def _check(manager: ModelManager, spec: ModelSpec, cand: Candidate) -> CheckOut | None:
    """The functional check cached for `cand`, looked up as `gateway devices` does."""
    path = manager.registry.local_path(spec, cand.format)
    if path is None:
        return None
    config = engine_config(spec, cand, str(path), manager.settings)
    result = ladder_verdict(cand, cached_ladder(manager.checks, cand, config, manager.host, manager.settings))
    return None if result is None else CheckOut(ok=result.ok, reason=result.reason, tok_s=result.tok_s)


@router.get("/devices", responses=error_responses(401, 403))
async def devices(request: Request) -> DevicesResponse:
    manager: ModelManager = request.app.state.manager
    serving = {e.spec.id: e.candidate for e in manager.loaded()}
    plans: dict[str, Plan | str] = {}
    checks: dict[str, Any] = {}
    memory: dict[str, str] = {}
    placements: dict[str, str] = {}
    out: dict[str, PlanOut] = {}
    for spec in manager.registry.models.values():
        try:
            p = manager.plan(spec)
        except SelectionError as exc:
            plans[spec.id] = str(exc)
            out[spec.id] = PlanOut(error=str(exc))
            continue
        plans[spec.id] = p
        cands = []
        for c in p.candidates:
            check = _check(manager, spec, c)
            if check is not None:
                checks[f"{spec.id}|{c.label}|{c.device_key}"] = check.model_dump()
            path = manager.registry.local_path(spec, c.format)
            mem = memory_verdict(spec, c, engine_config(spec, c, str(path), manager.settings), manager.host,
                                 manager.budgets) if path is not None else ""
            if mem:
                memory[f"{spec.id}|{c.label}|{c.device_key}"] = mem
            cands.append(CandidateOut(runtime=c.runtime, engine=c.backend, device=c.device, device_key=c.device_key,
                                      check=check, serving=serving.get(spec.id) == c, build=c.lib_path,
                                      memory=mem or None))
        placements[spec.id] = placement_of(spec, p, memory, manager.host, manager.budgets, manager.devices_of(spec))
        out[spec.id] = PlanOut(candidates=cands, skipped=[SkipOut(what=s.what, why=s.why, kind=s.kind) for s in p.skipped],
                               placement=placements[spec.id] or None)
    host = manager.host
    return DevicesResponse(
        host=host.to_dict(),
        ep_matrix=runtime_facts(host).get("ep_matrix", []),
        runtimes=runtime_reports(host),
        plans=out,
        text=render(host, plans, checks, memory, manager.budgets, placements),
    )


_CONFLICT: dict[int | str, dict[str, Any]] = {
    409: {"model": ErrorResponse, "description": "Unload: the model is loading or serving requests (`model_loading`, "
                                                 "`model_busy`). Load: its files are not on this machine "
                                                 "(`model_not_installed`; the message says how to install them)"}}


@router.post("/models/{model_id:path}/load", responses={**error_responses(401, 403, 404, 503), **_CONFLICT})
async def load(model_id: str, request: Request) -> ModelStatus:
    """Load the model now (as its first request would): planned, checked, then resident."""
    manager: ModelManager = request.app.state.manager
    spec = model_spec(manager.registry, model_id)
    try:
        await manager.get(spec)
    except ModelNotAvailable as exc:
        # Not a server fault: the model is configured, but its files are to be installed here first.
        raise APIError(409, str(exc), code="model_not_installed") from exc
    return _model(request, spec)


@router.post("/models/{model_id:path}/unload", responses={**error_responses(401, 403, 404), **_CONFLICT})
async def unload(model_id: str, request: Request) -> ModelStatus:
    """Unload an idle model; its next request loads it again."""
    manager: ModelManager = request.app.state.manager
    spec = model_spec(manager.registry, model_id)
    if spec.id in manager.loading:
        raise APIError(409, f"model {spec.id!r} is loading; unload it once it is loaded", code="model_loading")
    entry = manager.entry(spec.id)
    if entry is not None:
        h = entry.engine.health()
        busy = h.running + h.waiting + request.app.state.admission.waiting(spec.id)
        if busy:
            raise APIError(409, f"model {spec.id!r} has {busy} request(s) running or waiting; unload it when idle",
                           code="model_busy")
        try:
            await manager.unload(spec.id)
        except ModelBusy as exc:
            raise APIError(409, f"{exc}; unload it when idle", code="model_busy") from exc
    return _model(request, spec)
