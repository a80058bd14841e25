"""Shadow parity: re-score a sample of served requests on a reference engine, off the hot path.

A finished request is offered with its prompt and generated token ids; with probability `sample`
it goes into a bounded queue (dropped and counted when full, so serving never waits).  One
background task teacher-forces each sample through the reference engine (loaded lazily, one per
model) and the engine that served it, compares the distributions with `gateway.parity.compare`, exports
the numbers as Prometheus metrics, and judges a rolling window per (model, engine) against the
model's parity tolerance.  A drifting engine is reported in `/health` and, with `enforce`, taken
out of selection so the model manager falls back to the next candidate.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from engines.base import Engine
from gateway.metrics import Metrics
from gateway.models.pool import Loaded, ModelManager
from gateway.models.registry import ParityTolerance
from gateway.parity.compare import (
    PositionStats,
    Scores,
    compare_logits,
    open_engine,
    precision_class,
    tolerance_for,
)
from gateway.settings import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShadowSample:
    """One served request to re-score."""

    loaded: Loaded
    prompt_ids: tuple[int, ...]  # an image's positions hold its stand-ins (engines/llamacpp/vision.py)
    output_ids: tuple[int, ...]
    images: tuple[bytes, ...] = ()

    @property
    def labels(self) -> tuple[str, str, str]:
        c = self.loaded.candidate
        return (self.loaded.spec.id, f"{c.runtime}/{c.backend}", c.device)


@dataclass
class DriftWindow:
    """The last `size` samples of one (model, engine), judged together."""

    size: int
    tolerance: ParityTolerance
    stats: deque[PositionStats] = field(default_factory=deque)
    scored: int = 0
    reasons: list[str] = field(default_factory=list)

    def add(self, s: PositionStats) -> list[str]:
        """Add one sample; return the window's violations once it is full (else none)."""
        self.stats.append(s)
        self.scored += 1
        while len(self.stats) > self.size:
            self.stats.popleft()
        full = len(self.stats) >= self.size
        self.reasons = Scores.of(list(self.stats)).violations(self.tolerance) if full else []
        return self.reasons

    def summary(self) -> dict[str, Any]:
        s = Scores.of(list(self.stats))
        return {
            "scored": self.scored, "window": len(self.stats), "window_size": self.size,
            "mean_kl": s.mean_kl, "max_kl": s.max_kl, "top1": s.top1,
            "drifted": bool(self.reasons), "reason": "; ".join(self.reasons) or None,
        }


class ShadowParity:
    """The sampler, queue, background scorer and drift windows of shadow parity."""

    def __init__(
        self, manager: ModelManager, settings: Settings, metrics: Metrics, rng: random.Random | None = None
    ) -> None:
        if not settings.parity_reference:
            raise ValueError("shadow parity needs a reference engine")
        self.manager = manager
        self.settings = settings
        self.reference = settings.parity_reference
        self.metrics = metrics
        self._rng = rng or random.Random()
        self.queue: asyncio.Queue[ShadowSample] = asyncio.Queue(maxsize=max(1, settings.parity_queue))
        self.windows: dict[tuple[str, str, str], DriftWindow] = {}
        self._refs: dict[str, Engine] = {}
        self._ref_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    # --- the serving side: must never block or raise --------------------------------------

    def offer(self, loaded: Loaded, prompt_ids: tuple[int, ...], output_ids: tuple[int, ...],
              images: tuple[bytes, ...] = ()) -> bool:
        """Maybe enqueue a finished request; True when it was queued."""
        if self._rng.random() >= self.settings.parity_sample:
            return False
        sample = ShadowSample(loaded, prompt_ids, output_ids, images)
        try:
            self.queue.put_nowait(sample)
        except asyncio.QueueFull:
            self.metrics.parity_dropped.labels(*sample.labels, "queue_full").inc()
            return False
        return True

    # --- the background side --------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="shadow-parity")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for engine in self._refs.values():
            await engine.close()
        self._refs.clear()

    async def _run(self) -> None:
        while True:
            sample = await self.queue.get()
            try:
                await self.score(sample)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - one bad sample must not stop the scorer
                log.warning("shadow parity could not score a %s sample: %s", sample.labels[0], exc)
                self.metrics.parity_dropped.labels(*sample.labels, "error").inc()

    async def _reference_engine(self, loaded: Loaded) -> Engine:
        spec = loaded.spec
        async with self._ref_lock:
            engine = self._refs.get(spec.id)
            if engine is None:
                # One sequence is enough: the scorer sends one sample at a time.
                settings = self.settings.model_copy(update={"parallel": 1})
                engine = await open_engine(spec, self.manager.registry, settings, self.reference, host=self.manager.host)
                self._refs[spec.id] = engine
                log.info("shadow parity: reference %s loaded for %s", self.reference, spec.id)
            return engine

    async def score(self, sample: ShadowSample) -> PositionStats:
        """Re-score one sample on both engines, export it, and judge its window."""
        ref = await self._reference_engine(sample.loaded)
        serving = sample.loaded.engine
        seq = list(sample.prompt_ids + sample.output_ids)
        with_images = {"images": sample.images} if sample.images else {}  # both re-feed the prompt's images
        ref_logits, cand_logits = await asyncio.gather(ref.logits(seq, **with_images), serving.logits(seq, **with_images))
        rows = slice(len(sample.prompt_ids) - 1, len(seq) - 1)
        stats = compare_logits(ref_logits[rows], cand_logits[rows], sample.output_ids)
        scores = Scores.of([stats])
        labels = sample.labels
        self.metrics.parity_kl.labels(*labels).observe(scores.mean_kl)
        self.metrics.parity_top1.labels(*labels).observe(scores.top1)
        self.metrics.parity_scored.labels(*labels).inc()
        window = self.windows.get(labels)
        if window is None:
            precision = precision_class(
                ref.info.extra.get("precision", "unknown"), serving.info.extra.get("precision", "unknown")
            )
            tol = tolerance_for(ref.info.backend, serving.info.backend, precision, sample.loaded.spec.parity)
            window = self.windows[labels] = DriftWindow(max(1, self.settings.parity_window), tol)
        reasons = window.add(stats)
        self.metrics.parity_drifted.labels(*labels).set(1 if reasons else 0)
        if reasons:
            why = f"parity drift against {self.reference} over {len(window.stats)} samples: " + "; ".join(reasons)
            log.warning("%s on %s: %s", labels[0], labels[1], why)
            if self.settings.parity_enforce:
                self.manager.exclude(labels[0], sample.loaded.candidate, why)
        return stats

    def status(self) -> dict[str, Any]:
        """The `parity` section of /health."""
        return {
            "reference": self.reference,
            "sample": self.settings.parity_sample,
            "enforce": self.settings.parity_enforce,
            "queued": self.queue.qsize(),
            "engines": [
                {"model": m, "engine": e, "device": d, **w.summary()} for (m, e, d), w in self.windows.items()
            ],
            "excluded": {
                m: {f"{r}/{b}": why for (r, b), why in ex.items()} for m, ex in self.manager.excluded.items()
            },
        }
