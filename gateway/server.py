"""uvicorn, with a graceful drain on SIGTERM/SIGINT.

First signal: /health turns 503 `draining` and new API requests get 503 + Retry-After, while
running streams and queued requests finish for up to `drain_timeout`. What is still running then
ends with an in-band error (SSE: an error frame with code `server_shutdown`, then `[DONE]`; JSON:
a 503), engines are unloaded, and the process exits 0. A second signal exits at once.

uvicorn's own handling would stop the listener and, through sse-starlette's shutdown watch, cut
every stream mid-answer, then re-raise the signal so the exit status says "killed".
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI

from gateway.api.guards import Drain

log = logging.getLogger(__name__)

# After the drain time runs out: how long ended streams get to send their last frames, and how
# long a stream that produces nothing (a stuck prefill) gets once its engine has been closed.
_WRAP_UP_S = 2.0
_ENGINE_CLOSE_S = 3.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_timeout: float) -> None:
        super().__init__(config)
        self.app = app
        self.drain: Drain = app.state.drain
        self.drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)  # type: ignore[arg-type]

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in uvicorn's captured signals: a drained shutdown is a clean exit (status 0).
        if self.drain.draining or self._loop is None or not self.started:
            log.warning("second signal (%s): exiting now", signal.Signals(sig).name)
            os._exit(1)
        log.info("%s: draining (up to %gs for %d running request(s))", signal.Signals(sig).name,
                 self.drain_timeout, self.drain.inflight)
        self.drain.begin(retry_after=self.drain_timeout)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._draining = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        drain = self.drain
        t0 = time.monotonic()
        if not await _until(lambda: drain.inflight == 0, self.drain_timeout):
            log.warning("drain time (%gs) is up with %d request(s) running: ending them", self.drain_timeout,
                        drain.inflight)
            drain.expired = True
            self.app.state.admission.close("the server is shutting down")
            if not await _until(lambda: drain.inflight == 0, _WRAP_UP_S):
                # Streams that produce no event cannot notice the flag: stopping the engines ends them.
                await self.app.state.manager.close()
                await _until(lambda: drain.inflight == 0, _ENGINE_CLOSE_S)
        log.info("drained in %.1fs; shutting down", time.monotonic() - t0)
        self.should_exit = True


async def _until(done: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def run(app: FastAPI, host: str, port: int, log_level: str, drain_timeout: float) -> bool:
    """Serve until a signal and its drain; False if the app failed to start."""
    # Streams end by the drain above, never by sse-starlette's own watch of uvicorn's exit flag,
    # which is only raised once the drain has finished.
    # The serve lock's stack (asyncio, h11) even where uvloop and httptools are installed (Ray brings them).
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                            loop="asyncio", http="h11")
    server = DrainingServer(config, app, drain_timeout)
    server.run()
    return server.started
