"""A model's Serve deployment as one `Engine` in the ingress.

Streams come from a streaming deployment handle; closing one early (the client went away) cancels
the replica's generator, which aborts the sequence in its engine.  A replica lost mid-stream (its
node died, its process was killed) ends the stream with `EngineCrashed`, which the API turns into an
`engine_failed` SSE frame and `[DONE]`, or a 502; a request lost before its first token is sent
again (Serve routes it to a live replica).  Where each request ran is counted per replica and node.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from engines.base import (
    EngineCrashed,
    EngineError,
    EngineHealth,
    EngineInfo,
    GenerationRequest,
    ModelLoadError,
    SupervisorReport,
    TokenEvent,
)
from gateway.cluster.replica import Failed, ReplicaTag
from gateway.metrics import Metrics, ReplicaMetrics
from gateway.models.routing import affinity_key

log = logging.getLogger(__name__)

RETRIES_BEFORE_FIRST_TOKEN = 2  # a request whose replica was lost before it produced anything


def _is_lost_replica(exc: BaseException) -> bool:
    """Ray's ways of saying the replica (or its node) is gone."""
    from ray import exceptions as rx

    return isinstance(exc, rx.RayActorError | rx.ActorUnavailableError | rx.NodeDiedError
                      | rx.WorkerCrashedError | rx.ObjectLostError | rx.OwnerDiedError)


@dataclass
class ReplicaView:
    """What the ingress has seen of one replica."""

    replica: str
    node: str
    served: int = 0
    running: int = 0
    lost: int = 0
    last_seen: float = field(default_factory=time.monotonic)


class ServeEngine:
    """Every replica of one model behind one engine (the handle's router picks the replica)."""

    def __init__(self, handle: Any, model_id: str, slots: int, metrics: Metrics | None = None) -> None:
        self.handle = handle
        self.model_id = model_id
        self.slots = slots  # sequences the whole deployment runs at most (max replicas x parallel)
        self.metrics: ReplicaMetrics | None = metrics.replica if metrics is not None else None
        if self.metrics is not None:
            self.metrics.watch(lambda: [(model_id, v.replica, v.node, v.running) for v in self.replicas.values()])
        self.info = EngineInfo("ray", "serve", f"{model_id} deployment", parallel=slots)
        self.replicas: dict[str, ReplicaView] = {}
        self.deployment: dict[str, Any] = {}  # Serve's view: status, replica states (refreshed)
        self._running = 0
        self._waiting = 0
        self._ready = False
        self._refresh: asyncio.Task[None] | None = None

    async def load(self) -> None:
        """Wait for a replica (a scale-from-zero deployment starts one) and take its engine's info."""
        try:
            d = await self.handle.describe.remote()
        except Exception as exc:  # noqa: BLE001 - any Ray failure means the model cannot load
            raise ModelLoadError(f"no replica of {self.model_id} could start: {exc}") from exc
        self.info = EngineInfo(d["runtime"], d["backend"], d["device"], d["version"], d["context_length"],
                               self.slots, template=d["template"], capabilities=d["capabilities"],
                               extra={**d["extra"], "cluster": "ray"})
        self._see(ReplicaTag(d["replica"], d["node"], d["node_id"]))
        self._ready = True
        if self._refresh is None:
            self._refresh = asyncio.create_task(self._watch_deployment())

    async def _watch_deployment(self, every_s: float = 2.0) -> None:
        """Keep Serve's view of the deployment (status, replicas by state) for health and /health."""
        from ray import serve

        from gateway.cluster.app import INGRESS_APP, deployment_name

        name = deployment_name(self.model_id)
        while True:
            try:
                status = await asyncio.to_thread(serve.status)
                app = status.applications.get(INGRESS_APP)
                d = app.deployments.get(name) if app is not None else None
                if d is not None:
                    self.deployment = {"status": _name(d.status), "message": d.message,
                                       "replicas": {_name(k): v for k, v in d.replica_states.items()}}
            except Exception as exc:  # noqa: BLE001 - the controller may be restarting; keep the last view
                log.warning("cannot read the deployment's status from Serve: %s", _first_line(exc))
            await asyncio.sleep(every_s)

    def _see(self, tag: ReplicaTag) -> ReplicaView:
        view = self.replicas.get(tag.replica)
        if view is None:
            view = self.replicas[tag.replica] = ReplicaView(tag.replica, tag.node)
        view.last_seen = time.monotonic()
        return view

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        key = affinity_key(request)
        self._waiting += 1
        started = False
        try:
            for attempt in range(RETRIES_BEFORE_FIRST_TOKEN + 1):
                sent = time.perf_counter()
                stream = self.handle.options(stream=True).generate.remote(request, affinity=key)
                view: ReplicaView | None = None
                produced = False
                done = False
                try:
                    async for item in stream:
                        if isinstance(item, ReplicaTag):
                            view = self._see(item)
                            view.served += 1
                            view.running += 1
                            continue
                        if isinstance(item, Failed):
                            done = True
                            raise item.exception()
                        if not started:
                            if self.metrics is not None and view is not None:
                                self.metrics.ttft.labels(self.model_id, view.replica, view.node).observe(
                                    time.perf_counter() - sent)
                            started = True
                            self._waiting -= 1
                            self._running += 1
                        produced = True
                        for event in item:
                            self._observe(view, event)
                            yield event
                            done = event.finish_reason is not None
                    return
                except EngineError:
                    raise
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - sorted below: a lost replica, or Ray failing
                    retry = _is_lost_replica(exc) and not produced and attempt < RETRIES_BEFORE_FIRST_TOKEN
                    if view is not None:
                        view.lost += 1
                        if self.metrics is not None:
                            self.metrics.lost.labels(self.model_id, view.replica, view.node, str(retry).lower()).inc()
                    where = f"replica {view.replica} on {view.node}" if view is not None else "its replica"
                    if retry:
                        log.warning("%s: %s was lost before the first token; sending it again: %s",
                                    self.model_id, where, _first_line(exc))
                        continue
                    raise EngineCrashed(f"{where} of {self.model_id} failed mid-request: {_first_line(exc)}") from None
                finally:
                    if view is not None:
                        view.running -= 1
                    if not done:
                        stream.cancel()  # the client went away or the stream failed: stop the replica's work
        finally:
            if started:
                self._running -= 1
            else:
                self._waiting -= 1

    def _observe(self, view: ReplicaView | None, event: TokenEvent) -> None:
        if self.metrics is None or view is None:
            return
        labels = (self.model_id, view.replica, view.node)
        if event.token_ids:
            self.metrics.tokens.labels(*labels).inc(len(event.token_ids))
        if event.usage is not None:
            self.metrics.prompt_tokens.labels(*labels).inc(event.usage.prompt_tokens)
            self.metrics.cached_tokens.labels(*labels).inc(event.usage.cached_tokens)
        if event.finish_reason is not None:
            self.metrics.requests.labels(*labels, event.finish_reason).inc()

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            result = await getattr(self.handle, method).remote(*args)
        except EngineError:
            raise
        except Exception as exc:  # noqa: BLE001 - a lost replica or Ray failing
            raise EngineCrashed(f"{method} on {self.model_id} failed: {_first_line(exc)}") from None
        if isinstance(result, Failed):
            raise result.exception()
        return result

    async def tokenize(self, text: str) -> list[int]:
        ids: list[int] = await self._call("tokenize", text)
        return ids

    async def logits(self, token_ids: list[int], images: tuple[bytes, ...] = ()) -> npt.NDArray[np.float32]:
        out: npt.NDArray[np.float32] = await self._call("logits", token_ids, images)
        return out

    async def embed(self, inputs: list[list[int]]) -> npt.NDArray[np.float32]:
        out: npt.NDArray[np.float32] = await self._call("embed", inputs)
        return out

    def health(self) -> EngineHealth:
        status = self.deployment.get("status", "")
        ready = self._ready and status not in ("UNHEALTHY", "DEPLOY_FAILED")
        return EngineHealth(ready=ready, detail=self.deployment.get("message", ""), running=self._running,
                            waiting=self._waiting)

    def report(self) -> SupervisorReport:
        """For /health: Serve's view of the deployment and what this ingress saw of each replica."""
        return SupervisorReport("cluster", {
            "deployment": self.deployment,
            "replicas": {r: {"node": v.node, "served": v.served, "running": v.running, "lost": v.lost}
                         for r, v in self.replicas.items()},
        })

    def trust(self) -> None:
        """Serve restarts its replicas itself."""

    def retry_after(self) -> int:
        return 0 if self._ready else 1

    async def back(self) -> bool:
        """Serve replaces a lost replica on its own schedule: nothing to wait for here."""
        return False

    async def close(self) -> None:
        self._ready = False  # the deployment's replicas live on; Serve owns them
        if self._refresh is not None:
            self._refresh.cancel()
            self._refresh = None


def _name(value: Any) -> str:
    """An enum member's value, or the string Serve already gave."""
    return str(getattr(value, "value", value))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]
