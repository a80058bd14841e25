"""A runtime for worker tests (`--plugin tests.stuck_engine`): its first step produces a token, its
second never returns (like a GPU hang), while the worker's event loop keeps answering heartbeats."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

import numpy as np
import numpy.typing as npt

from engines.base import EngineConfig, EngineHealth, EngineInfo, GenerationRequest, TokenEvent
from engines.registry import register_runtime


@register_runtime("stuck")
class StuckEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.info = EngineInfo("stuck", "cpu", "cpu", parallel=1)
        self._step_started = 0.0
        self._never = threading.Event()

    async def load(self) -> None:
        return None

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        yield TokenEvent("first", (1,))
        self._step_started = time.perf_counter()
        await asyncio.to_thread(self._never.wait)  # the decode step that hangs
        yield TokenEvent("", (), finish_reason="stop")

    async def tokenize(self, text: str) -> list[int]:
        return [1]

    async def logits(self, token_ids: list[int]) -> npt.NDArray[np.float32]:
        return np.zeros((len(token_ids), 4), dtype=np.float32)

    async def embed(self, inputs: list[list[int]]) -> npt.NDArray[np.float32]:
        return np.zeros((len(inputs), 4), dtype=np.float32)

    def health(self) -> EngineHealth:
        busy = time.perf_counter() - self._step_started if self._step_started else 0.0
        return EngineHealth(ready=True, running=1 if busy else 0, busy_seconds=busy)

    async def close(self) -> None:
        self._never.set()


@register_runtime("slow-load")
class SlowLoadEngine(StuckEngine):
    """Its load writes the worker's pid to $SLOW_LOAD_PID_FILE and takes a minute (or, with
    $SLOW_LOAD_CRASH set, crashes the worker itself with SIGSEGV)."""

    async def load(self) -> None:
        import os
        import signal
        from pathlib import Path

        Path(os.environ["SLOW_LOAD_PID_FILE"]).write_text(str(os.getpid()))
        if os.environ.get("SLOW_LOAD_CRASH"):
            os.kill(os.getpid(), signal.SIGSEGV)
        await asyncio.sleep(60)
