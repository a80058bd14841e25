"""The gateway's side of an engine worker: an `Engine` whose work runs in another process
(reached through engines/worker/connections.py).

`WorkerEngine` implements the engine interface over the wire protocol, so serving code does not
know whether an engine is in-process, in a local worker or on another host.  It also supervises:

- a worker that exits, is killed by a signal (segfault, OOM killer) or closes its connection is
  noticed at once (the socket ends); one that stops answering heartbeats, or whose engine step has
  run past a limit, is killed by the watchdog;
- streams that already produced tokens end with `EngineCrashed`; requests that had not started yet
  are sent again to the restarted worker;
- restarts back off; after `max_crashes` within `crash_window_s` the engine gives up, fails what is
  left and calls `on_failed(reason)` so its owner can fall back to another candidate — unless
  `can_fall_back()` says there is none: then it never stops, restarting with back-off capped at
  `max_backoff_s` and reporting itself degraded;
- a SIGKILL from outside (the OOM killer, an operator) is no defect of the engine: the worker is
  restarted, and the crash is shown but not counted toward giving up;
- on probation (before its functional check passed) a crash fails the check at once: no restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from engines.base import (
    POISON_CRASHES,
    EngineClosed,
    EngineCrashed,
    EngineError,
    EngineHealth,
    EngineInfo,
    GenerationRequest,
    InvalidGenerationRequest,
    SupervisorReport,
    TokenEvent,
)
from engines.worker import wire
from engines.worker.connections import (
    Connection,
    LocalWorker,
    Supervision,
    rss_bytes,
)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Pending:
    """A request sent to the worker (or waiting to be, while it restarts)."""

    message: Callable[[int], wire._Msg]  # the frame to (re)send, given the request id
    queue: asyncio.Queue[TokenEvent | BaseException] | None = None  # streams
    future: asyncio.Future[Any] | None = None  # calls
    started: bool = False  # a stream that produced an event cannot be retried
    sent: bool = False
    frame: bytes = b""
    crashes: int = 0  # worker crashes while it was in flight: at POISON_CRASHES it is not resent


class WorkerEngine:
    """An engine in a worker process, behind the `Engine` interface, supervised."""

    def __init__(self, connection: Connection, info: EngineInfo, supervision: Supervision | None = None,
                 on_failed: Callable[[str], None] | None = None, on_crash: Callable[[str], None] | None = None,
                 can_fall_back: Callable[[], bool] | None = None, probation: bool = False) -> None:
        self.connection = connection
        self.info = info
        self.supervision = supervision or Supervision()
        self.on_failed = on_failed
        self.on_crash = on_crash
        self.can_fall_back = can_fall_back
        self.probation = probation  # until trust(): a crash fails the check instead of restarting
        self.failed: str | None = None  # why this engine gave up (None while it serves)
        self.degraded: str | None = None  # kept serving past max_crashes (nothing to fall back to): why
        self.crashes: list[tuple[float, str]] = []  # (monotonic time, reason), every loss of the worker
        self._strikes: list[float] = []  # the crashes that count toward giving up (not outside SIGKILLs)
        self._next_restart = 0.0  # monotonic time of the restart being waited for
        self.restarts = 0
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._connected = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._reader_task: asyncio.Task[None] | None = None
        self._last_pong = 0.0
        self._pong: wire.Pong | None = None
        self._closed = False
        self.pid: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop that owns the connection

    # --- lifecycle -----------------------------------------------------------------------

    async def load(self) -> None:
        await self._connect()

    async def _connect(self) -> None:
        self._loop = asyncio.get_running_loop()
        reader, writer, ready = await self.connection.open()
        self.info = ready.info
        self.pid = ready.pid
        self._writer = writer
        self._last_pong = time.monotonic()
        self._pong = None
        self._reader_task = self._spawn(self._read(reader))
        self._spawn(self._watch(writer))
        self._connected.set()
        for p in list(self._pending.values()):  # sent again after a restart
            if not p.sent:
                self._send(p)

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        self._closed = True
        writer, self._writer = self._writer, None
        self._connected.clear()
        if writer is not None and not writer.is_closing():
            with contextlib.suppress(ConnectionError, RuntimeError):
                writer.write(wire.frame(wire.Shutdown()))
                await writer.drain()
            writer.close()
        self._fail_pending(EngineClosed("the model was unloaded"), everything=True)
        if isinstance(self.connection, LocalWorker):
            await self.connection.drop_spare()
        if isinstance(self.connection, LocalWorker) and self.connection.process is not None:
            try:
                await asyncio.wait_for(self.connection.process.wait(), 10.0)
            except TimeoutError:
                log.warning("worker %s did not exit within 10 s of shutdown; killing it", self.pid)
                self.connection.kill()
                await self.connection.process.wait()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def trust(self) -> None:
        """The functional check passed: from now on crashes restart the worker (or hand over to
        its warm standby, which is loaded now)."""
        self.probation = False
        if isinstance(self.connection, LocalWorker):
            self.connection.keep_spare()

    def health(self) -> EngineHealth:
        if self.failed:
            return EngineHealth(ready=False, detail=self.failed)
        outstanding = sum(1 for p in self._pending.values() if p.queue is not None)
        running = min(outstanding, max(1, self.info.parallel))
        busy = self._pong.busy_seconds if self._pong and outstanding else 0.0
        detail = ""
        if not self._connected.is_set():
            wait = max(0.0, self._next_restart - time.monotonic())
            detail = f"restarting (next try in {wait:.0f} s)" if wait >= 1 else "restarting"
            if self.crashes:
                detail += f" after: {self.crashes[-1][1]}"
        return EngineHealth(ready=self._connected.is_set(), detail=detail,
                            running=running, waiting=outstanding - running, busy_seconds=busy,
                            prefix_cache=self._pong.prefix_cache if self._pong is not None else None,
                            kv=self._pong.kv if self._pong is not None else None)

    def retry_after(self) -> int:
        """Seconds until the worker should be back (for Retry-After while it restarts)."""
        return max(1, int(self._next_restart - time.monotonic() + 1)) if not self._connected.is_set() else 0

    def report(self) -> SupervisorReport:
        """For /health: where the worker runs, its pid and memory, and its crashes."""
        out: dict[str, Any] = {"where": self.connection.what, "pid": self.pid, "restarts": self.restarts,
                               "crashes": len(self.crashes), "counted_crashes": len(self._strikes)}
        if self.crashes:
            out["last_crash"] = self.crashes[-1][1]
        if self.degraded:
            out["degraded"] = self.degraded
        rss = 0
        if isinstance(self.connection, LocalWorker) and self.pid is not None:
            out["rss_bytes"] = rss_bytes(self.pid)
            rss += out["rss_bytes"] or 0
        if isinstance(self.connection, LocalWorker) and self.connection.standby:
            spare = self.connection.spare_pid()
            out["standby"] = {"pid": spare, "rss_bytes": rss_bytes(spare) if spare else None,
                              "ready": spare is not None}
            rss += out["standby"]["rss_bytes"] or 0
        return SupervisorReport("worker", out, rss)

    # --- the engine interface ------------------------------------------------------------

    def _foreign(self) -> bool:
        """Called from another event loop than the connection's (e.g. a test's loop, the server's in a thread)."""
        return self._loop is not None and asyncio.get_running_loop() is not self._loop

    async def back(self) -> bool:
        """Returns once a worker serves (at once while one does): a stream that lost its worker
        waits here for the restart, and not for the replay of the tokens it had already sent."""
        if self._foreign():
            assert self._loop is not None
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._connected.wait(), self._loop))
        else:
            await self._connected.wait()
        return True

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        stream = self._generate_foreign(request) if self._foreign() else self._generate(request)
        try:
            async for event in stream:
                yield event
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async def _generate_foreign(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """The stream of another loop's request, run on the connection's loop and handed across."""
        assert self._loop is not None
        mine = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent | BaseException | None] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for event in self._generate(request):
                    mine.call_soon_threadsafe(queue.put_nowait, event)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                mine.call_soon_threadsafe(queue.put_nowait, exc)
                return
            mine.call_soon_threadsafe(queue.put_nowait, None)

        fut = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            fut.cancel()

    async def _generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        queue: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        rid = self._submit(_Pending(lambda i: wire.Generate(i, request), queue=queue))
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finish_reason is not None:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            p = self._pending.pop(rid, None)
            if not finished and p is not None and p.sent and self._writer is not None:
                with contextlib.suppress(ConnectionError, RuntimeError):
                    self._writer.write(wire.frame(wire.Cancel(rid)))

    async def tokenize(self, text: str) -> list[int]:
        result: wire.Result = await self._call(lambda i: wire.Tokenize(i, text))
        return list(result.ids or [])

    async def logits(self, token_ids: list[int], images: tuple[bytes, ...] = ()) -> npt.NDArray[np.float32]:
        result: wire.Result = await self._call(lambda i: wire.Logits(i, list(token_ids), list(images)))
        assert result.array is not None
        return wire.unpack_array(result.array)

    async def embed(self, inputs: list[list[int]]) -> npt.NDArray[np.float32]:
        result: wire.Result = await self._call(lambda i: wire.Embed(i, [list(x) for x in inputs]))
        assert result.array is not None
        return wire.unpack_array(result.array)

    async def _call(self, message: Callable[[int], wire._Msg]) -> Any:
        if self._foreign():
            assert self._loop is not None
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._call_here(message), self._loop))
        return await self._call_here(message)

    async def _call_here(self, message: Callable[[int], wire._Msg]) -> Any:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        rid = self._submit(_Pending(message, future=fut))
        try:
            return await fut
        finally:
            p = self._pending.pop(rid, None)
            if p is not None and p.sent and not fut.done() and self._writer is not None:
                with contextlib.suppress(ConnectionError, RuntimeError):
                    self._writer.write(wire.frame(wire.Cancel(rid)))

    def _submit(self, p: _Pending) -> int:
        if self.failed:  # it gave up before this request came: not this request's doing (a failover moves it on)
            raise EngineCrashed(self.failed, outside=True)
        if self._closed:
            raise EngineClosed("the model was unloaded")
        rid = next(self._ids)
        try:
            p.frame = wire.frame(p.message(rid))
        except (OverflowError, UnicodeEncodeError, msgspec.EncodeError) as exc:
            # Only numbers beyond 64 bits (a token id, a seed) or unpaired surrogates get here: the
            # in-process engine would refuse them too, as a bad request.
            raise InvalidGenerationRequest(f"the request holds a value the engine cannot take: {exc}") from exc
        self._pending[rid] = p
        if self._connected.is_set():
            self._send(p)
        return rid  # otherwise sent by _connect() once the worker is back

    def _send(self, p: _Pending) -> None:
        assert self._writer is not None
        p.sent = True
        self._writer.write(p.frame)

    # --- receiving -----------------------------------------------------------------------

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                msg = wire.decode_for_gateway(await wire.read_frame(reader))
                if isinstance(msg, wire.Events):
                    for rid, event in msg.items:
                        p = self._pending.get(rid)
                        if p is not None and p.queue is not None:
                            p.started = True
                            p.queue.put_nowait(event)
                elif isinstance(msg, wire.Pong):
                    self._pong = msg
                    self._last_pong = time.monotonic()
                elif isinstance(msg, wire.Error):
                    self._settle(msg.id, wire.error_from(msg))
                elif isinstance(msg, wire.Result):
                    self._settle(msg.id, msg)
        except (asyncio.IncompleteReadError, ConnectionError, wire.ProtocolError) as exc:
            if not self._closed and self._writer is not None:
                lost, self._writer = self._writer, None  # stops the watchdog: this loss is handled here
                lost.close()  # the dead worker's end of the socket
                why = await self.connection.exit_reason()
                if isinstance(exc, wire.ProtocolError):
                    why = f"sent a malformed frame ({exc})"
                await self._lost(why)

    def _settle(self, rid: int, value: Any) -> None:
        p = self._pending.get(rid)
        if p is None:
            return
        if p.queue is not None:
            p.queue.put_nowait(value if isinstance(value, BaseException) else EngineCrashed("unexpected result"))
        elif p.future is not None and not p.future.done():
            if isinstance(value, BaseException):
                p.future.set_exception(value)
            else:
                p.future.set_result(value)

    async def _watch(self, writer: asyncio.StreamWriter) -> None:
        """Heartbeats: a worker that stops answering, or whose step runs too long, is killed."""
        s = self.supervision
        ping = itertools.count(1)
        while self._writer is writer and not writer.is_closing():
            try:
                writer.write(wire.frame(wire.Ping(next(ping))))
            except (ConnectionError, RuntimeError):
                return
            await asyncio.sleep(s.heartbeat_s)
            if self._writer is not writer or writer.is_closing():
                return  # lost in the meantime (its reader saw the end first): one loss, one restart
            silent = time.monotonic() - self._last_pong
            why = ""
            # On probation (the functional check, itself bounded by the check's time limit) the
            # limits are a load's: its first batches compile pipelines, and an engine whose work
            # holds the GIL (ORT GenAI prefilling several long prompts) answers pings late.
            patience = max(s.heartbeat_timeout_s, s.load_timeout_s) if self.probation else s.heartbeat_timeout_s
            if silent > patience:
                why = f"stopped answering heartbeats for {silent:.1f} s"
            # On probation (the functional check) a step may take as long as a load: its first
            # batches compile the device's pipelines (minutes on a software Vulkan device).
            elif self._pong is not None and self._pong.busy_seconds > (
                    max(s.step_timeout_s, s.load_timeout_s) if self.probation else s.step_timeout_s):
                why = f"was stuck in one engine step for {self._pong.busy_seconds:.1f} s"
            if why:
                log.error("%s %s (pid %s): killing it", self.connection.what, why, self.pid)
                self._writer = None
                self.connection.kill()
                writer.close()
                if self._reader_task is not None:
                    self._reader_task.cancel()
                await self._lost(why)
                return

    # --- crashes -------------------------------------------------------------------------

    async def _lost(self, why: str) -> None:
        self._writer = None
        self._connected.clear()
        now = time.monotonic()
        reason = f"the {self.connection.what} (pid {self.pid}) {why}"
        s = self.supervision
        outside = isinstance(self.connection, LocalWorker) and self.connection.killed_from_outside()
        if outside:
            reason += " from outside (not counted as an engine crash; its requests continue)"
        elif isinstance(self.connection, LocalWorker) and self.connection.memory_killed():
            reason += " (the kernel's OOM killer: the cgroup's memory.events counted a kill)"
        self.crashes = [c for c in self.crashes if now - c[0] < s.crash_window_s] + [(now, reason)]
        self._strikes = [t for t in self._strikes if now - t < s.crash_window_s] + ([] if outside else [now])
        log.error("%s; %d crash(es) counted in the last %.0f s", reason, len(self._strikes), s.crash_window_s)
        if self.probation:  # the functional check's work crashed it: that is the check's verdict
            self.failed = f"{reason} during the functional check"
            self._fail_pending(EngineCrashed(self.failed), everything=True)
            return
        self._fail_pending(EngineCrashed(f"{reason} while generating", outside=outside), everything=False)
        if self.on_crash is not None:
            self.on_crash(reason)
        if self._out_of_strikes(reason):
            return
        self._spawn(self._restart(reason))

    def _out_of_strikes(self, reason: str) -> bool:
        """Gives up (True) after max_crashes within the window, if the owner has somewhere to fall back
        to; with nowhere to go it keeps restarting, degraded."""
        s = self.supervision
        if len(self._strikes) < s.max_crashes:
            return False
        if self.can_fall_back is not None and not self.can_fall_back():
            if not self.degraded:
                log.error("%s: no other engine can serve this model; restarting it for as long as it takes", reason)
            self.degraded = f"{len(self._strikes)} crashes within {s.crash_window_s:.0f} s, nothing to fall back to"
            return False
        self._give_up(f"{reason}; {len(self._strikes)} crashes within {s.crash_window_s:.0f} s")
        return True

    async def _restart(self, reason: str) -> None:
        s = self.supervision
        attempt = 0
        while True:
            attempt += 1
            delay = s.delay(max(len(self._strikes), attempt))
            if attempt == 1 and isinstance(self.connection, LocalWorker) and self.connection.spare_ready():
                delay = 0.0  # the standby is loaded: hand over now (crashes still count toward giving up)
            self._next_restart = time.monotonic() + delay
            await asyncio.sleep(delay)
            if self._closed:
                return
            try:
                await self._connect()
            except (EngineError, OSError, TimeoutError, wire.ProtocolError) as exc:
                now = time.monotonic()
                self.crashes.append((now, f"the restart failed: {exc}"))
                self._strikes.append(now)
                if self._out_of_strikes(f"{reason}; the restart failed: {exc}"):
                    return
                log.warning("%s: the restart failed (%s); trying again", self.connection.what, exc)
                continue
            self.restarts += 1
            if self.degraded and len([t for t in self._strikes if time.monotonic() - t < s.crash_window_s]) < s.max_crashes:
                self.degraded = None
            log.warning("%s restarted (pid %s) after %.1f s", self.connection.what, self.pid, delay)
            return

    def _give_up(self, reason: str) -> None:
        self.failed = reason
        self._fail_pending(EngineCrashed(reason), everything=True)
        if self.on_failed is not None:
            self.on_failed(reason)

    def _fail_pending(self, exc: EngineError, everything: bool) -> None:
        """Fail the streams that produced tokens (every request with `everything`); the rest (streams not
        started yet, and calls, which are idempotent) wait to be sent to the restarted worker."""
        blame = not (isinstance(exc, EngineCrashed) and exc.outside)  # a kill from outside is nobody's doing
        for p in list(self._pending.values()):
            if p.sent and not everything and blame:
                p.crashes += 1
            if everything or p.started or p.crashes >= POISON_CRASHES:
                err = exc
                if not (everything or p.started):
                    err = EngineCrashed(f"{exc}; this request was in flight at {p.crashes} crashes in a row, "
                                        "so it is not sent again", blamed=True)
                if p.queue is not None:
                    p.queue.put_nowait(err)
                elif p.future is not None and not p.future.done():
                    p.future.set_exception(err)
            else:
                p.sent = False
