"""create_app(): builds every dependency once and wires the routes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from engines.base import EngineConfig, EngineHealth, Supervised
from engines.runtimes import load_plugins
from gateway.api.adapter import Protocols
from gateway.api.admission import Admission
from gateway.api.anthropic.adapter import ANTHROPIC
from gateway.api.anthropic.messages import MessageStreamEvent
from gateway.api.anthropic.routes import router as anthropic_router
from gateway.api.capabilities import ReportCache, check_on_load
from gateway.api.errors import install_error_handlers
from gateway.api.guards import Drain, Guards, Policy, is_loopback_bind
from gateway.api.health import router as health_router
from gateway.api.ollama.adapter import OLLAMA
from gateway.api.ollama.manage import router as ollama_manage_router
from gateway.api.ollama.routes import router as ollama_router
from gateway.api.openai.adapters import OPENAI, RESPONSES
from gateway.api.openai.chat import ChatService
from gateway.api.openai.completions import CompletionService
from gateway.api.openai.embeddings import EmbeddingService
from gateway.api.openai.protocol import ChatCompletionChunk
from gateway.api.openai.responses_routes import router as responses_router
from gateway.api.openai.responses_schema import ResponseStreamEvent
from gateway.api.routes import openapi_schema, router
from gateway.host.functional_check import CheckResult, run_isolated
from gateway.host.hardware import HostCapabilities, probe_host, vulkan_visible_env
from gateway.metrics import Metrics
from gateway.models.pool import Checker, ClusterEngines, EngineFactory, ModelManager
from gateway.models.registry import Registry, load_registry
from gateway.parity.shadow import ShadowParity
from gateway.settings import Settings
from gateway.store import ResponseStore
from gateway.web import install as install_web

log = logging.getLogger(__name__)


def create_app(
    settings: Settings,
    registry: Registry | None = None,
    engine_factory: EngineFactory | None = None,
    host: HostCapabilities | None = None,
    checker: Checker | None = None,
    cluster: ClusterEngines | None = None,
) -> FastAPI:
    """The app. `host` defaults to probing this machine; `checker` to the isolated
    functional check when engines come from the real registry (a test's fake factory runs
    only the in-process check). `cluster` gives the engines of models served by a Ray cluster
    (gateway.cluster)."""
    load_plugins(settings.plugins)
    registry = registry or load_registry(settings.config)
    if settings.model:
        if registry.get(settings.model) is None:
            raise ValueError(f"unknown model {settings.model!r}; models.yaml defines {sorted(registry.models)}")
        registry.default = registry.get(settings.model).id  # type: ignore[union-attr]  # an alias names its model
    metrics = Metrics(queue_limit_s=settings.max_queue_wait)
    host = host if host is not None else probe_host()
    # A worker process is itself the isolation the child-process check gives an in-process engine.
    if checker is None and engine_factory is None and settings.isolate_check and not settings.workers:
        env = vulkan_visible_env(host.vulkan)

        def checker(runtime: str, config: EngineConfig) -> CheckResult:
            return run_isolated(runtime, config, settings.check_timeout, env)

    manager = ModelManager(registry, settings, engine_factory, metrics, host, checker, cluster)
    admission = Admission(settings.max_queue, settings.max_queue_wait)
    drain = Drain()

    def resident() -> list[tuple[str, str, str, EngineHealth]]:
        # Requests queued in the gateway wait too.
        return [
            (e.spec.id, f"{e.candidate.runtime}/{e.candidate.backend}", e.candidate.device,
             dataclasses.replace(h := e.engine.health(), waiting=h.waiting + admission.waiting(e.spec.id)))
            for e in manager.loaded()
        ]

    metrics.watch(resident)

    def workers() -> list[tuple[str, str, str, dict[str, Any]]]:
        out = []
        for e in manager.loaded():
            if isinstance(e.engine, Supervised) and e.candidate.format not in ("remote", "ray"):
                seen = e.engine.report()
                if seen.kind == "worker":
                    out.append((e.spec.id, e.candidate.label, e.candidate.device, seen.detail))
        return out

    metrics.watch_workers(workers)

    shadow = ShadowParity(manager, settings, metrics) if settings.parity_reference and settings.parity_sample > 0 else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        preload: asyncio.Task[None] | None = None
        if settings.engine != "auto" or settings.runtime or settings.device:
            # An explicit choice that cannot work fails the start, never a silent CPU run.
            spec = registry.get(registry.default)
            assert spec is not None
            try:
                await manager.get(spec)
            except Exception as exc:
                app.state.startup_error = str(exc)
                log.error("cannot serve %s as asked: %s", spec.id, exc)
                raise
            app.state.preloading = False
        elif settings.preload:
            preload = asyncio.create_task(_preload(app, manager))
        if shadow is not None:
            shadow.start()
        try:
            yield
        finally:
            if preload is not None and not preload.done():
                preload.cancel()
            admission.close("the server is shutting down")
            if shadow is not None:
                await shadow.close()
            await manager.close()
            if app.state.responses_store is not None:
                app.state.responses_store.close()

    app = FastAPI(title="llm-gateway", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.manager = manager
    app.state.metrics = metrics
    app.state.shadow = shadow
    on_complete = shadow.offer if shadow is not None else None
    app.state.admission = admission
    app.state.drain = drain
    app.state.chat = ChatService(manager, metrics, admission, drain, on_complete)
    app.state.checks = ReportCache.of(registry.cache_dir)
    if settings.check_models:
        manager.on_loaded.append(check_on_load(app.state.chat, app.state.checks))
    app.state.completions = CompletionService(manager, metrics, admission, drain, on_complete)
    app.state.embeddings = EmbeddingService(manager, metrics)
    app.state.started = int(time.time())
    app.state.preload = settings.preload
    app.state.preloading = settings.preload
    app.state.startup_error = None
    app.state.responses_store = (ResponseStore(Path(settings.responses_db or Path(registry.cache_dir) / "responses.sqlite3"),
                                               settings.responses_max, settings.responses_max_age_days * 86400)
                                 if settings.responses_store else None)
    app.state.protocols = protocols = Protocols(OPENAI, RESPONSES, ANTHROPIC, OLLAMA)
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(health_router)
    app.include_router(responses_router)
    app.include_router(anthropic_router)
    app.include_router(ollama_router)
    app.include_router(ollama_manage_router)
    install_web(app, resident)
    app.openapi = lambda: openapi_schema(app, (ChatCompletionChunk, ResponseStreamEvent, MessageStreamEvent))  # type: ignore[method-assign]

    # Behind Ray Serve's proxy (a cluster ingress) the proxy answers with the request's id itself.
    the_policy = dataclasses.replace(policy(settings), send_request_id=cluster is None)
    app.add_middleware(Guards, policy=the_policy, drain=drain, metrics=metrics, protocols=protocols)
    return app


def policy(settings: Settings) -> Policy:
    """The HTTP policy from settings, with a warning wherever it is open."""
    keys = settings.api_keys()
    loopback = is_loopback_bind(settings.host)
    if not keys and not loopback:
        log.warning("listening on %s without an API key: anyone who can reach this address can use it "
                    "(set --api-key or --api-key-file)", settings.host)
    if "*" in settings.allowed_origins:
        log.warning("--allowed-origins '*': any web page a user opens can call this gateway")
    if keys:
        log.info("API key required on /v1 (%d key(s)); /health is open%s", len(keys),
                 "; /metrics needs the metrics key" if settings.metrics_api_key else " and so is /metrics")
    return Policy(
        api_keys=keys,
        metrics_keys=(settings.metrics_api_key,) if settings.metrics_api_key else (),
        allowed_origins=tuple(o.rstrip("/") for o in settings.allowed_origins),
        allowed_hosts=tuple(h.lower() for h in settings.allowed_hosts),
        # A server bound to loopback is reachable only from this machine, so a Host header that
        # names something else means a browser was pointed here through DNS rebinding.
        check_host=loopback or bool(settings.allowed_hosts),
        max_body=settings.max_body,
    )


async def _preload(app: FastAPI, manager: ModelManager) -> None:
    spec = manager.registry.get(manager.registry.default)
    assert spec is not None
    try:
        await manager.get(spec)
    except Exception as exc:  # noqa: BLE001 - reported in /health and the log
        log.error("default model %s failed to load: %s", spec.id, exc)
    finally:
        app.state.preloading = False
