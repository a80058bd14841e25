"""One model's engine on one node of a Ray cluster: the body of a Serve replica.

The replica chooses and loads its engine the way a single-host gateway does (the node's own device
probe, functional check, fallback to the next candidate, the engine in a supervised worker process),
so a CUDA node, a Vulkan node and a CPU-only node each serve with what they have.  Streams go back
over Serve's streaming handles: the first item says which replica and node serve the request, the
rest are token events; an engine error travels as a wire `Error` so the ingress raises the same
exception a local engine would.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from engines.base import EngineError, GenerationRequest
from engines.worker import wire
from gateway.metrics import Metrics
from gateway.models.pool import Loaded, ModelManager
from gateway.models.registry import Registry, RegistryFile, _default_cache
from gateway.settings import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaTag:
    """Where a request runs: sent first on every stream."""

    replica: str
    node: str  # "IP/first 8 of the node id": readable, and unique when several nodes share a host
    node_id: str


@dataclass(frozen=True)
class Failed:
    """An engine error, as the wire protocol carries it."""

    error: wire.Error

    def exception(self) -> EngineError:
        return wire.error_from(self.error)


def _where() -> ReplicaTag:
    try:
        import ray
        from ray import serve

        replica = serve.get_replica_context().replica_id.unique_id
        node_id = ray.get_runtime_context().get_node_id()
        node = f"{ray.util.get_node_ip_address()}/{node_id[:8]}"  # type: ignore[no-untyped-call, unused-ignore]
    except Exception:  # noqa: BLE001 - outside Serve (unit tests): name the process instead
        replica, node_id, node = f"pid{os.getpid()}", "", socket.gethostname()
    return ReplicaTag(replica, node, node_id)


class ModelReplica:
    """A Serve replica of one model (made a deployment in `gateway.cluster.app`)."""

    # Ray Serve awaits an async constructor (the engine loads in it).
    async def __init__(self, model_id: str, registry_file: RegistryFile, base_dir: str,  # type: ignore[misc]
                       settings: Settings) -> None:
        cache = Path(registry_file.cache_dir).expanduser() if registry_file.cache_dir else _default_cache()
        registry = Registry(registry_file, Path(base_dir), cache)
        spec = registry.get(model_id)
        if spec is None:
            raise ValueError(f"unknown model {model_id!r}")
        self.spec = spec
        self.tag = _where()
        self.manager = ModelManager(registry, settings, metrics=Metrics())
        loaded = await self.manager.get(spec)
        self.served = 0
        self.cancelled = 0
        log.info("replica %s on %s serves %s on %s (%s)", self.tag.replica, self.tag.node, model_id,
                 loaded.candidate.label, loaded.candidate.device)

    async def _loaded(self) -> Loaded:
        # Through the manager each time: an engine that fell back (crashes, parity) is replaced here.
        return await self.manager.get(self.spec)

    async def describe(self) -> dict[str, Any]:
        loaded = await self._loaded()
        info, h = loaded.engine.info, loaded.engine.health()
        return {
            "replica": self.tag.replica, "node": self.tag.node, "node_id": self.tag.node_id,
            "runtime": info.runtime, "backend": info.backend, "device": info.device, "version": info.version,
            "context_length": info.context_length, "parallel": info.parallel, "extra": dict(info.extra),
            "template": info.template, "capabilities": info.capabilities,
            "ready": h.ready, "running": h.running, "waiting": h.waiting, "served": self.served,
            "cancelled": self.cancelled, "fallback_reason": loaded.fallback_reason,
        }

    async def generate(self, request: GenerationRequest, affinity: str | None = None) -> AsyncIterator[Any]:
        """ReplicaTag, then lists of TokenEvents (or one Failed).  `affinity` is read by the router."""
        del affinity
        yield self.tag
        self.served += 1
        stream = (await self._loaded()).engine.generate(request)
        finished = False
        try:
            async for event in stream:
                yield [event]
                finished = event.finish_reason is not None
        except EngineError as exc:
            finished = True
            yield Failed(wire.error_message(0, exc))
        finally:
            if not finished:
                self.cancelled += 1  # the client went away (Serve cancelled this generator)
            await stream.aclose()  # type: ignore[attr-defined]

    async def tokenize(self, text: str) -> list[int] | Failed:
        try:
            return await (await self._loaded()).engine.tokenize(text)
        except EngineError as exc:
            return Failed(wire.error_message(0, exc))

    async def logits(self, token_ids: list[int]) -> npt.NDArray[np.float32] | Failed:
        try:
            return await (await self._loaded()).engine.logits(token_ids)
        except EngineError as exc:
            return Failed(wire.error_message(0, exc))

    async def embed(self, inputs: list[list[int]]) -> npt.NDArray[np.float32] | Failed:
        try:
            return await (await self._loaded()).engine.embed(inputs)
        except EngineError as exc:
            return Failed(wire.error_message(0, exc))

    async def check_health(self) -> None:
        """Serve's periodic health check: a replica whose engine cannot serve is replaced."""
        h = (await self._loaded()).engine.health()
        if not h.ready:
            raise RuntimeError(f"engine not ready: {h.detail}")

    async def __del__(self) -> None:
        await self.manager.close()


__all__ = ["Failed", "ModelReplica", "ReplicaTag"]
