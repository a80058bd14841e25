"""A Serve replica's token lists (`gateway.cluster.replica.batched`): the first token at once, later
ones at most every interval and together, the last one without waiting out the interval; errors and
cancellation carried through."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from engines.base import TokenEvent
from gateway.cluster.replica import batched


async def _events(n: int, every_s: float, closed: list[str], fail_at: int | None = None) -> AsyncIterator[TokenEvent]:
    try:
        for i in range(n):
            await asyncio.sleep(every_s)
            if i == fail_at:
                raise RuntimeError("the engine failed")
            yield TokenEvent(str(i), (i,), finish_reason="length" if i == n - 1 else None)
    finally:
        closed.append("closed")


async def _lists(stream: AsyncIterator[list[TokenEvent]]) -> list[tuple[float, list[int]]]:
    return [(time.perf_counter(), [e.token_ids[0] for e in events]) async for events in stream]


def test_without_an_interval_each_token_goes_alone() -> None:
    out = asyncio.run(_lists(batched(_events(5, 0.005, []), 0.0)))
    assert [ids for _, ids in out] == [[0], [1], [2], [3], [4]]


def test_tokens_faster_than_the_interval_go_together_and_none_is_lost() -> None:
    async def run() -> tuple[float, list[tuple[float, list[int]]]]:
        t0 = time.perf_counter()
        return t0, await _lists(batched(_events(60, 0.002, []), 0.1))

    t0, out = asyncio.run(run())
    ids = [i for _, group in out for i in group]
    assert ids == list(range(60))  # in order, all of them
    assert out[0][1] == [0] and out[0][0] - t0 < 0.05  # the first token at once, not after the interval
    assert len(out) <= 4 and max(len(g) for _, g in out[1:]) >= 20  # ~120 ms of tokens in a few lists
    gaps = [b - a for (a, _), (b, _) in zip(out, out[1:], strict=False)]
    assert all(g >= 0.09 for g in gaps[:-1]), gaps  # no more often than the interval (the last may be sooner)


def test_the_last_token_does_not_wait_out_the_interval() -> None:
    async def run() -> tuple[float, list[tuple[float, list[int]]]]:
        t0 = time.perf_counter()
        return t0, await _lists(batched(_events(3, 0.001, []), 0.5))

    t0, out = asyncio.run(run())
    assert [i for _, g in out for i in g] == [0, 1, 2]
    assert out[-1][0] - t0 < 0.2  # not 0.5 s: the stream ended, its tokens went at once


def test_slow_tokens_are_not_held() -> None:
    out = asyncio.run(_lists(batched(_events(4, 0.05, []), 0.02)))
    assert [g for _, g in out] == [[0], [1], [2], [3]]  # each came after the interval had passed


def test_an_error_arrives_after_the_tokens_before_it() -> None:
    async def run() -> tuple[list[int], BaseException | None]:
        got: list[int] = []
        try:
            async for events in batched(_events(10, 0.001, [], fail_at=4), 0.005):
                got += [e.token_ids[0] for e in events]
        except RuntimeError as exc:
            return got, exc
        return got, None

    got, exc = asyncio.run(run())
    assert got == [0, 1, 2, 3] and exc is not None and "failed" in str(exc)


def test_closing_the_lists_closes_the_stream() -> None:
    closed: list[str] = []

    async def run() -> None:
        lists = batched(_events(1000, 0.001, closed), 0.01)
        async for _ in lists:
            break
        await lists.aclose()  # type: ignore[attr-defined]
        assert closed == ["closed"]  # the engine's stream ended (its request is cancelled there)

    asyncio.run(run())


def test_a_cancelled_reader_cancels_the_stream() -> None:
    closed: list[str] = []

    async def run() -> None:
        async def read() -> None:
            async for _ in batched(_events(1000, 0.01, closed), 0.02):
                pass

        task = asyncio.create_task(read())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert closed == ["closed"]

    asyncio.run(run())
