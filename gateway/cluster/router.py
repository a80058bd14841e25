"""Serve request router with conversation affinity.

A conversation's follow-up turns repeat its earlier turns, so the replica that served the first
turn still holds that prefix in its KV cache.  The ingress sends each request with `affinity`, a
hash of the conversation's start (the system prompt and the first user turn, see
`gateway.models.routing.affinity_key`); this router ranks that conversation's replica first and
every other replica second, so Serve takes the remembered one while it has room and otherwise the
least-loaded of the rest (Serve probes queue lengths within a rank and picks the shortest).  A
remembered replica whose queue is longer than another's by more than SLACK is not preferred: the
prefill its KV saves is smaller than the wait.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

ENTRIES = 4096  # conversations remembered (least recently used forgotten first)
SLACK = 1  # requests more in the conversation's replica's queue than in the shortest other one


class AffinityRouter(RequestRouter):  # type: ignore[misc, unused-ignore]
    def initialize_state(self, **kwargs: Any) -> None:
        self._affinity: OrderedDict[str, ReplicaID] = OrderedDict()
        self.hits = 0
        self.misses = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        key = _key(pending_request)
        if key is None:
            return [candidate_replicas]
        mine = self._affinity.get(key)
        first = [r for r in candidate_replicas if r.replica_id == mine]
        if mine is None or not first:
            return [candidate_replicas]
        others = [r for r in candidate_replicas if r.replica_id != mine]
        # Its KV saves a prefill, but not a wait behind a longer queue: keep the conversation's
        # replica only while its (cached) queue is no longer than the shortest other one + SLACK.
        own = self._replica_queue_len_cache.get(mine)
        rest = [q for r in others if (q := self._replica_queue_len_cache.get(r.replica_id)) is not None]
        if own is not None and rest and own > min(rest) + SLACK:
            return [candidate_replicas]
        return [first, others]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        key = _key(pending_request)
        if key is None:
            return
        if key in self._affinity:
            if self._affinity[key] == replica_id:
                self.hits += 1
            else:
                self.misses += 1
        self._affinity[key] = replica_id
        self._affinity.move_to_end(key)
        while len(self._affinity) > ENTRIES:
            self._affinity.popitem(last=False)


def _key(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None:
        return None
    key = pending_request.kwargs.get("affinity")
    return key if isinstance(key, str) else None
