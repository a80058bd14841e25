"""Every Prometheus metric the gateway exports, defined once.

Definitions follow vLLM's benchmark semantics, measured in the gateway:
- TTFT: request received -> first token sent;
- ITL: each gap between consecutive tokens of one choice;
- TPOT: (e2e - TTFT) / (output tokens - 1), per request with at least two output tokens;
- e2e: request received -> last token sent.
Labels are bounded: `model` is a configured model id (never client text), `engine` is
runtime/backend, `device` the device name.  SLO thresholds shipped in deploy/prometheus
(TTFT 0.5 s, TPOT 0.05 s = 20 tok/s, e2e 10 s) sit exactly on bucket edges.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engines.base import EngineHealth, TokenEvent

LABELS = ("model", "engine", "device")

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
QUEUE_BUCKETS = (0.0, 0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
KL_BUCKETS = (0.0, 1e-6, 1e-5, 1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0)
AGREEMENT_BUCKETS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 1.0)
LENGTH_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)

# SLO thresholds, shared with deploy/prometheus/rules.yml.
SLO_TTFT_S = 0.5
SLO_TPOT_S = 0.05
SLO_E2E_S = 10.0


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None, queue_limit_s: float | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        # The admission queue's time limit is a bucket edge, so "nobody accepted waited longer than
        # --max-queue-wait" can be read off the histogram.
        admission_buckets = tuple(sorted(set(QUEUE_BUCKETS) | ({queue_limit_s} if queue_limit_s else set())))
        self.admission_wait = Histogram("gateway_admission_wait_seconds", "Time an accepted request waited in the gateway's queue for its slots.", ("model",), buckets=admission_buckets, registry=r)
        self.ttft = Histogram("gateway_time_to_first_token_seconds", "Request received to first token sent.", LABELS, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("gateway_inter_token_latency_seconds", "Gap between consecutive tokens of one choice.", LABELS, buckets=TOKEN_GAP_BUCKETS, registry=r)
        self.tpot = Histogram("gateway_time_per_output_token_seconds", "(e2e - TTFT) / (output tokens - 1) per request.", LABELS, buckets=TOKEN_GAP_BUCKETS, registry=r)
        self.e2e = Histogram("gateway_e2e_request_latency_seconds", "Request received to last token sent.", LABELS, buckets=E2E_BUCKETS, registry=r)
        self.queue = Histogram("gateway_queue_wait_seconds", "Time waiting for a free sequence before prefill.", LABELS, buckets=QUEUE_BUCKETS, registry=r)
        self.prompt_len = Histogram("gateway_request_prompt_tokens", "Prompt length per request.", LABELS, buckets=LENGTH_BUCKETS, registry=r)
        self.gen_len = Histogram("gateway_request_generation_tokens", "Generated tokens per request.", LABELS, buckets=LENGTH_BUCKETS, registry=r)
        self.prompt_tokens = Counter("gateway_prompt_tokens", "Prompt tokens processed.", LABELS, registry=r)
        self.gen_tokens = Counter("gateway_generation_tokens", "Tokens generated.", LABELS, registry=r)
        self.draft_tokens = Counter("gateway_speculative_draft_tokens", "Speculative draft tokens verified, by outcome (accepted, rejected).", (*LABELS, "outcome"), registry=r)
        self.requests = Counter("gateway_requests", "Finished requests by outcome (finish reason or error code) and HTTP status.", (*LABELS, "outcome", "status"), registry=r)
        self.fallbacks = Counter("gateway_fallbacks", "Engine candidates skipped, by reason.", ("model", "engine", "reason"), registry=r)
        self.worker_crashes = Counter("gateway_worker_crashes", "Engine worker processes that died or hung (each is restarted or, past the limit, falls back).", LABELS, registry=r)
        self.failovers = Counter("gateway_failovers", "Streams whose engine died mid-generation, by what happened: restarted (continued on the restarted worker), next_engine (on another engine), gave_up (budget, time or an engine that cannot resume).", ("model", "reason"), registry=r)
        self.failover_pause = Histogram("gateway_failover_pause_seconds", "The gap a client saw between the last token before its engine died and the first after the failover.", ("model",), buckets=(0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0), registry=r)
        self.memory_misses = Counter("gateway_memory_estimate_misses", "Loaded models whose worker measured more than 15% over their memory estimate (the budget then uses the measured memory).", ("model",), registry=r)
        self.loads = Counter("gateway_engine_loads", "Engine load attempts.", (*LABELS, "result"), registry=r)
        self.build = Info("gateway_engine_build", "Engine build of each loaded model.", ("model",), registry=r)
        # Shadow parity: finished requests re-scored against a reference engine (labels: the serving engine).
        self.parity_kl = Histogram("gateway_parity_kl", "Mean KL(reference || serving engine) per re-scored request, nats.", LABELS, buckets=KL_BUCKETS, registry=r)
        self.parity_top1 = Histogram("gateway_parity_top1_agreement", "Share of positions where both engines' argmax agree, per re-scored request.", LABELS, buckets=AGREEMENT_BUCKETS, registry=r)
        self.parity_scored = Counter("gateway_parity_samples_scored", "Requests re-scored on the reference engine.", LABELS, registry=r)
        self.parity_dropped = Counter("gateway_parity_samples_dropped", "Sampled requests not scored, by reason (queue_full, error).", (*LABELS, "reason"), registry=r)
        self.parity_drifted = Gauge("gateway_parity_drifted", "1 while the engine's window of samples is outside its parity tolerance.", LABELS, registry=r)
        self._replica: ReplicaMetrics | None = None

    @property
    def replica(self) -> ReplicaMetrics:
        """Per-replica series of a Ray cluster's models (`gateway serve --cluster ray`), made on first use."""
        if self._replica is None:
            self._replica = ReplicaMetrics(self.registry)
        return self._replica

    def watch(self, resident: Callable[[], Iterable[tuple[str, str, str, EngineHealth]]]) -> None:
        """Export running/waiting/resident gauges read from the engines at scrape time."""
        self.registry.register(_EngineGauges(resident))

    def watch_workers(self, workers: Callable[[], Iterable[tuple[str, str, str, dict[str, Any]]]]) -> None:
        """Export each local engine worker's memory and restarts, read at scrape time from
        (model, engine, device, the worker's report)."""
        self.registry.register(_WorkerGauges(workers))

    def observe(self, model: str, engine: str, device: str, received: float) -> RequestObserver:
        return RequestObserver(self, (model, engine, device), received)

    def count_error(self, labels: tuple[str, str, str], outcome: str, status: int) -> None:
        self.requests.labels(*labels, outcome, str(status)).inc()


class _WorkerGauges(Collector):
    def __init__(self, workers: Callable[[], Iterable[tuple[str, str, str, dict[str, Any]]]]) -> None:
        self._workers = workers

    def collect(self) -> Iterable[Metric]:
        rss = GaugeMetricFamily("gateway_worker_resident_memory_bytes", "Resident memory of each local engine worker process.", labels=LABELS)
        restarts = GaugeMetricFamily("gateway_worker_restarts", "Restarts of each engine worker since its model loaded.", labels=LABELS)
        for model, engine, device, status in self._workers():
            if status.get("rss_bytes") is not None:
                rss.add_metric([model, engine, device], status["rss_bytes"])
            restarts.add_metric([model, engine, device], status.get("restarts", 0))
        yield rss
        yield restarts


REPLICA_LABELS = ("model", "replica", "node")


class ReplicaMetrics:
    """Where requests ran on a Ray cluster: `replica` is Serve's replica id, `node` its node's address."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.requests = Counter("gateway_replica_requests", "Finished requests per replica, by finish reason.", (*REPLICA_LABELS, "outcome"), registry=r)
        self.ttft = Histogram("gateway_replica_time_to_first_token_seconds", "Request sent to the deployment to first token back, per replica.", REPLICA_LABELS, buckets=TTFT_BUCKETS, registry=r)
        self.tokens = Counter("gateway_replica_generation_tokens", "Tokens generated per replica.", REPLICA_LABELS, registry=r)
        self.prompt_tokens = Counter("gateway_replica_prompt_tokens", "Prompt tokens per replica.", REPLICA_LABELS, registry=r)
        self.cached_tokens = Counter("gateway_replica_cached_prompt_tokens", "Prompt tokens found in the replica's KV cache (prefix reuse).", REPLICA_LABELS, registry=r)
        self.lost = Counter("gateway_replica_lost_requests", "Requests whose replica was lost (node died, process killed), by whether they were retried.", (*REPLICA_LABELS, "retried"), registry=r)
        self._running: list[Callable[[], Iterable[tuple[str, str, str, int]]]] = []
        r.register(_ReplicaGauges(self._running))

    def watch(self, running: Callable[[], Iterable[tuple[str, str, str, int]]]) -> None:
        """Export the running requests per replica read at scrape time: (model, replica, node, running)."""
        self._running.append(running)


class _ReplicaGauges(Collector):
    def __init__(self, sources: list[Callable[[], Iterable[tuple[str, str, str, int]]]]) -> None:
        self._sources = sources

    def collect(self) -> Iterable[Metric]:
        running = GaugeMetricFamily("gateway_replica_requests_running", "Requests running on each replica.", labels=REPLICA_LABELS)
        for source in self._sources:
            for model, replica, node, n in source():
                running.add_metric([model, replica, node], n)
        yield running


class _EngineGauges(Collector):
    def __init__(self, resident: Callable[[], Iterable[tuple[str, str, str, EngineHealth]]]) -> None:
        self._resident = resident

    def collect(self) -> Iterable[Metric]:
        running = GaugeMetricFamily("gateway_requests_running", "Requests generating now.", labels=LABELS)
        waiting = GaugeMetricFamily("gateway_requests_waiting", "Requests waiting for a free sequence.", labels=LABELS)
        # The engines' host-memory prefix caches (llama.cpp): counters since the engine's process started.
        pc: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "hits": CounterMetricFamily("gateway_prefix_cache_hits", "Requests whose prompt prefix was restored from the host-memory prefix cache.", labels=LABELS),
            "misses": CounterMetricFamily("gateway_prefix_cache_misses", "Requests that looked in the host-memory prefix cache and found no prefix worth restoring.", labels=LABELS),
            "restored_tokens": CounterMetricFamily("gateway_prefix_cache_restored_tokens", "Prompt tokens restored from the host-memory prefix cache instead of prefilled.", labels=LABELS),
            "saved": CounterMetricFamily("gateway_prefix_cache_saves", "Sequence states saved to the host-memory prefix cache.", labels=LABELS),
            "skipped_saves": CounterMetricFamily("gateway_prefix_cache_skipped_saves", "Sequence states not saved: prefilling them again is quicker than the copy, or under 50 ms.", labels=LABELS),
            "checkpoints": CounterMetricFamily("gateway_prefix_cache_checkpoints", "States saved mid-prompt at the end of a shared prefix a sliding window kept others from serving.", labels=LABELS),
            "evictions": CounterMetricFamily("gateway_prefix_cache_evictions", "Entries dropped from the host-memory prefix cache to stay within its bound.", labels=LABELS),
            "bytes": GaugeMetricFamily("gateway_prefix_cache_bytes", "Host memory held by the prefix cache.", labels=LABELS),
            "limit_bytes": GaugeMetricFamily("gateway_prefix_cache_limit_bytes", "The prefix cache's bound.", labels=LABELS),
            "entries": GaugeMetricFamily("gateway_prefix_cache_entries", "Sequence states held by the prefix cache.", labels=LABELS),
            "allocations": CounterMetricFamily("gateway_prefix_cache_allocations", "Page-locked host memory allocations for the prefix cache (its arena, at load).", labels=LABELS),
            "allocation_seconds": CounterMetricFamily("gateway_prefix_cache_allocation_seconds", "Time spent allocating page-locked host memory for the prefix cache.", labels=LABELS),
            "pinned": GaugeMetricFamily("gateway_prefix_cache_pinned", "1 if the prefix cache is in the device's page-locked host memory (DMA copies).", labels=LABELS),
            "save_bytes_per_s": GaugeMetricFamily("gateway_prefix_cache_save_bytes_per_second", "Measured copy rate of a sequence state to the host cache (moving average).", labels=LABELS),
            "restore_bytes_per_s": GaugeMetricFamily("gateway_prefix_cache_restore_bytes_per_second", "Measured copy rate of a cached state back into a sequence (moving average).", labels=LABELS),
            "unpinned": CounterMetricFamily("gateway_prefix_cache_unpinned", "States that found no free page-locked range and were kept in pageable memory.", labels=LABELS),
        }
        # The engines' KV caches (llama.cpp): cells, what sequences hold, what a shared cache did.
        kv: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "cells": GaugeMetricFamily("gateway_kv_cells", "The KV cache's cells (tokens), every sequence's together.", labels=LABELS),
            "used": GaugeMetricFamily("gateway_kv_cells_used", "KV cells the sequences hold, running and idle.", labels=LABELS),
            "idle": GaugeMetricFamily("gateway_kv_cells_idle", "KV cells idle sequences hold (finished requests' KV, kept for a next turn).", labels=LABELS),
            "preemptions": CounterMetricFamily("gateway_kv_preemptions", "Requests paused because the KV cache their model's sequences share was full (resumed when there was room).", labels=LABELS),
            "idle_evictions": CounterMetricFamily("gateway_kv_idle_evictions", "Idle sequences' KV moved out of a shared KV cache (to the host prefix cache when worth the copy) because it outgrew the running requests' own and had cost their passes 8x what moving it costs.", labels=LABELS),
            "prefix_copies": CounterMetricFamily("gateway_kv_prefix_copies", "Prompts whose prefix was copied from another sequence's KV instead of prefilled.", labels=LABELS),
            "prefix_follows": CounterMetricFamily("gateway_kv_prefix_follows", "Prompts that waited for another request's running prefill of their prefix and copied it (requests started together with one prefix).", labels=LABELS),
            "long_prompts_beside": CounterMetricFamily("gateway_kv_long_prompts_beside", "Long prompts prefilled and decoded in the engine's second context beside the running requests (GATEWAY_LONG_PROMPT_TOKENS).", labels=LABELS),
        }
        count = 0
        for model, engine, device, h in self._resident():
            running.add_metric([model, engine, device], h.running)
            waiting.add_metric([model, engine, device], h.waiting)
            for families, stats in ((pc, h.prefix_cache), (kv, h.kv)):
                if stats is not None:
                    for name, family in families.items():
                        family.add_metric([model, engine, device], float(getattr(stats, name)))
            count += 1
        yield running
        yield waiting
        yield from pc.values()
        yield from kv.values()
        yield GaugeMetricFamily("gateway_models_resident", "Models loaded now.", value=count)


@dataclass
class RequestObserver:
    """Timing of one request, recorded once when it ends."""

    metrics: Metrics
    labels: tuple[str, str, str]
    received: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    last_by_choice: dict[int, float] = field(default_factory=dict)
    prompt_tokens: int = 0
    done: bool = False
    admission_wait: float = 0.0  # seconds waited in the gateway's queue before the engine saw it
    _itl: Any = None  # the labelled ITL child, looked up once: this runs for every token

    def on_event(self, choice: int, ev: TokenEvent, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        n = len(ev.token_ids)
        if n:
            if self.first is None:
                self.first = now
                self.metrics.ttft.labels(*self.labels).observe(now - self.received)
            prev = self.last_by_choice.get(choice)
            if prev is not None:
                if self._itl is None:
                    self._itl = self.metrics.itl.labels(*self.labels)
                self._itl.observe(now - prev)
            self.last_by_choice[choice] = now
            self.last = now
            self.tokens += n
        if ev.usage is not None:
            if not self.prompt_tokens:
                self.prompt_tokens = ev.usage.prompt_tokens
                self.metrics.queue.labels(*self.labels).observe(ev.usage.queue_seconds + self.admission_wait)
            if ev.usage.draft_tokens:
                accepted = ev.usage.accepted_draft_tokens
                self.metrics.draft_tokens.labels(*self.labels, "accepted").inc(accepted)
                self.metrics.draft_tokens.labels(*self.labels, "rejected").inc(ev.usage.draft_tokens - accepted)

    def finish(self, outcome: str, status: int = 200) -> None:
        if self.done:
            return
        self.done = True
        m, lb = self.metrics, self.labels
        m.requests.labels(*lb, outcome, str(status)).inc()
        if self.first is None or self.last is None:
            return
        m.e2e.labels(*lb).observe(self.last - self.received)
        if self.tokens > 1:
            m.tpot.labels(*lb).observe((self.last - self.first) / (self.tokens - 1))
        m.prompt_len.labels(*lb).observe(self.prompt_tokens)
        m.gen_len.labels(*lb).observe(self.tokens)
        m.prompt_tokens.labels(*lb).inc(self.prompt_tokens)
        m.gen_tokens.labels(*lb).inc(self.tokens)
