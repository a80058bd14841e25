"""The shared KV cache's policies (engines/llamacpp/kv_pool.py) from tables of pool states: which
sequence gives way when a request starts, when a step does not fit, and when idle KV outgrows the
running requests' own. No model: each case is a plain description of the pool."""

from __future__ import annotations

import pytest

from engines.llamacpp import kv_pool
from engines.llamacpp.kv_pool import PoolSeq


def idle(seq_id: int, cells: int, since: float, cost: float = 0.0) -> PoolSeq:
    return PoolSeq(seq_id, cells, idle_since=since, idle_cost=cost)


def decoding(seq_id: int, cells: int, submitted: float) -> PoolSeq:
    return PoolSeq(seq_id, cells, running=True, submitted=submitted, decoding=True)


def prefilling(seq_id: int, cells: int, submitted: float, unfed: int) -> PoolSeq:
    return PoolSeq(seq_id, cells, running=True, submitted=submitted, unfed=unfed)


# (pool, capacity, need, keep) -> (evicted, oldest first; whether `need` cells are then free)
EVICTIONS = {
    "room already: nothing leaves": ([idle(0, 100, 1.0), decoding(1, 100, 0.0)], 500, 200, None, ([], True)),
    "exactly the room needed: nothing leaves": ([idle(0, 100, 1.0), decoding(1, 100, 0.0)], 300, 100, None, ([], True)),
    "one cell short: the idle one leaves": ([idle(0, 100, 1.0), decoding(1, 100, 0.0)], 300, 101, None, ([0], True)),
    "the one idle longest leaves first": (
        [idle(0, 100, 5.0), idle(1, 100, 1.0), idle(2, 100, 3.0), decoding(3, 100, 0.0)], 500, 200, None, ([1], True)),
    "then the next longest, until it fits": (
        [idle(0, 100, 5.0), idle(1, 100, 1.0), idle(2, 100, 3.0), decoding(3, 100, 0.0)], 500, 300, None, ([1, 2], True)),
    "the kept sequence stays": (
        [idle(0, 100, 5.0), idle(1, 100, 1.0), decoding(2, 100, 0.0)], 400, 200, 1, ([0], True)),
    "running requests never leave: no fit": (
        [idle(0, 50, 1.0), decoding(1, 300, 0.0)], 400, 200, None, ([0], False)),
    "empty sequences are not evictions": (
        [idle(0, 0, 0.0), idle(1, 100, 2.0), decoding(2, 250, 0.0)], 400, 150, None, ([1], True)),
    "all idle leave and it still does not fit": (
        [idle(0, 100, 2.0), idle(1, 100, 1.0), prefilling(2, 100, 0.0, 50)], 300, 250, None, ([1, 0], False)),
}


@pytest.mark.parametrize(("pool", "capacity", "need", "keep", "expected"), EVICTIONS.values(), ids=EVICTIONS.keys())
def test_evictions(pool: list[PoolSeq], capacity: int, need: int, keep: int | None,
                   expected: tuple[list[int], bool]) -> None:
    assert kv_pool.evictions(pool, capacity, need, keep) == expected


# (pool, capacity, n_batch, tokens per decoding sequence) -> (idle evicted, running paused)
FIT_STEP = {
    "fits: nothing moves": ([idle(0, 100, 1.0), decoding(1, 100, 1.0), decoding(2, 100, 2.0)], 400, 64, 1, ([], [])),
    "exactly fits: nothing moves": ([decoding(0, 199, 1.0), decoding(1, 199, 2.0)], 400, 64, 1, ([], [])),
    "idle KV gives way before any request pauses": (
        [idle(0, 100, 3.0), idle(1, 100, 1.0), decoding(2, 150, 1.0), decoding(3, 149, 2.0)], 500, 64, 1, ([1], [])),
    "the newest request pauses when idle KV is not enough": (
        [idle(0, 1, 1.0), decoding(1, 199, 5.0), decoding(2, 199, 9.0), decoding(3, 0, 7.0)], 400, 64, 1,
        ([0], [2])),
    "the newest pauses, not the oldest nor the largest": (
        [decoding(0, 133, 1.0), decoding(1, 133, 3.0), decoding(2, 134, 2.0)], 401, 64, 1, ([], [1])),
    "a request alone never pauses": ([idle(0, 50, 1.0), prefilling(1, 390, 0.0, 500)], 400, 64, 1, ([0], [])),
    "a step needs at most a batch of cells": (
        [prefilling(0, 100, 1.0, 10_000), prefilling(1, 236, 2.0, 10_000)], 400, 64, 1, ([], [])),
    "prompt chunks count until a batch": (
        [prefilling(0, 100, 1.0, 30), prefilling(1, 237, 2.0, 34)], 400, 64, 1, ([], [1])),
    "drafts count for each decoding sequence": (
        [decoding(0, 190, 1.0), decoding(1, 190, 2.0)], 400, 64, 11, ([], [1])),
    "without drafts the same step fits": ([decoding(0, 190, 1.0), decoding(1, 190, 2.0)], 400, 64, 1, ([], [])),
    "pauses go on while it does not fit": (
        [decoding(0, 340, 1.0), prefilling(1, 50, 4.0, 40), decoding(2, 60, 3.0), decoding(3, 2, 2.0)], 400, 64, 1,
        ([], [1, 2])),
}


@pytest.mark.parametrize(("pool", "capacity", "n_batch", "per_decode", "expected"), FIT_STEP.values(),
                         ids=FIT_STEP.keys())
def test_fit_step(pool: list[PoolSeq], capacity: int, n_batch: int, per_decode: int,
                  expected: tuple[list[int], list[int]]) -> None:
    assert kv_pool.fit_step(pool, capacity, n_batch, per_decode) == expected


# What the trim learns of each idle sequence: (may leave, seconds its copies take or None).
MOVABLE, UNPRICED = (True, 0.01), (True, None)

# (pool, now, grace, payback, prices by sequence) -> trimmed, oldest first
TRIM = {
    "nothing runs: idle KV stays": ([idle(0, 500, 0.0), idle(1, 500, 1.0)], 100.0, 1.0, 8.0,
                                    {0: UNPRICED, 1: UNPRICED}, []),
    "idle KV no larger than the running's stays": ([idle(0, 100, 0.0), decoding(1, 100, 0.0)], 100.0, 1.0, 8.0,
                                                   {0: UNPRICED}, []),
    "idle KV larger than the running's leaves": ([idle(0, 101, 0.0), decoding(1, 100, 0.0)], 100.0, 1.0, 8.0,
                                                 {0: UNPRICED}, [0]),
    "the running's prompts yet to prefill count as theirs": (
        [idle(0, 150, 0.0), prefilling(1, 100, 0.0, 50)], 100.0, 1.0, 8.0, {0: UNPRICED}, []),
    "oldest first, until idle KV no longer exceeds the running's": (
        [idle(0, 100, 3.0), idle(1, 100, 1.0), idle(2, 100, 2.0), decoding(3, 150, 0.0)], 100.0, 1.0, 8.0,
        {0: UNPRICED, 1: UNPRICED, 2: UNPRICED}, [1, 2]),
    "idle for less than the grace: it stays": ([idle(0, 500, 99.5), decoding(1, 100, 0.0)], 100.0, 1.0, 8.0,
                                               {0: UNPRICED}, []),
    "idle for exactly the grace: it leaves": ([idle(0, 500, 99.0), decoding(1, 100, 0.0)], 100.0, 1.0, 8.0,
                                              {0: UNPRICED}, [0]),
    "recent ones stay": (
        [idle(0, 300, 99.8), idle(1, 300, 99.9), decoding(2, 100, 0.0)], 100.0, 1.0, 8.0,
        {0: UNPRICED, 1: UNPRICED}, []),
    "one that may not leave is passed over": (
        [idle(0, 300, 1.0), idle(1, 300, 2.0), decoding(2, 100, 0.0)], 100.0, 1.0, 8.0,
        {0: (False, None), 1: UNPRICED}, [1]),
    "one whose cells have not cost enough yet stays": (
        [idle(0, 300, 1.0, cost=0.079), idle(1, 300, 2.0, cost=0.08), decoding(2, 100, 0.0)], 100.0, 1.0, 8.0,
        {0: MOVABLE, 1: MOVABLE}, [1]),
    "payback 0: priced ones leave once the grace is over": (
        [idle(0, 300, 1.0), decoding(1, 100, 0.0)], 100.0, 1.0, 0.0, {0: MOVABLE}, [0]),
    "unpriced: the grace alone decides": ([idle(0, 300, 1.0), decoding(1, 100, 0.0)], 100.0, 1.0, 1e9,
                                          {0: UNPRICED}, [0]),
}


@pytest.mark.parametrize(("pool", "now", "grace", "payback", "prices", "expected"), TRIM.values(), ids=TRIM.keys())
def test_trim(pool: list[PoolSeq], now: float, grace: float, payback: float,
              prices: dict[int, tuple[bool, float | None]], expected: list[int]) -> None:
    assert list(kv_pool.trim(pool, now, grace, payback, prices.__getitem__)) == expected


def test_the_trim_prices_each_sequence_only_once_the_one_before_has_left() -> None:
    """A state saved to the host cache changes what fits there: each price is asked after the
    sequence before has left, and none after the trim is done."""
    asked: list[int] = []
    left: list[int] = []

    def price(seq_id: int) -> tuple[bool, float | None]:
        asked.append(seq_id)
        assert left == [s for s in asked[:-1] if s != 0], (asked, left)
        return (seq_id != 0, None)

    pool = [idle(0, 100, 1.0), idle(1, 100, 2.0), idle(2, 100, 3.0), idle(3, 100, 4.0), decoding(4, 200, 0.0)]
    for seq_id in kv_pool.trim(pool, 100.0, 1.0, 8.0, price):
        left.append(seq_id)
    assert left == [1, 2] and asked == [0, 1, 2]


# (cells of each free sequence, of them the prompt's) -> the one the prompt takes (None: least missed)
FREE_SLOT = {
    "its own KV but a few tokens": ([40, 0, 500], [30, 0, 0], 0),
    "its own KV, exactly the copy gain short": ([46, 0], [30, 0], 0),
    "too short a prefix to count: an empty one": ([20, 0], [15, 0], 1),
    "more than the copy gain of its own left over: an empty one": ([47, 0], [30, 0], 1),
    "the first empty one": ([300, 0, 0], [0, 0, 0], 1),
    "no empty one: at least half its own KV": ([60, 500], [30, 0], 0),
    "less than half: the least missed": ([61, 500], [30, 0], None),
    "nothing of it anywhere: the least missed": ([100, 200], [0, 0], None),
    "the longest prefix wins": ([100, 40, 0], [20, 30, 0], 1),
}


@pytest.mark.parametrize(("cells", "held", "expected"), FREE_SLOT.values(), ids=FREE_SLOT.keys())
def test_free_slot_by_prefix(cells: list[int], held: list[int], expected: int | None) -> None:
    assert kv_pool.free_slot_by_prefix(cells, held) == expected


# (cells, covered elsewhere, idle since) -> the free sequence whose KV gives way
LEAST_MISSED = {
    "held elsewhere the most": ([300, 300], [0, 290], [1.0, 2.0], 1),
    "the smaller of two held nowhere": ([300, 200], [0, 0], [1.0, 2.0], 1),
    "as much missed: idle longest": ([300, 300], [100, 100], [2.0, 1.0], 1),
    "all alike: the first": ([300, 300], [0, 0], [1.0, 1.0], 0),
}


@pytest.mark.parametrize(("cells", "covered", "since", "expected"), LEAST_MISSED.values(), ids=LEAST_MISSED.keys())
def test_least_missed(cells: list[int], covered: list[int], since: list[float], expected: int) -> None:
    assert kv_pool.least_missed(cells, covered, since) == expected


def test_a_request_starts_with_its_prompt_a_batch_and_the_running_prefills_free() -> None:
    assert kv_pool.start_need(unfed=100, prompt=500, held=200, n_batch=64) == 464
    assert kv_pool.step_need(n_batch=64, decoding=10, unfed=30) == 40
    assert kv_pool.step_need(n_batch=64, decoding=10, unfed=300) == 64
