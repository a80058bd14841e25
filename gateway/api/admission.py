"""Admission control: per model, running slots plus a queue bounded in length and in time.

A request that would wait longer than `max_wait` is refused at once with 429 and a `Retry-After`
computed from the live drain rate, instead of being left to a client time-out; one that was
admitted but still has no slot when `max_wait` runs out is refused the same way, so no accepted
request ever waits longer than `max_wait`. The engine behind a gate only ever sees as many
generations as it has sequence slots.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass


class Rejected(Exception):
    """No slot now or within the allowed wait; `retry_after` is a whole number of seconds ≥ 1."""

    def __init__(self, message: str, retry_after: int, code: str) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.code = code


class GateClosed(Exception):
    """The gate stopped admitting (the server is shutting down)."""


@dataclass
class _Waiter:
    future: asyncio.Future[None]
    n: int


# Weight of the newest hold time in the moving average of seconds a request holds its slots.
_EWMA_ALPHA = 0.2


class Gate:
    """Slots and a FIFO queue for one model. Used from the event loop only."""

    def __init__(self, slots: int, max_queue: int, max_wait: float) -> None:
        self.slots = max(1, slots)
        self.free = self.slots
        self.max_queue = max_queue
        self.max_wait = max_wait
        self._waiters: deque[_Waiter] = deque()
        self.hold_s: float | None = None  # moving average of how long a request holds its slots
        self._closed: str | None = None

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def running(self) -> int:
        return self.slots - self.free

    def seconds_per_request(self) -> float | None:
        """How often a slot frees up while all are busy: the live drain rate, inverted."""
        return None if self.hold_s is None else self.hold_s / self.slots

    def estimated_wait(self, ahead: int) -> float | None:
        """Seconds until a request with `ahead` requests in front of it gets a slot."""
        spr = self.seconds_per_request()
        return None if spr is None else (ahead + 1) * spr

    def _retry_after(self, seconds: float | None) -> int:
        return max(1, math.ceil(seconds)) if seconds is not None else 1

    async def acquire(self, n: int = 1) -> float:
        """Wait for `n` slots (at most all of them); returns the seconds waited."""
        if self._closed is not None:
            raise GateClosed(self._closed)
        n = min(max(1, n), self.slots)
        if not self._waiters and self.free >= n:
            self.free -= n
            return 0.0
        ahead = len(self._waiters)
        if ahead >= self.max_queue:
            raise Rejected(
                f"all {self.slots} slots are busy and {ahead} requests are waiting (the queue's limit); retry later",
                self._retry_after(self.seconds_per_request()), "queue_full",
            )
        est = self.estimated_wait(ahead)
        if est is not None and est > self.max_wait:
            raise Rejected(
                f"all {self.slots} slots are busy and {ahead} requests are waiting: the estimated wait of "
                f"{est:.1f}s exceeds the limit of {self.max_wait:g}s; retry later",
                self._retry_after(est - self.max_wait), "queue_wait_exceeded",
            )
        t0 = time.monotonic()
        waiter = _Waiter(asyncio.get_running_loop().create_future(), n)
        self._waiters.append(waiter)
        try:
            await asyncio.wait({waiter.future}, timeout=self.max_wait)
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise
        if not waiter.future.done():
            self._abandon(waiter)
            raise Rejected(
                f"no slot became free within the queue's limit of {self.max_wait:g}s; retry later",
                self._retry_after(self.estimated_wait(len(self._waiters))), "queue_wait_exceeded",
            )
        waiter.future.result()  # GateClosed while waiting
        return time.monotonic() - t0

    def _abandon(self, waiter: _Waiter) -> None:
        if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
            self.release(waiter.n)  # the slots were handed over just as the waiter left
            return
        waiter.future.cancel()
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass
        self._wake()

    def release(self, n: int, held_s: float | None = None) -> None:
        """Give back `n` slots; `held_s`, how long they were held, feeds the drain-rate estimate."""
        n = min(max(1, n), self.slots)
        if held_s is not None:
            self.hold_s = held_s if self.hold_s is None else (1 - _EWMA_ALPHA) * self.hold_s + _EWMA_ALPHA * held_s
        self.free = min(self.slots, self.free + n)
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.free >= self._waiters[0].n:
            w = self._waiters.popleft()
            if w.future.done():
                continue
            self.free -= w.n
            w.future.set_result(None)

    def close(self, reason: str) -> None:
        """Refuse new requests and end every queued one with GateClosed(reason)."""
        self._closed = reason
        while self._waiters:
            w = self._waiters.popleft()
            if not w.future.done():
                w.future.set_exception(GateClosed(reason))


class Ticket:
    """Slots held by one request; `release()` is idempotent."""

    def __init__(self, gate: Gate, n: int, waited_s: float) -> None:
        self.gate = gate
        self.n = n
        self.waited_s = waited_s
        self._t0 = time.monotonic()
        self._released = False
        self._paused: dict[str, float] = {}  # seconds each choice waited for its engine to come back

    def paused(self, choice: str, seconds: float) -> None:
        """A choice waited `seconds` for a restarted engine: that gap is not serving speed, so the
        drain-rate estimate leaves it out."""
        self._paused[choice] = self._paused.get(choice, 0.0) + seconds

    def release(self) -> None:
        if not self._released:
            self._released = True
            held = time.monotonic() - self._t0 - max(self._paused.values(), default=0.0)
            self.gate.release(self.n, max(0.0, held))


class Admission:
    """One gate per model id."""

    def __init__(self, max_queue: int, max_wait: float) -> None:
        self.max_queue = max_queue
        self.max_wait = max_wait
        self._gates: dict[str, Gate] = {}
        self._closed: str | None = None

    def gate(self, model: str, slots: int) -> Gate:
        g = self._gates.get(model)
        if g is None or (g.slots != max(1, slots) and g.running == 0 and g.waiting == 0):
            g = self._gates[model] = Gate(slots, self.max_queue, self.max_wait)
            if self._closed is not None:
                g.close(self._closed)
        return g

    async def admit(self, model: str, slots: int, n: int) -> Ticket:
        g = self.gate(model, slots)
        waited = await g.acquire(n)
        return Ticket(g, min(max(1, n), g.slots), waited)

    def gates(self) -> dict[str, Gate]:
        return dict(self._gates)

    def waiting(self, model: str) -> int:
        """Requests of `model` queued in the gateway (the engine's own queue is not counted)."""
        g = self._gates.get(model)
        return g.waiting if g is not None else 0

    def close(self, reason: str) -> None:
        self._closed = reason
        for g in self._gates.values():
            g.close(reason)
