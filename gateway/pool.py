"""Resident models: loaded on first use, at most N kept (least recently used unloaded first)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from engines.base import Engine, EngineConfig, EngineError, ModelLoadError, ModelNotAvailable
from engines.registry import create_engine
from gateway.metrics import Metrics
from gateway.registry import ModelSpec, ModelUnavailable, Registry
from gateway.selection import Candidate, plan
from gateway.settings import Settings

log = logging.getLogger(__name__)

EngineFactory = Callable[[str, EngineConfig], Engine]


@dataclass
class Loaded:
    spec: ModelSpec
    engine: Engine
    candidate: Candidate
    load_seconds: float
    last_used: float


class ModelManager:
    """Owns every loaded engine.  Safe to call from many requests at once."""

    def __init__(
        self,
        registry: Registry,
        settings: Settings,
        factory: EngineFactory = create_engine,
        metrics: Metrics | None = None,
    ) -> None:
        self.registry = registry
        self.settings = settings
        self._factory = factory
        self.metrics = metrics or Metrics()
        self._loaded: OrderedDict[str, Loaded] = OrderedDict()
        self._locks: dict[str, asyncio.Lock] = {}
        self.loading: set[str] = set()
        self.load_errors: dict[str, str] = {}

    def is_loaded(self, model_id: str) -> bool:
        return model_id in self._loaded

    def loaded(self) -> list[Loaded]:
        return list(self._loaded.values())

    async def get(self, spec: ModelSpec) -> Loaded:
        entry = self._loaded.get(spec.id)
        if entry is None:
            lock = self._locks.setdefault(spec.id, asyncio.Lock())
            async with lock:
                entry = self._loaded.get(spec.id)
                if entry is None:
                    entry = await self._load(spec)
        self._loaded.move_to_end(spec.id)
        entry.last_used = time.monotonic()
        return entry

    async def _load(self, spec: ModelSpec) -> Loaded:
        self.loading.add(spec.id)
        try:
            candidates = plan(spec, self.settings.engine)
            await self._make_room()
            errors = []
            for cand in candidates:
                t0 = time.perf_counter()
                try:
                    path = await asyncio.to_thread(self.registry.resolve, spec, cand.format)
                except ModelUnavailable as exc:
                    raise ModelNotAvailable(str(exc)) from exc
                engine = self._factory(cand.runtime, self._config(spec, cand, str(path)))
                labels = (spec.id, f"{cand.runtime}/{cand.backend}", cand.device)
                try:
                    await engine.load()
                except EngineError as exc:
                    self.metrics.loads.labels(*labels, "failed").inc()
                    self.metrics.fallbacks.labels(spec.id, labels[1], "load_failed").inc()
                    errors.append(f"{cand.runtime}/{cand.backend}: {exc}")
                    log.warning("loading %s on %s/%s failed: %s", spec.id, cand.runtime, cand.backend, exc)
                    continue
                dt = time.perf_counter() - t0
                self.metrics.loads.labels(*labels, "ok").inc()
                info = engine.info
                self.metrics.build.labels(spec.id).info(
                    {"runtime": info.runtime, "version": info.version, "backend": info.backend, "device": info.device}
                )
                log.info("loaded %s on %s/%s (%s) in %.2fs", spec.id, cand.runtime, cand.backend, cand.device, dt)
                entry = Loaded(spec, engine, cand, dt, time.monotonic())
                self._loaded[spec.id] = entry
                self.load_errors.pop(spec.id, None)
                return entry
            raise ModelLoadError(f"model {spec.id!r} could not be loaded: " + "; ".join(errors))
        except EngineError as exc:
            self.load_errors[spec.id] = str(exc)
            raise
        finally:
            self.loading.discard(spec.id)

    def _config(self, spec: ModelSpec, cand: Candidate, path: str) -> EngineConfig:
        s = self.settings
        return EngineConfig(
            model_path=path,
            context_length=spec.context_length,
            parallel=s.parallel or spec.parallel or 4,
            n_threads=s.threads,
            max_queue=s.max_queue,
            backend=cand.backend,
            device=cand.device,
            chat_template=spec.chat_template,
            compute_units=spec.compute_units,
        )

    async def _make_room(self) -> None:
        """Unload least recently used idle models until one more fits."""
        while len(self._loaded) >= max(1, self.settings.max_resident):
            victim = next(
                (k for k, v in self._loaded.items() if _idle(v.engine)), None
            )
            if victim is None:
                log.warning("all %d resident models are busy; loading one more", len(self._loaded))
                return
            entry = self._loaded.pop(victim)
            log.info("unloading %s (least recently used)", victim)
            await entry.engine.close()

    async def close(self) -> None:
        while self._loaded:
            _, entry = self._loaded.popitem()
            await entry.engine.close()


def _idle(engine: Engine) -> bool:
    h = engine.health()
    return h.running == 0 and h.waiting == 0
