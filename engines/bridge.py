"""Bridging blocking runtimes to asyncio: thread-to-loop channels and a bounded worker pool.

Native runtimes block, so they run on worker threads; results travel back to the event loop
through `EventChannel` (a stream of token events) or `settle_from_thread` (one result).
Shared by every adapter so cancellation, overload and shutdown behave the same everywhere.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from engines.base import EngineClosed, EngineError, EngineFailure, EngineHealth, EngineOverloaded, TokenEvent

log = logging.getLogger(__name__)

T = TypeVar("T")


class _Mailbox:
    """Items posted from worker threads to one event loop, delivered in batches.

    `call_soon_threadsafe` writes to the loop's self-pipe on every call; a batching scheduler
    emits one event per running sequence per step, so waking the loop once per batch instead of
    once per token saves a syscall and a loop iteration per token (visible at 16 streams on a GPU).
    """

    _by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox] = weakref.WeakKeyDictionary()
    _registry_lock = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: deque[tuple[asyncio.Queue[TokenEvent | BaseException], TokenEvent | BaseException]] = deque()
        self._lock = threading.Lock()
        self._scheduled = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _Mailbox:
        with cls._registry_lock:
            box = cls._by_loop.get(loop)
            if box is None:
                box = cls._by_loop[loop] = cls(loop)
            return box

    def post(self, queue: asyncio.Queue[TokenEvent | BaseException], item: TokenEvent | BaseException) -> None:
        with self._lock:
            self._items.append((queue, item))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            with self._lock:
                self._scheduled = False
                self._items.clear()

    def _flush(self) -> None:
        with self._lock:
            items, self._items = self._items, deque()
            self._scheduled = False
        for queue, item in items:
            queue.put_nowait(item)


class EventChannel:
    """Token events produced on a worker thread, consumed by one async iterator on the loop."""

    def __init__(self) -> None:
        self._mailbox = _Mailbox.of(asyncio.get_running_loop())
        self._queue: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()

    def emit(self, item: TokenEvent | BaseException) -> None:
        """Thread-safe: hand an event (or the exception that ends the stream) to the loop."""
        self._mailbox.post(self._queue, item)

    async def events(self) -> AsyncIterator[TokenEvent]:
        """Yield events until the one with a finish_reason; an emitted exception is raised."""
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return


def settle_from_thread(fut: asyncio.Future[T]) -> Callable[[T | BaseException], None]:
    """A callback, safe to call from any thread, that resolves `fut` with a value or exception."""
    loop = fut.get_loop()

    def done(item: T | BaseException) -> None:
        def settle() -> None:
            if fut.done():
                return
            if isinstance(item, BaseException):
                fut.set_exception(item)
            else:
                fut.set_result(item)

        loop.call_soon_threadsafe(settle)

    return done


@dataclass(eq=False)
class Job(Generic[T]):
    """Work for a `WorkerPool`.  `run` polls `cancelled` at its step boundaries."""

    run: Callable[[Job[T]], None]
    fail: Callable[[BaseException], None]  # told why the job will never run (or was cut short)
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None
    cancelled: bool = False
    closing: bool = False  # set with `cancelled` when the pool shuts down under the job

    @property
    def queue_seconds(self) -> float:
        return (self.started or time.perf_counter()) - self.submitted


class WorkerPool:
    """`workers` threads running jobs; at most `max_queue` wait, beyond that EngineOverloaded."""

    def __init__(self, workers: int, max_queue: int, name: str) -> None:
        self._max_queue = max_queue
        self._waiting: deque[Job[object]] = deque()
        self._running: set[Job[object]] = set()
        self._cv = threading.Condition()
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(max(1, workers))
        ]
        for t in self._threads:
            t.start()

    def submit(self, job: Job[T]) -> None:
        with self._cv:
            if self._stopping:
                raise EngineClosed("the engine is shutting down")
            if len(self._waiting) >= self._max_queue:
                raise EngineOverloaded(
                    f"all {len(self._threads)} workers are busy and {len(self._waiting)} "
                    "requests are already waiting; retry later"
                )
            self._waiting.append(job)  # type: ignore[arg-type]
            self._cv.notify()

    def cancel(self, job: Job[T]) -> None:
        with self._cv:
            job.cancelled = True
            try:
                self._waiting.remove(job)  # type: ignore[arg-type]
            except ValueError:
                pass

    def counts(self) -> tuple[int, int]:
        """(running, waiting)."""
        with self._cv:
            return len(self._running), len(self._waiting)

    def close(self) -> None:
        """Refuse new jobs, fail the waiting ones, stop the running ones and join the threads."""
        with self._cv:
            self._stopping = True
            waiting, self._waiting = list(self._waiting), deque()
            for job in self._running:
                job.cancelled = job.closing = True
            self._cv.notify_all()
        for job in waiting:
            job.fail(EngineClosed("the model was unloaded"))
        for t in self._threads:
            t.join()

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._waiting:
                    self._cv.wait()
                if self._stopping:
                    return
                job = self._waiting.popleft()
                job.started = time.perf_counter()
                self._running.add(job)
            try:
                job.run(job)
            except Exception as exc:  # noqa: BLE001 - a failed job must not kill its worker
                log.exception("engine job failed")
                job.fail(exc if isinstance(exc, EngineError) else EngineFailure(f"the runtime failed: {exc}"))
            finally:
                with self._cv:
                    self._running.discard(job)


async def stream_job(pool: WorkerPool, run: Callable[[Job[None], EventChannel], None]) -> AsyncIterator[TokenEvent]:
    """Run `run(job, channel)` on `pool` and yield what it emits; closing the iterator cancels it."""
    channel = EventChannel()
    job: Job[None] = Job(run=lambda j: run(j, channel), fail=channel.emit)
    pool.submit(job)
    try:
        async for item in channel.events():
            yield item
    finally:
        pool.cancel(job)


async def call_job(pool: WorkerPool, compute: Callable[[], T]) -> T:
    """Run `compute()` on `pool` and return its result (or raise its exception)."""
    fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
    done = settle_from_thread(fut)
    job: Job[None] = Job(run=lambda _j: done(compute()), fail=done)
    pool.submit(job)
    try:
        return await fut
    finally:
        pool.cancel(job)


def pool_health(pool: WorkerPool | None) -> EngineHealth:
    """An engine's health from its worker pool (None: not loaded)."""
    if pool is None:
        return EngineHealth(ready=False, detail="not loaded")
    running, waiting = pool.counts()
    return EngineHealth(ready=True, running=running, waiting=waiting)

