"""The host-memory prefix cache and the prefill budget, on the real model: conversations that lose
their slot get their prefix back from host memory, with the output of a cold run; the bound holds;
entries of another engine identity are never used; a long prompt shares steps with a running stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from engines.base import GenerationRequest, SamplingParams, Usage
from engines.llamacpp.engine import LlamaCppEngine
from engines.llamacpp.prefix_cache import MIN_ENTRY_TOKENS, HostPrefixCache, common_prefix
from engines.llamacpp.runtime import LlamaCppOptions
from gateway.chat.template import ChatMessage
from gateway.models.registry import load_registry
from tests.chat import chat_request
from tests.conftest import NO_CHECKS, ROOT

TOPICS = ["a lighthouse keeper", "a baker in Lyon", "a robot learning to paint", "two rival chess clubs"]


def _path(model: str) -> tuple[str, Any]:
    reg = load_registry(ROOT / "models.yaml")
    spec = reg.models[model]
    return str(reg.resolve(spec, "gguf")), spec


async def _engine(parallel: int = 1, **kw: Any) -> LlamaCppEngine:
    path, spec = _path("smollm2-135m-instruct")
    e = LlamaCppEngine(LlamaCppOptions.engine_config(model_path=path, context_length=2048, parallel=parallel,
                                                     chat_template=spec.chat_template, **kw))
    await e.load()
    return e


@pytest.fixture
async def one_slot() -> AsyncIterator[LlamaCppEngine]:
    e = await _engine(parallel=1, prefix_cache_mib=256)
    yield e
    await e.close()


def _conversation(topic: str, turns: int, replies: list[str] | None = None) -> tuple[ChatMessage, ...]:
    msgs = [ChatMessage("system", "You are a storyteller. Answer in long, detailed paragraphs. " * 4)]
    for i in range(turns):
        msgs.append(ChatMessage("user", f"Turn {i}: tell me more about {topic}, with names, places and dates. " * 3))
        if i < turns - 1:
            msgs.append(ChatMessage("assistant", replies[i] if replies else f"Here is part {i} of the story of {topic}. " * 6))
    return tuple(msgs)


async def _ask(e: LlamaCppEngine, msgs: tuple[ChatMessage, ...], max_tokens: int = 24) -> tuple[str, Usage]:
    text, usage = "", None
    async for ev in e.generate(chat_request(e, msgs, SamplingParams(temperature=0, max_tokens=max_tokens), "t")):
        text += ev.text
        usage = ev.usage or usage
    assert usage is not None
    return text, usage


async def test_a_conversation_that_lost_its_slot_gets_its_prefix_from_host_memory(one_slot: LlamaCppEngine) -> None:
    a1, b1 = _conversation(TOPICS[0], 1), _conversation(TOPICS[1], 1)
    await _ask(one_slot, a1)
    await _ask(one_slot, b1)  # takes the only slot: A's KV goes to host memory
    a2 = _conversation(TOPICS[0], 2)
    text, usage = await _ask(one_slot, a2)
    assert usage.prefix_lookup == "hit" and usage.restored_tokens >= MIN_ENTRY_TOKENS
    assert usage.cached_tokens >= usage.restored_tokens
    stats = one_slot.health().prefix_cache
    assert stats is not None and stats.hits >= 1 and stats.saved >= 2 and stats.bytes > 0
    # The same answer as a cold run (an engine without the cache, fresh).
    cold = await _engine(parallel=1, prefix_cache_mib=0)
    try:
        cold_text, cold_usage = await _ask(cold, a2)
        assert cold.health().prefix_cache is None
    finally:
        await cold.close()
    assert cold_usage.cached_tokens == 0 and cold_usage.restored_tokens == 0
    assert text == cold_text and usage.prompt_tokens == cold_usage.prompt_tokens


async def test_sixteen_conversations_on_two_slots_keep_their_prefixes() -> None:
    e = await _engine(parallel=2, prefix_cache_mib=512)
    try:
        convs = [f"{t} #{i}" for i in range(4) for t in TOPICS]
        replies = [(await _ask(e, _conversation(c, 1)))[0] for c in convs]
        # The next turn carries the model's own reply, as a chat client sends it back.
        follow = [await _ask(e, _conversation(c, 2, [r]), max_tokens=4) for c, r in zip(convs, replies, strict=True)]
        cached = sum(u.cached_tokens for _, u in follow)
        prompt = sum(u.prompt_tokens for _, u in follow)
        assert cached / prompt > 0.6, (cached, prompt)
        assert all(u.prefix_lookup == "hit" for _, u in follow[2:])
    finally:
        await e.close()


async def test_the_cache_never_exceeds_its_bound() -> None:
    path, spec = _path("smollm2-135m-instruct")
    # One conversation's state (~170 tokens) is several MiB for SmolLM2: 12 MiB holds a few.
    e = LlamaCppEngine(LlamaCppOptions.engine_config(model_path=path, context_length=2048, parallel=1,
                                                     chat_template=spec.chat_template, prefix_cache_mib=12))
    await e.load()
    try:
        host = e._sched.host_cache  # type: ignore[union-attr]
        assert host is not None and host.limit_bytes == 12 << 20
        for i in range(8):
            await _ask(e, _conversation(f"{TOPICS[i % 4]} #{i}", 1), max_tokens=4)
            assert host.bytes <= host.limit_bytes
        stats = e.health().prefix_cache
        assert stats is not None and stats.evictions >= 1 and 1 <= stats.entries <= 3
    finally:
        await e.close()


def _fill(array: np.ndarray) -> int:
    array[:] = 1
    return len(array)


def test_entries_of_another_engine_identity_are_never_restored() -> None:
    cache = HostPrefixCache(limit_bytes=1 << 20)
    tokens = np.arange(200, dtype=np.int32)
    cache.put("model-a|cpu", tokens, 100, _fill)
    assert cache.lookup("model-b|cpu", tokens, 199) == (None, 0)
    entry, n = cache.lookup("model-a|cpu", tokens, 199)
    assert entry is not None and n == 199
    # A longer state of the same conversation replaces the shorter one; other identities stay.
    cache.put("model-b|cpu", tokens[:150], 100, _fill)
    cache.put("model-a|cpu", np.arange(300, dtype=np.int32), 100, _fill)
    assert len(cache) == 2 and cache.covers("model-a|cpu", tokens) and not cache.covers("model-b|cpu", tokens)
    # A state whose copy failed is not kept.
    assert not cache.put("model-c|cpu", tokens, 100, lambda a: 0) and len(cache) == 2
    # LRU within the bound.
    small = HostPrefixCache(limit_bytes=250)
    for i in range(4):
        small.put("m", np.full(100, i, dtype=np.int32), 100, _fill)
    assert len(small) == 2 and small.evictions == 2 and small.bytes == 200
    assert common_prefix(np.array([1, 2, 3]), np.array([1, 2, 4])) == 2


async def test_two_models_in_one_process_keep_their_own_entries() -> None:
    a = await _engine(parallel=1, prefix_cache_mib=128)
    path, spec = _path("gemma-3-270m")
    b = LlamaCppEngine(LlamaCppOptions.engine_config(model_path=path, context_length=2048, parallel=1,
                                                     chat_template=spec.chat_template, prefix_cache_mib=128))
    await b.load()
    try:
        assert a._sched.host_cache is not b._sched.host_cache  # type: ignore[union-attr]
        assert a._sched._identity != b._sched._identity  # type: ignore[union-attr]
        for e in (a, b):
            await _ask(e, _conversation(TOPICS[0], 1), max_tokens=4)
            await _ask(e, _conversation(TOPICS[1], 1), max_tokens=4)
        _, ua = await _ask(a, _conversation(TOPICS[0], 2), max_tokens=4)
        _, ub = await _ask(b, _conversation(TOPICS[0], 2), max_tokens=4)
        assert ua.prefix_lookup == ub.prefix_lookup == "hit"
        for e in (a, b):
            host = e._sched.host_cache  # type: ignore[union-attr]
            assert host is not None and {x.identity for x in host._entries.values()} == {e._sched._identity}  # type: ignore[union-attr]
    finally:
        await a.close()
        await b.close()


async def test_a_long_prompt_interleaves_with_a_running_stream() -> None:
    """The running stream keeps producing tokens while a long prompt is prefilled in chunks of the
    prefill budget; alone, the same prompt is prefilled in whole batches."""
    e = await _engine(parallel=2, prefix_cache_mib=0, prefill_budget=32)
    try:
        stamps: list[float] = []

        async def stream() -> None:
            req = GenerationRequest("s", SamplingParams(temperature=0, max_tokens=150, ignore_eos=True),
                                    prompt="Once upon a time")
            async for ev in e.generate(req):
                if ev.token_ids:
                    stamps.append(time.perf_counter())

        running = asyncio.create_task(stream())
        while len(stamps) < 5:
            await asyncio.sleep(0.01)
        long_prompt = "The history of lighthouses along the northern coast. " * 90  # ~900 tokens
        t0 = time.perf_counter()
        first: list[float] = []
        async for _ev in e.generate(GenerationRequest("l", SamplingParams(temperature=0, max_tokens=2),
                                                     prompt=long_prompt)):
            first.append(time.perf_counter())
        prefill_s = first[0] - t0
        during = [t for t in stamps if t0 < t < first[0]]
        await running
        # ~900 tokens at 32 per step: ~28 steps, each with a token of the running stream.
        assert len(during) >= 20, (len(during), prefill_s)
    finally:
        await e.close()


def test_through_the_gateway_usage_and_metrics_show_restored_prefixes(tmp_path: Any) -> None:
    """Two conversations taking turns on one sequence slot, through a worker process: each follow-up
    reports its restored prefix as cached prompt tokens, and /metrics counts the cache's work."""
    import httpx
    import openai

    from gateway.app import create_app
    from gateway.settings import Settings
    from tests.conftest import MODEL, ServerThread

    settings = Settings.from_env(env=NO_CHECKS, config=str(ROOT / "models.yaml"), parallel=1, prefix_cache=64)
    server = ServerThread(create_app(settings, load_registry(ROOT / "models.yaml"))).start()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        history: dict[str, list[Any]] = {t: [] for t in TOPICS[:2]}
        cached: list[int] = []
        for turn in range(3):
            for topic, msgs in history.items():
                msgs.append({"role": "user", "content": f"Turn {turn}: more about {topic}, with names and places. " * 3})
                r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0)
                msgs.append({"role": "assistant", "content": r.choices[0].message.content})
                assert r.usage is not None and r.usage.prompt_tokens_details is not None
                if turn:
                    cached.append(r.usage.prompt_tokens_details.cached_tokens or 0)
        assert all(c >= 64 for c in cached), cached
        def value(name: str) -> float | None:
            line = next((ln for ln in metrics.splitlines() if ln.startswith(name + "{")), None)
            return float(line.rsplit(" ", 1)[1]) if line is not None else None

        # The worker's stats reach /metrics with its next heartbeat: read until they have caught up
        # (the four hits, and the last request finished: its sequence idle).
        deadline = time.monotonic() + 15
        while True:
            metrics = httpx.get(f"{server.url}/metrics").text
            hits = [ln for ln in metrics.splitlines() if ln.startswith("gateway_prefix_cache_hits_total{")]
            caught_up = (value("gateway_prefix_cache_hits_total") or 0) >= 4 and (
                value("gateway_kv_cells_idle") == value("gateway_kv_cells_used"))
            if caught_up or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert hits and float(hits[0].rsplit(" ", 1)[1]) >= 4, hits
        limit = [ln for ln in metrics.splitlines() if ln.startswith("gateway_prefix_cache_limit_bytes{")]
        assert limit and float(limit[0].rsplit(" ", 1)[1]) == 64 << 20
        saves = [ln for ln in metrics.splitlines() if ln.startswith("gateway_prefix_cache_saves_total{")]
        assert saves and float(saves[0].rsplit(" ", 1)[1]) >= 4, saves  # each hit was saved first
        assert any(ln.startswith("gateway_prefix_cache_checkpoints_total{") for ln in metrics.splitlines())

        def gauge(name: str) -> float:
            return float(next(ln for ln in metrics.splitlines() if ln.startswith(name + "{")).rsplit(" ", 1)[1])

        # The CPU engine's cache is ordinary memory; the copy rates it measured are there.
        assert gauge("gateway_prefix_cache_pinned") == 0
        assert gauge("gateway_prefix_cache_save_bytes_per_second") > 1e6
        assert gauge("gateway_prefix_cache_restore_bytes_per_second") > 1e6
        assert gauge("gateway_prefix_cache_unpinned_total") == 0
        # The KV cache: one sequence of 2048 cells, holding the last conversation, now idle.
        assert gauge("gateway_kv_cells") == 2048
        assert 0 < gauge("gateway_kv_cells_used") == gauge("gateway_kv_cells_idle")
        assert gauge("gateway_kv_preemptions_total") == 0  # one KV stream per sequence: nothing is paused
        assert gauge("gateway_kv_idle_evictions_total") == 0
        assert gauge("gateway_kv_prefix_copies_total") == gauge("gateway_kv_prefix_follows_total") == 0  # one sequence
        assert gauge("gateway_kv_long_prompts_beside_total") == 0  # no second context for long prompts
    finally:
        server.stop()


async def test_a_conversation_goes_back_to_its_own_free_sequence() -> None:
    """With two free sequences, a long follow-up goes to the one holding its conversation (not the
    lowest, which holds another's): nothing is copied, nothing evicted to host memory."""
    e = await _engine(parallel=2, prefix_cache_mib=64)
    try:
        b1, a1 = _conversation(TOPICS[1] + " " + "and more " * 60, 1), _conversation(TOPICS[0] + " " + "and more " * 60, 1)
        first = asyncio.create_task(_ask(e, b1, max_tokens=40))  # takes sequence 0
        await asyncio.sleep(0.3)
        reply, _ = await _ask(e, a1, max_tokens=8)  # sequence 1
        await first
        sched = e._sched
        assert sched is not None and sched.host_cache is not None
        copies, saved = sched.prefix_copies, sched.host_cache.saved
        _, usage = await _ask(e, _conversation(TOPICS[0] + " " + "and more " * 60, 2, [reply]), max_tokens=4)
        assert usage.cached_tokens >= 256
        assert (sched.prefix_copies, sched.host_cache.saved) == (copies, saved)
        prompt = sched._slots[1].cached  # the follow-up ran on sequence 1, its conversation's
        assert len(prompt) > usage.cached_tokens
    finally:
        await e.close()


async def test_one_shared_kv_cache_serves_concurrent_streams_and_reuses_prefixes() -> None:
    """kv_unified (opt-in, llama-server's layout): two conversations at once on one shared cache,
    each next turn reusing its own prefix."""
    e = await _engine(parallel=2, prefix_cache_mib=0, kv_unified=True)
    try:
        assert "unified" in e._sched._identity  # type: ignore[union-attr]
        firsts = await asyncio.gather(*(_ask(e, _conversation(t, 1)) for t in TOPICS[:2]))
        assert all(text and u.completion_tokens == 24 for text, u in firsts)
        nexts = await asyncio.gather(*(_ask(e, _conversation(t, 2, [r]), max_tokens=4)
                                       for t, (r, _) in zip(TOPICS[:2], firsts, strict=True)))
        for (_, first), (_, u) in zip(firsts, nexts, strict=True):
            assert u.cached_tokens >= first.prompt_tokens - 8, (u.cached_tokens, first.prompt_tokens)
    finally:
        await e.close()


def test_the_stats_of_several_workers_combine() -> None:
    from engines.base import PrefixCacheStats

    a = PrefixCacheStats(hits=2, bytes=10, pinned=True, save_bytes_per_s=4e9, restore_bytes_per_s=0.0)
    b = PrefixCacheStats(hits=3, bytes=5, pinned=False, save_bytes_per_s=2e9, restore_bytes_per_s=6e9)
    c = PrefixCacheStats.combine([a, b])
    assert (c.hits, c.bytes, c.pinned) == (5, 15, False)
    assert c.save_bytes_per_s == 3e9 and c.restore_bytes_per_s == 6e9  # rates average the ones measured
    assert PrefixCacheStats.combine([a, a]).pinned


def test_the_pinned_host_cache_switch_reads_the_usual_spellings_and_refuses_others() -> None:
    from gateway.settings import Settings

    def read(v: str) -> str:
        return Settings.from_env(env={"GATEWAY_PINNED_HOST_CACHE": v}).pinned_host_cache

    assert Settings.from_env(env={}).pinned_host_cache == "auto"
    assert [read(v) for v in ("0", "off", "False", "1", "on", "auto")] == ["off", "off", "off", "on", "on", "auto"]
    with pytest.raises(ValueError, match="GATEWAY_PINNED_HOST_CACHE must be auto, on or off"):
        read("pageable")
