"""A stream that lost its worker waits for the engine to be back, not for the replay of its tokens:
`failover_wait` bounds the restart; replaying what was already sent takes what it takes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from engines.base import (
    Capabilities,
    EngineCrashed,
    EngineInfo,
    GenerationRequest,
    SamplingParams,
    SupervisorReport,
    TokenEvent,
    Usage,
)
from gateway.api.failover import FailoverPolicy, resumable
from gateway.metrics import Metrics

REPLAY_S = 0.4  # the restarted engine's replay of the tokens already sent
WAIT_S = 0.1  # failover_wait: shorter than the replay


class Dying:
    """Three tokens, then its worker is killed from outside."""

    info = EngineInfo("fake", "cpu", "cpu", capabilities=Capabilities(resume=True))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        for t in (1, 2, 3):
            yield TokenEvent(f"t{t} ", (t,))
        raise EngineCrashed("the local worker was killed by SIGKILL from outside", outside=True)


class Restarted:
    """Back at once; replays the tokens it is given before its first new one."""

    info = EngineInfo("fake", "cpu", "cpu", capabilities=Capabilities(resume=True))

    def __init__(self) -> None:
        self.resumed: tuple[int, ...] = ()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        self.resumed = request.resume_ids
        await asyncio.sleep(REPLAY_S)
        yield TokenEvent("t4", (4,), finish_reason="length", usage=Usage(5, 4))


class RestartedWorker(Restarted):
    """A supervised engine: it says when it is back."""

    def report(self) -> SupervisorReport:
        return SupervisorReport("worker", {})

    def trust(self) -> None:
        pass

    def retry_after(self) -> int:
        return 0

    async def back(self) -> bool:
        return True


async def _run(engine: Restarted) -> list[TokenEvent]:
    async def current() -> Restarted:
        return engine

    req = GenerationRequest("r", SamplingParams(max_tokens=4), prompt="x")
    stream = resumable(req, Dying(), current, FailoverPolicy(budget=2, wait_s=WAIT_S), "m", Metrics())  # type: ignore[arg-type]
    return [ev async for ev in stream]


async def test_a_replay_longer_than_the_wait_finishes_when_the_engine_says_it_is_back() -> None:
    engine = RestartedWorker()
    events = await _run(engine)
    assert engine.resumed == (1, 2, 3)
    assert "".join(e.text for e in events) == "t1 t2 t3 t4" and events[-1].finish_reason == "length"
    assert events[-1].usage is not None and events[-1].usage.failovers == 1


async def test_an_engine_that_cannot_say_it_is_back_has_the_wait_for_its_first_event() -> None:
    with pytest.raises(EngineCrashed, match="not back within"):
        await _run(Restarted())
