"""A pass's tokens turned into text and events while the next pass runs (GATEWAY_OVERLAP_OUTPUTS):
the same streams as without, on the real engine. On the CPU llama_decode returns when its pass is
done, so `auto` leaves it off there; `on` runs the same code path a GPU build takes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from engines.base import GenerationRequest, SamplingParams, TokenEvent
from engines.llamacpp.engine import LlamaCppEngine
from engines.llamacpp.load_settings import overlap_outputs
from tests.test_engine_llamacpp import _engine, _req


async def _smol(overlap: str, monkeypatch: pytest.MonkeyPatch) -> LlamaCppEngine:
    monkeypatch.setenv("GATEWAY_OVERLAP_OUTPUTS", overlap)
    return await _engine("smollm2-135m-instruct", parallel=4)


@pytest.fixture
async def engines(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[LlamaCppEngine, LlamaCppEngine]]:
    off = await _smol("off", monkeypatch)
    on = await _smol("on", monkeypatch)
    try:
        assert (off._sched._overlap, on._sched._overlap) == (False, True)  # type: ignore[union-attr]
        yield off, on
    finally:
        await off.close()
        await on.close()


def _stream(events: list[TokenEvent]) -> tuple[object, ...]:
    """What a client sees of a stream: each event's text and tokens, how it ended, its usage's counts."""
    last = events[-1]
    assert last.usage is not None
    return (tuple((ev.text, ev.token_ids, tuple(lp.token for lp in ev.logprobs)) for ev in events),
            last.finish_reason, last.stop_sequence, last.usage.prompt_tokens, last.usage.completion_tokens)


async def _events(e: LlamaCppEngine, req: GenerationRequest) -> list[TokenEvent]:
    return [ev async for ev in e.generate(req)]


def _requests(stop: str) -> list[GenerationRequest]:
    return [
        _req("Once upon a time", max_tokens=40, stop=(stop,)),
        _req("The capital of France is", max_tokens=17),
        _req("List three colors:", max_tokens=30, logprobs=True, top_logprobs=2),
        _req("Write a haiku about rain", max_tokens=25, ignore_eos=True),
    ]


async def test_overlapped_streams_are_the_streams_without(engines: tuple[LlamaCppEngine, LlamaCppEngine]) -> None:
    """Side by side and one by one, with a stop string, logprobs, a length limit: the same events,
    finish reasons and counts."""
    off, on = engines
    plain = await _events(off, _req("Once upon a time", max_tokens=40))
    words = "".join(ev.text for ev in plain).split()
    assert len(words) > 6, "too short a continuation to stop inside"
    stop = words[5]  # a word the greedy continuation reaches mid-stream
    want = await asyncio.gather(*(_events(off, r) for r in _requests(stop)))
    assert want[0][-1].stop_sequence == stop
    for _ in range(2):  # cold, then over the KV the first round left
        got = await asyncio.gather(*(_events(on, r) for r in _requests(stop)))
        assert [_stream(g) for g in got] == [_stream(w) for w in want]
    alone = [await _events(on, r) for r in _requests(stop)]
    assert [_stream(g) for g in alone] == [_stream(w) for w in want]


async def test_a_stop_string_found_after_the_next_pass_left_keeps_the_kv_true(
        engines: tuple[LlamaCppEngine, LlamaCppEngine]) -> None:
    """A stop string found while the next pass runs ends the request a token late: that token is in
    the sequence's KV and its cached tokens alike, so a later prompt that starts the same way reuses
    it and continues as a fresh engine does."""
    off, on = engines
    prompt = "Once upon a time"
    plain = await _events(off, _req(prompt, max_tokens=40))
    stop = "".join(ev.text for ev in plain).split()[5]
    ids = await on.tokenize(prompt)
    ended = [await _events(e, _req(prompt, max_tokens=40, stop=(stop,))) for e in (off, on)]
    n = ended[1][-1].usage.completion_tokens  # type: ignore[union-attr]
    assert _stream(ended[0]) == _stream(ended[1]) and n > 1

    generated = [t for ev in ended[1] for t in ev.token_ids]

    def held(e: LlamaCppEngine) -> list[list[int]]:
        return [s.cached for s in e._sched._slots]  # type: ignore[union-attr]

    # Without the overlap the last sampled token is never fed; with it, it was (the next pass had left).
    assert ids + generated[:-1] in held(off) and ids + generated not in held(off)
    assert ids + generated in held(on)
    follow = GenerationRequest("t", SamplingParams(temperature=0, max_tokens=12),
                               prompt_ids=tuple(ids + generated + generated[-1:]))
    got = await _events(on, follow)
    assert got[-1].usage is not None and got[-1].usage.cached_tokens >= len(ids) + n - 1
    assert _stream(got)[:2] == _stream(await _events(off, follow))[:2]


async def test_a_stream_cancelled_while_its_token_waits_leaves_the_others_intact(
        engines: tuple[LlamaCppEngine, LlamaCppEngine]) -> None:
    off, on = engines
    want = _stream(await _events(off, _req("Once upon a time", max_tokens=24)))

    async def cancelled() -> None:
        agen = on.generate(_req("A different story begins", max_tokens=200, ignore_eos=True))
        async for _ in agen:
            await agen.aclose()
            break

    got, _ = await asyncio.gather(_events(on, _req("Once upon a time", max_tokens=24)), cancelled())
    assert _stream(got) == want
    assert on.health().running == 0


@pytest.mark.parametrize(("backend", "choice", "want"), [
    ("cuda", "auto", True), ("rocm", "auto", False), ("cpu", "auto", False), ("vulkan", "auto", False),
    ("cpu", "on", True), ("cuda", "off", False)])
def test_the_overlap_is_on_where_llama_decode_returns_before_its_pass_ran(
        monkeypatch: pytest.MonkeyPatch, backend: str, choice: str, want: bool) -> None:
    monkeypatch.setenv("GATEWAY_OVERLAP_OUTPUTS", choice)
    assert overlap_outputs(backend) is want
