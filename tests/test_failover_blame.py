"""Which crashes a stream is blamed for: a stream still replaying its tokens when another request
crashes the worker goes on; a stream whose own attempts die before a token, twice in a row, is the
poison and is dropped."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from engines.base import (
    Capabilities,
    EngineCrashed,
    EngineInfo,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
    Usage,
)
from gateway.api.failover import FailoverPolicy, resumable
from gateway.metrics import Metrics


class Scripted:
    """One engine whose attempts follow a script: each entry is the tokens that attempt yields
    before its worker crashes (a native crash, not a kill from outside), or None for an attempt
    that yields one token and finishes."""

    info = EngineInfo("fake", "cpu", "cpu", capabilities=Capabilities(resume=True))

    def __init__(self, script: list[tuple[int, ...] | None], blamed: bool = False) -> None:
        self.script = list(script)
        self.attempts = 0
        self.blamed = blamed  # the engine's own verdict: the request is the cause

    async def back(self) -> None:
        return None

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        step = self.script[self.attempts]
        self.attempts += 1
        if step is None:
            yield TokenEvent("end", (99,), finish_reason="length", usage=Usage(3, len(request.resume_ids) + 1))
            return
        for t in step:
            yield TokenEvent(f"t{t} ", (t,))
        raise EngineCrashed("the local worker was killed by SIGSEGV", blamed=self.blamed and not step)


async def _run(engine: Scripted) -> list[TokenEvent]:
    async def current() -> Scripted:
        return engine

    req = GenerationRequest("r", SamplingParams(max_tokens=8), prompt="x")
    stream = resumable(req, engine, current, FailoverPolicy(budget=5, wait_s=5.0), "m", Metrics())  # type: ignore[arg-type]
    return [ev async for ev in stream]


async def test_a_stream_caught_replaying_by_another_requests_crash_finishes() -> None:
    # Crash 1 after two tokens; crash 2 while it replays them (no new token: another request crashed
    # the worker); then it finishes.
    engine = Scripted([(1, 2), (), None])
    events = await _run(engine)
    assert engine.attempts == 3
    assert "".join(e.text for e in events) == "t1 t2 end" and events[-1].finish_reason == "length"


async def test_a_stream_whose_attempts_die_before_a_token_twice_in_a_row_is_dropped() -> None:
    engine = Scripted([(1,), (), (), None])
    with pytest.raises(EngineCrashed, match="SIGSEGV"):
        await _run(engine)
    assert engine.attempts == 3  # the fourth attempt, which would have finished, is never made


async def test_progress_between_barren_crashes_resets_the_count() -> None:
    engine = Scripted([(1,), (), (2,), (), None])
    events = await _run(engine)
    assert engine.attempts == 5 and events[-1].finish_reason == "length"


async def test_a_request_its_engine_took_for_the_cause_is_not_carried_on() -> None:
    # It was going, then the worker client sent its continuation twice, unstarted, and both times
    # the worker crashed: the client says so, and the failover does not send it again.
    engine = Scripted([(1,), (), None], blamed=True)
    with pytest.raises(EngineCrashed, match="SIGSEGV"):
        await _run(engine)
    assert engine.attempts == 2


async def test_a_request_that_never_produced_a_token_is_dropped_at_its_first_barren_crash() -> None:
    engine = Scripted([(), None])
    with pytest.raises(EngineCrashed, match="SIGSEGV"):
        await _run(engine)
    assert engine.attempts == 1
