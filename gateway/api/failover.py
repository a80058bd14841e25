"""A stream outlives its engine: when the worker under a request dies after it started, the request
continues on the restarted worker (or the engine the model fell back to) from the tokens it already
produced, and the client sees one unbroken answer.

The engine is given the same request with `resume_ids` (the tokens already sent): it prefills the
prompt, feeds those tokens one per step as they were generated (or, with replay "fast", in the same
prefill), advances its sampler's penalty and grammar state over them, counts them as generated (so
`max_tokens` and `usage` stay exact) and goes on. Greedy output is then what an uninterrupted run
gives when the prompt's prefill has the same shape (llama.cpp's results depend on how tokens are
batched: a prompt taken from the prefix cache, or other sequences in the same steps, can change a
near-tie, with or without a failover); a seeded sampler starts its random stream again at the
failover, so seeded text is reproducible only up to it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace

from engines.base import POISON_CRASHES, Engine, EngineCrashed, GenerationRequest, Supervised, TokenEvent
from gateway.metrics import Metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FailoverPolicy:
    budget: int = 2  # failovers per request
    wait_s: float = 120.0  # for the engine to be back, per failover
    replay: bool = True  # feed the tokens already sent one per step (GenerationRequest.resume_replay)


async def resumable(request: GenerationRequest, engine: Engine, current: Callable[[], Awaitable[Engine]],
                    policy: FailoverPolicy, model: str, metrics: Metrics,
                    on_pause: Callable[[float], None] | None = None) -> AsyncIterator[TokenEvent]:
    """`engine.generate(request)`, continued after a crash of its worker (`EngineCrashed`) on the
    engine `current()` returns then, at most `policy.budget` times for crashes the request may have
    caused (kills from outside: every time). `on_pause` hears how long each failover stalled it."""
    produced: list[int] = []
    failovers = 0  # the times it continued on an engine
    counted = 0  # of those, after crashes it may have caused (a kill from outside is not one)
    barren = 0  # crashes in a row, not from outside, whose attempt produced no token
    last_token = time.perf_counter()
    paused_at: float | None = None
    deadline: float | None = None  # for the first event after a failover, where the engine cannot say it is back
    while True:
        req = request if failovers == 0 else replace(request, resume_ids=tuple(produced), resume_replay=policy.replay)
        stream = engine.generate(req).__aiter__()
        before = len(produced)
        try:
            while True:
                try:
                    if deadline is None:
                        ev = await anext(stream)
                    else:  # the engine must be back in time
                        ev = await asyncio.wait_for(anext(stream), max(0.0, deadline - time.perf_counter()))
                except StopAsyncIteration:
                    return
                if paused_at is not None:
                    metrics.failover_pause.labels(model).observe(time.perf_counter() - last_token)
                    if on_pause is not None:
                        on_pause(time.perf_counter() - last_token)
                    paused_at = deadline = None
                last_token = time.perf_counter()
                produced.extend(ev.token_ids)
                if failovers and ev.usage is not None:
                    ev = replace(ev, usage=replace(ev.usage, failovers=failovers))
                yield ev
        except EngineCrashed as exc:
            crashed: EngineCrashed = exc
        except TimeoutError:
            metrics.failovers.labels(model, "gave_up").inc()
            raise _not_back(policy) from None
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        counted += not crashed.outside
        if not crashed.outside:
            barren = barren + 1 if len(produced) == before else 0
        failovers += 1
        paused_at = time.perf_counter()
        engine = await _continue_on(crashed, engine, current, policy, model, metrics, request.request_id,
                                    len(produced), barren, counted)
        deadline = paused_at + policy.wait_s
        if await _back(engine, deadline, policy, model, metrics):
            deadline = None


async def _back(engine: Engine, deadline: float, policy: FailoverPolicy, model: str, metrics: Metrics) -> bool:
    """Whether the engine said it is back (a worker restarted) before `deadline`; then the stream
    has no deadline of its own: replaying the tokens already sent takes what it takes (the worker's
    step watchdog still guards each step). False for an engine that cannot say."""
    if not isinstance(engine, Supervised):
        return False
    try:
        if not await asyncio.wait_for(engine.back(), max(0.0, deadline - time.perf_counter())):
            return False
    except TimeoutError:
        metrics.failovers.labels(model, "gave_up").inc()
        raise _not_back(policy) from None
    return True


def _not_back(policy: FailoverPolicy) -> EngineCrashed:
    return EngineCrashed(f"the engine was not back within {policy.wait_s:.0f} s of losing this stream")


async def _continue_on(crashed: EngineCrashed, engine: Engine, current: Callable[[], Awaitable[Engine]],
                       policy: FailoverPolicy, model: str, metrics: Metrics, rid: str, produced: int,
                       barren: int, counted: int) -> Engine:
    """The engine a stream that lost its own continues on, or `crashed` raised where it may not.

    A request its engine already took for the cause of its crashes (`blamed`: in flight, not
    started, at POISON_CRASHES crashes in a row) is not carried on. Nor is one whose attempt died
    before it produced a token (`barren` crashes in a row) when it never produced one at all (a
    prompt that takes a broken kernel), or POISON_CRASHES times in a row after it did: one such
    crash of a stream that was already going is no sign, since a stream still replaying its tokens
    dies with whichever request did crash the worker. A kill from outside is none of these, and does
    not use up the budget (`counted`: this one included)."""
    poison = crashed.blamed or (barren > 0 and (produced == 0 or barren >= POISON_CRASHES))
    if not crashed.outside and (poison or counted > policy.budget):
        metrics.failovers.labels(model, "gave_up").inc()
        raise crashed
    try:
        nxt = await asyncio.wait_for(current(), policy.wait_s)
    except Exception as exc:  # noqa: BLE001 - nowhere to continue: the crash is the answer
        metrics.failovers.labels(model, "gave_up").inc()
        raise crashed from exc
    if produced and not nxt.info.capabilities.resume:  # it cannot continue a stream
        metrics.failovers.labels(model, "gave_up").inc()
        raise crashed
    reason = "restarted" if nxt is engine else "next_engine"
    metrics.failovers.labels(model, reason).inc()
    log.warning("request %s: its engine died after %d tokens (%s); continuing on the %s engine",
                rid, produced, crashed, "restarted" if nxt is engine else "next")
    return nxt
