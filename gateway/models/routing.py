"""Several workers of one model behind one `Engine`: least-loaded first, with prefix affinity.

A conversation's follow-up turns repeat its earlier turns, so the worker that served the first
turn still holds that prefix in its KV cache (llama.cpp reuses the longest common prefix): sending
the next turn there skips most of the prefill.  The affinity key is the conversation's start — the
system prompt and the first user turn — which every later turn of it shares.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt

from engines.base import (
    Engine,
    EngineCrashed,
    EngineError,
    EngineHealth,
    EngineInfo,
    GenerationRequest,
    KvStats,
    ModelLoadError,
    PrefixCacheStats,
    Supervised,
    SupervisorReport,
    TokenEvent,
)

log = logging.getLogger(__name__)
AFFINITY_ENTRIES = 4096  # conversations remembered (least recently used forgotten first)
PROMPT_KEY_CHARS = 512  # raw prompts: the key is this much of the start


def affinity_key(request: GenerationRequest) -> str | None:
    """What the request shares with the other turns of its conversation (None: nothing to keep)."""
    text = request.affinity or (request.prompt or "")[:PROMPT_KEY_CHARS]
    if not text:
        return None
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


class WorkerGroup:
    """The workers of one model as one engine."""

    def __init__(self, members: list[Engine]) -> None:
        if not members:
            raise ValueError("a worker group needs at least one worker")
        self.members = members
        self.info = self._info(members[0])
        self._affinity: OrderedDict[str, Engine] = OrderedDict()
        self.affinity_hits = 0
        self.affinity_misses = 0
        self.served: dict[int, int] = {}  # member index -> requests routed to it
        # Member index -> this group's requests on it now, counted when picked: a member's own count
        # (its health) may lag the pick (a worker's stream registers on its connection's loop), and
        # a burst picked within that lag would all land on the same "idle" worker.
        self.routing: dict[int, int] = {}

    async def load(self) -> None:
        results = await asyncio.gather(*(m.load() for m in self.members), return_exceptions=True)
        failed = [(m, r) for m, r in zip(self.members, results, strict=True) if isinstance(r, BaseException)]
        for m, r in failed:
            log.warning("%s is not available: %s", getattr(getattr(m, "connection", None), "what", "a worker"), r)
        if len(failed) == len(self.members):
            raise ModelLoadError("no worker could be reached: " + "; ".join(str(r) for _, r in failed))
        self.info = self._info(next(m for m, r in zip(self.members, results, strict=True)
                                     if not isinstance(r, BaseException)))

    def _info(self, first: Engine) -> EngineInfo:
        """The group as one engine: the (first reachable) worker's engine, with every worker's sequences."""
        i = first.info
        return replace(i, parallel=sum(m.info.parallel for m in self.members), extra=dict(i.extra))

    def pick(self, key: str | None) -> Engine:
        """The worker for a request: its conversation's worker while that one has room (or is no busier
        than the least-loaded one), else the least-loaded worker."""
        live = [m for m in self.members if m.health().ready]
        if not live:
            raise EngineCrashed("no worker of this model is reachable now")
        best = min(live, key=self._load)
        if key is not None:
            mine = self._affinity.get(key)
            if mine is not None and mine in live and (self._load(mine) < mine.info.parallel
                                                      or self._load(mine) <= self._load(best)):
                best = mine
                self.affinity_hits += 1
            elif mine is not None:
                self.affinity_misses += 1
            self._affinity[key] = best
            self._affinity.move_to_end(key)
            while len(self._affinity) > AFFINITY_ENTRIES:
                self._affinity.popitem(last=False)
        index = self.members.index(best)
        self.served[index] = self.served.get(index, 0) + 1
        return best

    def _load(self, member: Engine) -> int:
        """Requests on a member: those this group has sent it, or what it reports if more."""
        h = member.health()
        return max(self.routing.get(self.members.index(member), 0), h.running + h.waiting)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        engine = self.pick(affinity_key(request))
        index = self.members.index(engine)
        self.routing[index] = self.routing.get(index, 0) + 1
        try:
            stream = engine.generate(request)
            try:
                async for event in stream:
                    yield event
            finally:
                await stream.aclose()  # type: ignore[attr-defined]
        finally:
            self.routing[index] -= 1

    async def tokenize(self, text: str) -> list[int]:
        return await self.pick(None).tokenize(text)

    async def logits(self, token_ids: list[int], images: tuple[bytes, ...] = ()) -> npt.NDArray[np.float32]:
        return await self.pick(None).logits(token_ids, images)

    async def embed(self, inputs: list[list[int]]) -> npt.NDArray[np.float32]:
        return await self.pick(None).embed(inputs)

    def health(self) -> EngineHealth:
        hs = [m.health() for m in self.members]
        ready = [h for h in hs if h.ready]
        detail = "" if len(ready) == len(hs) else f"{len(ready)} of {len(hs)} workers ready"
        caches = [h.prefix_cache for h in hs if h.prefix_cache is not None]
        total = PrefixCacheStats.combine(caches) if caches else None
        kvs = [h.kv for h in hs if h.kv is not None]
        return EngineHealth(ready=bool(ready), detail=detail, running=sum(h.running for h in hs),
                            waiting=sum(h.waiting for h in hs), busy_seconds=max((h.busy_seconds for h in hs), default=0.0),
                            prefix_cache=total, kv=KvStats.combine(kvs) if kvs else None)

    def report(self) -> SupervisorReport:
        members, rss = [], 0
        for i, m in enumerate(self.members):
            entry: dict[str, Any] = {}
            if isinstance(m, Supervised):
                seen = m.report()
                entry, rss = dict(seen.detail), rss + seen.rss_bytes
            entry.update(ready=m.health().ready, routed=self.served.get(i, 0))
            members.append(entry)
        detail = {"workers": members, "affinity_hits": self.affinity_hits, "affinity_misses": self.affinity_misses}
        return SupervisorReport("worker", detail, rss)

    def trust(self) -> None:
        for m in self.members:
            if isinstance(m, Supervised):
                m.trust()

    def retry_after(self) -> int:
        """The soonest any worker serves again."""
        waits = [m.retry_after() if isinstance(m, Supervised) else 0 for m in self.members]
        return min(waits, default=0)

    async def back(self) -> bool:
        """The group serves while any worker does: it answers as soon as one is back."""
        if any(m.health().ready for m in self.members):
            return True
        waits = [asyncio.ensure_future(m.back()) for m in self.members if isinstance(m, Supervised)]
        if not waits:
            return False
        try:
            for done in asyncio.as_completed(waits):
                if await done:
                    return True
            return False
        finally:
            for w in waits:
                w.cancel()

    async def close(self) -> None:
        results = await asyncio.gather(*(m.close() for m in self.members), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, EngineError):
                log.warning("closing a worker failed: %s", r)
