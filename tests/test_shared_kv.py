"""One KV cache shared by more requests than `parallel` (kv_unified + sequences), on the real model:
requests run at once as long as their KV fits, and when the running ones outgrow it the newest
pauses and resumes later with the same output it would have had (greedy), nothing lost."""

from __future__ import annotations

import asyncio
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import pytest

from engines.base import SamplingParams, TokenLogprob, Usage
from engines.llamacpp import batch, host_transfer, kv_pool
from engines.llamacpp.engine import LlamaCppEngine
from engines.llamacpp.runtime import LlamaCppOptions
from gateway.chat.template import ChatMessage
from gateway.models.registry import RegistryFile
from tests.chat import chat_request
from tests.test_prefix_cache import TOPICS, _ask, _conversation, _path


async def _engine(**kw: Any) -> LlamaCppEngine:
    path, spec = _path("smollm2-135m-instruct")
    e = LlamaCppEngine(LlamaCppOptions.engine_config(**{"model_path": path, "context_length": 2048, "kv_unified": True,
                                       "prefix_cache_mib": 64, "chat_template": spec.chat_template, **kw}))
    await e.load()
    return e


async def _running_peak(e: LlamaCppEngine, work: Any) -> tuple[Any, int]:
    """Run `work`, sampling how many requests the engine runs at once."""
    peak = 0
    task = asyncio.ensure_future(work)
    while not task.done():
        peak = max(peak, e.health().running)
        await asyncio.sleep(0.005)
    return await task, peak


async def test_more_conversations_than_parallel_run_at_once_in_a_shared_kv() -> None:
    # 2 x 2048 cells shared by up to 8 requests: 8 short conversations all fit at once.
    e = await _engine(parallel=2, sequences=8)
    try:
        assert e.info.parallel == 8
        convs = [_conversation(f"{TOPICS[i % 4]} (number {i})", 1) for i in range(8)]
        results, peak = await _running_peak(e, asyncio.gather(*(_ask(e, c, 16) for c in convs)))
        assert peak > 2, f"at most {peak} requests ran at once: the sequences did not go beyond `parallel`"
        assert all(text for text, _ in results)
        # The next turn of each finds its own KV still on the device (nothing evicted: it fit).
        again = await asyncio.gather(*(_ask(e, _conversation(f"{TOPICS[i % 4]} (number {i})", 2), 16) for i in range(8)))
        assert all(u.cached_tokens >= results[i][1].prompt_tokens - 8 for i, (_, u) in enumerate(again))
        kv = e.health().kv
        assert kv is not None and kv.preemptions == 0 and kv.cells == 2 * 2048
    finally:
        await e.close()


class Story(NamedTuple):
    text: str
    ids: list[int]
    prompt: tuple[int, ...]
    steps: list[TokenLogprob]  # each token's log-probability (and the top 5) as the engine sampled it


async def _story(e: LlamaCppEngine, i: int, n: int, decoding: asyncio.Event | None = None) -> Story:
    """A greedy story of `n` tokens, with each step's log-probabilities (`decoding` is set at its
    first token)."""
    msgs = (ChatMessage("user", f"Story {i}: " + f"{TOPICS[i % 4]} walks to the market and meets a friend. " * 6),)
    story = Story("", [], (), [])
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=True, top_logprobs=5)
    async for ev in e.generate(chat_request(e, msgs, sp, "t")):
        if decoding is not None:
            decoding.set()
        story = story._replace(text=story.text + ev.text,
                               prompt=ev.usage.prompt_ids if ev.usage is not None else story.prompt)
        story.ids.extend(ev.token_ids)
        story.steps.extend(ev.logprobs)
    return story


def _log_softmax(rows: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    x = rows.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))


async def _rescored(e: LlamaCppEngine, s: Story) -> npt.NDArray[np.float64]:
    """The story's generated positions as the model scores the whole sequence at once (prefill
    batches): row j is the distribution the j-th generated token was drawn from."""
    logits = await e.logits(list(s.prompt) + s.ids)
    return _log_softmax(logits[len(s.prompt) - 1:len(s.prompt) - 1 + len(s.ids)])


def _drift(s: Story, rescored: npt.NDArray[np.float64]) -> float:
    """How far the log-probabilities the engine sampled from are from the whole-sequence scoring,
    over each step's token and its top alternatives."""
    return max(abs(logprob - rescored[j, token])
               for j, lp in enumerate(s.steps)
               for token, logprob in [(lp.token_id, lp.logprob), *((t.token_id, t.logprob) for t in lp.top)])


async def _rounding(e: LlamaCppEngine) -> float:
    """How far a step's log-probabilities may drift from the whole-sequence scoring on this device
    through rounding alone: four times the drift of a story decoded alone (nothing paused, nothing
    beside it; batch neighbours and replays add to it), plus a little. The CPU variant decides it
    (AVX2 and AVX-512 kernels round differently: 0.67 and 0.38 nats on a Xeon with both), so it is
    measured, not assumed; and a token lost or repeated (tried on that story) must drift past it,
    or the check could not tell one from rounding here."""
    ref = await _story(e, 99, 160)
    bound = 4 * _drift(ref, await _rescored(e, ref)) + 0.1
    lost = Story(ref.text, ref.ids[:80] + ref.ids[81:], ref.prompt, ref.steps[:80] + ref.steps[81:])
    repeated = Story(ref.text, ref.ids[:81] + ref.ids[80:], ref.prompt, ref.steps[:81] + ref.steps[80:])
    for wrong in (lost, repeated):
        assert _drift(wrong, await _rescored(e, wrong)) > 2 * bound, "a token lost or repeated drifts no further than rounding"
    return bound


async def _assert_greedy(e: LlamaCppEngine, s: Story, bound: float) -> None:
    """Each token is the greedy choice of the step that drew it, and that step saw exactly the text
    before it: its distribution is the whole sequence's scoring within this device's rounding (a
    token lost, repeated or reordered at a pause changes what the model sees, and with it the
    distribution, far beyond rounding)."""
    assert len(s.steps) == len(s.ids) and [lp.token_id for lp in s.steps] == s.ids
    eog = list(e._eog)  # end-of-generation tokens: ignore_eos keeps them from being chosen
    for j, lp in enumerate(s.steps):
        best = max(t.logprob for t in lp.top if t.token_id not in eog)
        assert lp.logprob >= best, (j, lp)  # greedy where it was drawn
    rescored = await _rescored(e, s)
    assert _drift(s, rescored) <= bound, (_drift(s, rescored), bound)
    rescored[:, eog] = -np.inf
    gaps = rescored.max(axis=1) - rescored[np.arange(len(s.ids)), s.ids]
    assert gaps.max() <= 2 * bound, (int(gaps.argmax()), float(gaps.max()), bound)


async def test_requests_that_outgrow_the_shared_kv_pause_and_resume_without_losing_a_token(
        caplog: pytest.LogCaptureFixture) -> None:
    # 512 cells for up to 4 requests of ~90 + 160 tokens: they cannot all keep their KV at once.
    e = await _engine(parallel=1, sequences=4, context_length=512, n_batch=64)
    try:
        rounding = await _rounding(e)
        stories = await asyncio.gather(*(_story(e, i, 160) for i in range(4)))
        kv = e.health().kv
        assert kv is not None and kv.preemptions >= 1, "the requests fit: the test does not test pausing"
        for s in stories:
            assert len(s.ids) == 160 and len(s.prompt) > 64
            # Every token sent once, in order: the text is exactly the tokens' text.
            assert s.text == b"".join(e.piece(t) for t in s.ids).decode("utf-8", errors="replace")
            # Each token is the greedy choice, pause or not (a token lost or repeated at a pause
            # would not be).
            await _assert_greedy(e, s, rounding)
        # Again, one at a time: each finds its state in the host cache or a sequence, and a restore
        # first makes room for the whole entry (idle sequences' KV gives way) instead of failing.
        for i in range(4):
            await _story(e, i, 8)
        assert not [r for r in caplog.records if "did not load" in r.getMessage()]
    finally:
        await e.close()


@pytest.mark.parametrize(("grace", "payback"), [(0.0, 0.0), (60.0, 0.0), (0.0, 1e6)])
async def test_idle_kv_gives_way_when_it_outgrows_the_running_requests(
        grace: float, payback: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp attends over every used cell of a shared cache, so idle sequences' KV costs every
    running token: beyond what the running requests hold, it moves to the host cache (least
    recently used first) and the next turns restore it from there, whole. Not before it has been
    idle for IDLE_TRIM_S, nor before the running passes have paid TRIM_PAYBACK times its copies
    for it: a conversation back sooner finds its KV in place."""
    monkeypatch.setattr(kv_pool, "IDLE_TRIM_S", grace)
    monkeypatch.setattr(batch, "TRIM_PAYBACK", payback)
    e = await _engine(parallel=2, sequences=4)
    try:
        async def turn(i: int, turns: int) -> Usage:
            usage = None
            async for ev in e.generate(chat_request(e, _conversation(TOPICS[i], turns), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), "t")):
                usage = ev.usage or usage
            assert usage is not None
            return usage

        # Three conversations at once (one that finishes a step before the others may already
        # give way to them).
        firsts = await asyncio.gather(*(turn(i, 1) for i in range(3)))
        before = e.health().kv
        assert before is not None and before.idle > 0
        # A request of ~190 tokens runs beside the idle KV (2 or 3 conversations of ~136): while it
        # does, idle KV is at most its own, one conversation's.
        during = None
        msgs = _conversation(TOPICS[3], 1)[:-1] + (ChatMessage(
            "user", f"Turn 0: tell me more about {TOPICS[3]}, with names, places and dates. " * 6),)
        async for _ev in e.generate(chat_request(e, msgs, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), "t")):
            during = during or e.health().kv  # after its first token: its prompt is in
        assert during is not None
        evicted = e.health().kv.idle_evictions  # type: ignore[union-attr]
        if payback:  # the request's passes were charged for the idle cells, far below what moving them costs
            idle = [s for s in e._sched._slots if s.cached and s.job is None]  # type: ignore[union-attr]
            assert any(s.trim_memo[3] for s in idle), [s.trim_memo for s in idle]  # priced, not vacuous
            assert all(0 < s.idle_cost < payback * s.trim_memo[3] for s in idle if s.trim_memo[3]), \
                [(s.idle_cost, s.trim_memo) for s in idle]
        if grace or payback:  # nothing moved yet: the next turns find their KV in place
            assert evicted == before.idle_evictions == 0 and during.idle == before.idle, (before, during)
            nexts = await asyncio.gather(*(turn(i, 2) for i in range(3)))
            for first, u in zip(firsts, nexts, strict=True):
                assert u.cached_tokens >= first.prompt_tokens - 8 and u.restored_tokens == 0, (first, u)
            return
        assert 0 < during.idle <= during.used - during.idle, during
        assert 1 <= evicted - before.idle_evictions and evicted < 3, (before, evicted)
        # The next turns, whole: the evicted conversations' from the host cache (the first to start
        # may evict more of the others: each comes back whole all the same), the others' in place.
        nexts = await asyncio.gather(*(turn(i, 2) for i in range(3)))
        for first, u in zip(firsts, nexts, strict=True):
            assert u.cached_tokens >= first.prompt_tokens - 8, (first, u)
        assert sum(u.restored_tokens > 0 for u in nexts) >= evicted, (evicted, nexts)
    finally:
        await e.close()


async def test_idle_kv_stays_when_saving_it_would_push_another_conversation_out_of_the_host_cache(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A host cache with room for one conversation: X's idle KV goes there when a short request
    runs; later A's idle KV, which would push X out, stays on the device (X's next turn still
    restores from the host cache, A's finds its KV in place)."""
    monkeypatch.setattr(kv_pool, "IDLE_TRIM_S", 0.0)
    monkeypatch.setattr(batch, "TRIM_PAYBACK", 0.0)
    e = await _engine(parallel=2, sequences=4, prefix_cache_mib=16)
    try:
        async def ask(msgs: tuple[ChatMessage, ...], n: int) -> Usage:
            usage = None
            async for ev in e.generate(chat_request(e, msgs, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), "t")):
                usage = ev.usage or usage
            assert usage is not None
            return usage

        short = (ChatMessage("user", "Hi."),)
        x1 = await ask(_conversation(TOPICS[0], 3), 4)  # ~10 MB of KV: long enough to be worth a save anywhere
        await ask(short, 24)  # X's idle KV outgrows this one's: to the host cache (empty: room)
        host = e._sched.host_cache  # type: ignore[union-attr]
        assert host is not None and len(host) == 1 and host.bytes > 8 << 20, (len(host), host.bytes)
        a1 = await ask(_conversation(TOPICS[1], 3), 4)
        await ask(short, 24)  # A's would push X's entry out: it stays
        assert len(host) == 1 and host.saved == 1, (len(host), host.saved)  # X's entry, still alone
        a2 = await ask(_conversation(TOPICS[1], 4), 4)
        assert a2.cached_tokens >= a1.prompt_tokens - 8 and a2.restored_tokens == 0, a2
        x2 = await ask(_conversation(TOPICS[0], 4), 4)
        assert x2.restored_tokens >= x1.prompt_tokens - 8, x2
    finally:
        await e.close()


async def test_idle_kv_that_another_sequence_holds_leaves_without_a_save(monkeypatch: pytest.MonkeyPatch) -> None:
    """A next turn whose history differs from its sequence's KV after the shared part by more than a
    few tokens takes an empty sequence and shares the prefix's cells. When the old sequence's KV
    later gives way, it is not copied to the host cache: another sequence holds all of it but a
    tail that prefills again in a moment (on the H100 such a save of 1.4 GiB stopped every stream
    for 44 ms and pushed other conversations' entries out)."""
    monkeypatch.setattr(kv_pool, "IDLE_TRIM_S", 0.0)
    monkeypatch.setattr(batch, "TRIM_PAYBACK", 0.0)
    # A tail of 23 tokens prefills again in less than a second on any machine (this 2-core one's
    # first measured rate: 250 tokens/s); the whole conversation (~440 tokens) does not.
    monkeypatch.setattr(host_transfer, "MIN_SAVE_GAIN_S", 1.0)
    e = await _engine(parallel=2, sequences=4)
    try:
        first = _conversation(TOPICS[0], 3)
        _, u1 = await _ask(e, first, 24)  # its KV: the prompt and 23 generated tokens
        host = e._sched.host_cache  # type: ignore[union-attr]
        assert host is not None
        saved, skipped = host.saved, host.skipped_saves
        # The same history, but a different last answer than the one generated: 23 tokens differ.
        nxt = first + (ChatMessage("assistant", "Something else entirely, said differently."),
                       ChatMessage("user", "And then?"))
        _, u2 = await _ask(e, nxt, 4)
        assert u2.cached_tokens >= u1.prompt_tokens - 8, u2  # the prefix from the first sequence's cells
        # The first turn's KV outgrows the next turn's (or later a short request's) and gives way,
        # without a copy; the next turn's, which holds the shared prefix, goes to the host cache.
        await _ask(e, (ChatMessage("user", "Hi."),), 24)
        kv = e.health().kv
        assert kv is not None and kv.idle_evictions >= 1, kv
        assert host.skipped_saves > skipped, (host.skipped_saves, skipped)
        assert host.saved - saved <= kv.idle_evictions - 1, (host.saved, saved, kv)
        # The conversation's next turn still gets its whole history from the host cache.
        _, u3 = await _ask(e, nxt + (ChatMessage("assistant", "Fine."), ChatMessage("user", "More?")), 4)
        assert u3.cached_tokens >= u2.prompt_tokens - 8, u3
    finally:
        await e.close()


async def test_a_new_conversation_takes_the_sequence_whose_kv_is_held_elsewhere() -> None:
    """Every sequence holds KV: a new conversation takes the one whose KV another sequence also holds
    (a conversation whose next turn went to an empty sequence and shares its cells), not the one
    idle longest, another conversation's only copy, which then stays for that conversation's next
    turn. (On the H100 agent replay the idle-longest rule cost a session a save and a restore.)"""
    e = await _engine(parallel=2, sequences=4, prefix_cache_mib=0)
    try:
        b1, c1, a1 = (_conversation(t, 1) for t in TOPICS[1:4])
        _, b_first = await _ask(e, b1, 24)  # B is idle longest
        await _ask(e, c1, 24)
        await _ask(e, a1, 24)
        # A's next turn with another answer than the one generated: it takes the empty sequence
        # and shares the prefix of A's first turn, whose sequence now holds a stale copy.
        a2 = a1 + (ChatMessage("assistant", "Something else entirely, said differently."), ChatMessage("user", "And then?"))
        _, u = await _ask(e, a2, 4)
        assert u.cached_tokens > 0 and e._sched is not None and not any(s.job for s in e._sched._slots)
        assert all(s.cached for s in e._sched._slots), "every sequence holds KV"
        await _ask(e, _conversation(TOPICS[0], 1), 4)  # a new conversation: no sequence holds it
        # B's KV was still on the device (no host cache: it would have been lost).
        _, b_next = await _ask(e, _conversation(TOPICS[1], 2, ["Another answer. " * 3]), 4)
        assert b_next.cached_tokens >= b_first.prompt_tokens - 8, b_next
    finally:
        await e.close()


def test_sequences_need_a_shared_kv() -> None:
    base = {"id": "m", "formats": {"gguf": {"path": "/x.gguf"}}, "parallel": 2, "sequences": 8}
    with pytest.raises(ValueError, match="kv_unified"):
        RegistryFile.model_validate({"models": [base]})
    ok = RegistryFile.model_validate({"models": [{**base, "kv_unified": True}]})
    assert ok.models[0].sequences == 8


async def test_sliding_window_sessions_in_a_shared_kv_keep_their_windows_for_the_next_turn() -> None:
    """Gemma-3 (sliding-window layers) with 4 sessions in 2 sequences' KV: a window cache shared by
    several sequences keeps each one's window and no more, and the next turn still reuses the whole
    previous turn (it did not when the scheduler asked for one position more than the next token
    attends to: half the sessions prefilled everything again)."""
    import random

    def text_of(n_words: int, seed: int) -> str:
        rng = random.Random(seed)
        return " ".join(rng.choice(("file", "tool", "call", "path", "read", "write", "shell", "patch", "test", "json"))
                        for _ in range(n_words))

    path, spec = _path("gemma-3-270m")
    e = LlamaCppEngine(LlamaCppOptions.engine_config(model_path=path, context_length=4096, parallel=2, kv_unified=True,
                                                     sequences=4, prefix_cache_mib=0, chat_template=spec.chat_template))
    await e.load()
    try:
        sessions = [[ChatMessage("user", "Instructions and tools:\n" + text_of(900, 1000 + i))] for i in range(4)]
        firsts = await asyncio.gather(*(_ask(e, tuple(s), 16) for s in sessions))
        for s, (text, _) in zip(sessions, firsts, strict=True):
            s += [ChatMessage("assistant", text), ChatMessage("user", "Step 1: " + text_of(60, 7))]
        nexts = await asyncio.gather(*(_ask(e, tuple(s), 4) for s in sessions))
        for (_, first), (_, u) in zip(firsts, nexts, strict=True):
            assert u.cached_tokens >= first.prompt_tokens, (u.cached_tokens, first.prompt_tokens)
        # No host cache: the KV cache is reported all the same (idle KV stayed: nowhere else to go).
        health = e.health()
        assert health.prefix_cache is None and health.kv is not None and health.kv.cells == 2 * 4096
        assert health.kv.idle_evictions == 0 and health.kv.idle == health.kv.used > 0
    finally:
        await e.close()


async def test_a_conversation_whose_answer_tokenizes_differently_keeps_its_own_sequence() -> None:
    """Every sequence holds a conversation: a next turn whose history differs from the sequence's KV
    from the answer on (the client sent the answer back differently) goes to its own sequence and
    cuts only that tail, instead of taking the sequence idle longest, another conversation's."""
    e = await _engine(parallel=2, sequences=2)
    try:
        # A is the longer conversation: B's idle KV never outgrows A's running one (it would move
        # to the host cache, kv_pool.trim).
        b1, a1 = _conversation(TOPICS[1], 1), _conversation(TOPICS[0], 2)
        b = asyncio.ensure_future(_ask(e, b1, 4))  # B finishes first: its sequence is idle longest
        _, a_first = await _ask(e, a1, 24)
        _, b_first = await b
        a2 = _conversation(TOPICS[0], 3, [f"Here is part 0 of the story of {TOPICS[0]}. " * 6,
                                          "A different answer, not the one the model gave. " * 3])
        _, a_next = await _ask(e, a2, 4)
        assert a_next.cached_tokens >= a_first.prompt_tokens - 8
        b2 = _conversation(TOPICS[1], 2, ["Another answer. " * 3])
        _, b_next = await _ask(e, b2, 4)
        # B's KV was still on the device: nothing restored from the host cache.
        assert b_next.cached_tokens >= b_first.prompt_tokens - 8 and b_next.restored_tokens == 0, b_next
    finally:
        await e.close()


async def test_the_memory_estimate_counts_a_shared_cache_as_llama_cpp_allocates_it(
        caplog: pytest.LogCaptureFixture) -> None:
    """A shared cache's sliding-window layers hold a window per sequence (llama.cpp's unified
    layout), not per `parallel`: the estimate the residency budget uses is the KV llama.cpp
    allocates (its log: "KV buffer size"), for Gemma-3 (window layers) and SmolLM2 (none)."""
    import logging
    import re

    from gateway.models.memory import MiB, estimate, gguf_info

    caplog.set_level(logging.DEBUG, logger="llama.cpp")
    for model, ctx in (("gemma-3-270m", 4096), ("smollm2-135m-instruct", 2048)):
        caplog.clear()
        path, spec = _path(model)
        e = LlamaCppEngine(LlamaCppOptions.engine_config(model_path=path, context_length=ctx, parallel=2, kv_unified=True,
                                                         sequences=4, prefix_cache_mib=0, chat_template=spec.chat_template))
        await e.load()
        await e.close()
        allocated = sum(float(m.group(1)) for r in caplog.records
                        if (m := re.search(r"KV buffer size = +([0-9.]+) MiB", r.getMessage())))
        info = gguf_info(path)
        assert info is not None
        assert abs(estimate(info, ctx, 2, shared=4).parts["kv"] / MiB - allocated) < 0.01, (model, allocated)


@pytest.mark.parametrize("split", ["auto", "off"])
async def test_a_prompt_beside_running_streams_takes_a_pass_of_its_own_on_the_cpu(
        split: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The shared layout on the CPU: a step with a running stream's token and a prompt chunk runs
    # them as two passes (engines.llamacpp.batch, `_split_pass`), and both outputs stay greedy.
    monkeypatch.setenv("GATEWAY_SPLIT_MIXED", split)
    e = await _engine(parallel=2, sequences=2, n_batch=64)
    try:
        rounding = await _rounding(e)
        decoding = asyncio.Event()
        first = asyncio.ensure_future(_story(e, 0, 96, decoding))
        await decoding.wait()  # its prompt is in: it decodes when the second one arrives
        second = await _story(e, 1, 16)
        assert not first.done(), "the first story ended before the second started: nothing to test"
        stories = [await first, second]
        assert (e._sched.split_steps > 0) == (split == "auto"), e._sched.split_steps
        for s in stories:
            await _assert_greedy(e, s, rounding)
    finally:
        await e.close()


def test_mixed_steps_run_as_two_passes_on_the_cpu_only_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    from engines.llamacpp.engine import split_mixed

    monkeypatch.delenv("GATEWAY_SPLIT_MIXED", raising=False)
    assert split_mixed("cpu") and not split_mixed("cuda") and not split_mixed("vulkan")
    monkeypatch.setenv("GATEWAY_SPLIT_MIXED", "on")
    assert split_mixed("cuda")
    monkeypatch.setenv("GATEWAY_SPLIT_MIXED", "off")
    assert not split_mixed("cpu")


# --- `gateway serve --sequences N`: the shared layout from the command line ------------------------


def test_serve_sequences_runs_that_many_requests_at_once_in_a_shared_kv(tmp_path: Any) -> None:
    import time

    import httpx

    from tests.test_production import MODEL, Gateway, Stream

    g = Gateway(tmp_path, "--parallel", "2", "--sequences", "4", "--max-queue-wait", "600")
    try:
        model = httpx.get(f"{g.url}/health", timeout=10).json()["models"][MODEL]
        assert model["kv_layout"].startswith("shared by 4 sequences"), model
        streams = [Stream(g.url, max_tokens=400) for _ in range(4)]
        peak, deadline = 0, time.monotonic() + 120
        while peak < 4 and time.monotonic() < deadline and not any(s.done.is_set() for s in streams):
            peak = max(peak, httpx.get(f"{g.url}/health", timeout=10).json()["models"][MODEL]["running"])
            time.sleep(0.05)
        assert peak == 4, f"at most {peak} of 4 requests ran at once with --parallel 2 --sequences 4"
        for s in streams:
            assert s.done.wait(300) and s.status == 200 and s.frames[-1] == "[DONE]", s.frames[-3:]
    finally:
        g.stop()


@pytest.mark.parametrize("args", [["--sequences", "0"], ["--sequences", "300"], ["--memory-budget", "lots"]])
def test_a_malformed_serve_option_is_a_one_line_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.cli import main

    try:
        rc = main(["serve", *args])
    except SystemExit as exc:  # argparse's own refusal: the usage, then one line naming the flag
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and "error: " in last and args[0] in last, err
