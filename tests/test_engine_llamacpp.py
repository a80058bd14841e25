"""The llama.cpp engine on the real models: logits, templates, prefix reuse, isolation."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from engines.base import Constraint, ContextLengthExceeded, EngineConfig, GenerationRequest, SamplingParams
from engines.llamacpp.engine import LlamaCppEngine
from engines.llamacpp.runtime import LlamaCppOptions
from engines.llamacpp.sampling import IDLE_DETACH_S
from gateway.chat.template import ChatMessage
from gateway.models.registry import load_registry
from tests.chat import chat_request
from tests.conftest import ROOT


async def _engine(model: str, cache: Path | None = None, **kw: object) -> LlamaCppEngine:
    reg = load_registry(ROOT / "models.yaml", cache_dir=cache)
    spec = reg.models[model]
    path = reg.resolve(spec, "gguf")
    e = LlamaCppEngine(LlamaCppOptions.engine_config(model_path=str(path), context_length=512, chat_template=spec.chat_template,
                                                     **kw))
    await e.load()
    return e


@pytest.fixture(scope="module")
async def smol() -> AsyncIterator[LlamaCppEngine]:
    e = await _engine("smollm2-135m-instruct", parallel=4)
    yield e
    await e.close()


def _req(prompt: str, **sp: object) -> GenerationRequest:
    return GenerationRequest("t", SamplingParams(temperature=0, **sp), prompt=prompt)  # type: ignore[arg-type]


async def _run(e: LlamaCppEngine, req: GenerationRequest) -> tuple[list[int], str]:
    toks: list[int] = []
    text = ""
    async for ev in e.generate(req):
        toks += ev.token_ids
        text += ev.text
    return toks, text


async def test_logits_agree_with_greedy_generation(smol: LlamaCppEngine) -> None:
    prompt = "The quick brown fox"
    ids = await smol.tokenize(prompt)
    toks, _ = await _run(smol, _req(prompt, max_tokens=4))
    logits = await smol.logits(ids + toks[:-1])
    assert logits.shape == (len(ids) + 3, smol._n_vocab)
    # Teacher-forced argmax at each generated position reproduces greedy decoding.
    assert [int(x) for x in logits[len(ids) - 1 :].argmax(axis=1)] == toks
    again = await smol.logits(ids + toks[:-1])
    np.testing.assert_allclose(again, logits, rtol=0, atol=1e-4)


async def test_prefix_reuse_reports_cached_tokens(smol: LlamaCppEngine) -> None:
    msgs = (ChatMessage("system", "You are helpful. " * 10), ChatMessage("user", "Hello"))
    req = chat_request(smol, msgs, SamplingParams(temperature=0, max_tokens=3))
    first = [ev async for ev in smol.generate(req)][-1]
    second = [ev async for ev in smol.generate(req)][-1]
    assert first.usage and second.usage
    assert first.usage.cached_tokens < first.usage.prompt_tokens - 1
    assert second.usage.cached_tokens == second.usage.prompt_tokens - 1


async def test_cancelling_one_stream_leaves_others_intact(smol: LlamaCppEngine) -> None:
    alone = await _run(smol, _req("Once upon a time", max_tokens=24))

    async def cancelled() -> None:
        agen = smol.generate(_req("A different story begins", max_tokens=200, ignore_eos=True))
        async for _ in agen:
            await agen.aclose()
            break

    results = await asyncio.gather(_run(smol, _req("Once upon a time", max_tokens=24)), cancelled())
    assert results[0] == alone
    assert smol.health().running == 0


async def test_context_length_is_checked_before_generation(smol: LlamaCppEngine) -> None:
    with pytest.raises(ContextLengthExceeded):
        await _run(smol, _req("word " * 600, max_tokens=2))


async def test_gemma_template_and_generation(tmp_path: Path) -> None:
    e = await _engine("gemma-3-270m", cache=tmp_path, parallel=1)
    try:
        req = chat_request(e, (ChatMessage("user", "Say hi"),), SamplingParams(temperature=0, max_tokens=6), "g")
        ids = e.prompt_tokens(req)
        assert ids.count(ids[0]) == 1, "BOS must not be doubled"
        assert e.encode("<start_of_turn>", add_special=False)[0] in ids  # special tokens parsed
        _, text = await _run(e, req)
        assert text.strip()
    finally:
        await e.close()


async def test_a_running_streams_prefix_is_copied_to_a_new_request() -> None:
    """A shared system prompt is prefilled once: the second request copies the first one's KV
    (llama_memory_seq_cp across sequences) and still generates exactly what it would alone."""
    system = ChatMessage("system", "You are a careful assistant who answers in one short sentence. " * 6)
    e = await _engine("smollm2-135m-instruct", parallel=2)
    alone = await _engine("smollm2-135m-instruct", parallel=1)
    long_req = chat_request(e, (system, ChatMessage("user", "Tell a long story.")),
                            SamplingParams(temperature=0, max_tokens=400, ignore_eos=True), "a")
    short = chat_request(e, (system, ChatMessage("user", "What is two plus two?")),
                         SamplingParams(temperature=0, max_tokens=12), "b")
    try:
        agen = e.generate(long_req)
        await agen.__anext__()  # the long stream is running and holds the system prompt's KV
        events = [ev async for ev in e.generate(short)]
        await agen.aclose()
        usage = events[-1].usage
        assert usage is not None and e._sched is not None
        assert e._sched.prefix_copies == 1
        assert usage.cached_tokens >= 60, usage  # the system prompt came from the other sequence
        reference = "".join([ev.text async for ev in alone.generate(short)])
        assert "".join(ev.text for ev in events) == reference
    finally:
        await e.close()
        await alone.close()


@pytest.mark.parametrize("kv_unified", [False, True])
async def test_requests_sharing_a_prompt_prefill_it_once(kv_unified: bool) -> None:
    """Requests that arrive together with one long system prompt (n choices, agents' sessions
    opened at once) compute it once: the later ones wait for the first one's prefill and copy its
    KV, in either KV layout, and each still generates exactly what it would alone."""
    system = ChatMessage("system", "You are a careful assistant who answers in one short sentence. " * 20)
    # Chunks of 64 tokens: the shared prompt (~260 tokens) takes several steps to prefill.
    e = await _engine("smollm2-135m-instruct", parallel=3, n_batch=64, kv_unified=kv_unified)
    reqs = [chat_request(e, (system, ChatMessage("user", q)), SamplingParams(temperature=0, max_tokens=8), f"r{i}")
            for i, q in enumerate(["What is two plus two?", "Name a colour.", "Say hello."])]
    alone = await _engine("smollm2-135m-instruct", parallel=1)
    try:
        together = await asyncio.gather(*[_events(e, r) for r in reqs])
        kv = e.health().kv
        assert kv is not None and kv.prefix_follows == 2 and kv.prefix_copies >= 2, kv
        shared = len(e.prompt_tokens(reqs[0])) - 12  # the system prompt and the turn's opening
        cached = sorted(evs[-1].usage.cached_tokens for evs in together)  # type: ignore[union-attr]
        assert cached[0] == 0 and cached[1] >= shared and cached[2] >= shared, cached
        for r, evs in zip(reqs, together, strict=True):
            reference = "".join([ev.text async for ev in alone.generate(r)])
            assert "".join(ev.text for ev in evs) == reference  # type: ignore[attr-defined]
    finally:
        await e.close()
        await alone.close()


async def _until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting for the scheduler"
        await asyncio.sleep(0.005)


async def test_a_request_waiting_for_a_cancelled_prefill_computes_it_itself() -> None:
    """The request whose prefill another waits for is cancelled halfway: the waiting one takes what
    was computed and prefills the rest, with the same greedy text as alone."""
    system = ChatMessage("system", "You are a careful assistant who answers in one short sentence. " * 20)
    e = await _engine("smollm2-135m-instruct", parallel=2, n_batch=8)
    alone = await _engine("smollm2-135m-instruct", parallel=1)
    first = chat_request(e, (system, ChatMessage("user", "Hi.")), SamplingParams(temperature=0, max_tokens=8), "a")
    second = chat_request(e, (system, ChatMessage("user", "Name a colour.")), SamplingParams(temperature=0, max_tokens=8), "b")
    try:
        assert e._sched is not None
        leader_gen = e.generate(first)
        leader = asyncio.ensure_future(leader_gen.__anext__())
        await _until(lambda: any(s.job is not None and s.n_fed > 0 for s in e._sched._slots))  # type: ignore[union-attr]
        follower = asyncio.ensure_future(_events(e, second))
        await _until(lambda: any(s.follow is not None for s in e._sched._slots))  # type: ignore[union-attr]
        leader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await leader
        await leader_gen.aclose()
        events = await follower
        assert e._sched.prefix_follows == 1
        usage = events[-1].usage  # type: ignore[attr-defined]
        assert usage is not None and 0 < usage.cached_tokens < len(e.prompt_tokens(second)) - 12, usage
        reference = "".join([ev.text async for ev in alone.generate(second)])
        assert "".join(ev.text for ev in events) == reference  # type: ignore[attr-defined]
    finally:
        await e.close()
        await alone.close()


async def test_requests_take_the_lowest_free_sequence_ids() -> None:
    """llama.cpp attends over the KV streams from the lowest to the highest sequence id of a step, so
    new requests must pack into the low ids even when a higher slot holds a longer cached prefix."""
    e = await _engine("smollm2-135m-instruct", parallel=4)
    try:
        # Fill all four slots, each with its own cached prompt.
        tail = " is a word that starts this prompt, which goes on for a while so that it is long enough"
        await asyncio.gather(*(_run(e, _req(w + tail, max_tokens=2))
                               for w in ("Apple", "Banana", "Cherry", "Damson")))
        cached = {s.seq_id: list(s.cached) for s in e._sched._slots}
        # Two requests whose prompts share a long prefix with slots 2 and 3: they still run on 0 and 1.
        seen: set[int] = set()

        async def one(prompt: str) -> None:
            async for _ in e.generate(_req(prompt, max_tokens=3)):
                seen.update(s.seq_id for s in e._sched._slots if s.job is not None)

        await asyncio.gather(one("Cherry" + tail + ", again"), one("Damson" + tail + ", again"))
        assert seen == {0, 1}, (seen, {k: len(v) for k, v in cached.items()})
        assert e._sched.prefix_copies >= 2  # their prefixes came by copy from slots 2 and 3
    finally:
        await e.close()


# --- sampling on the device, speculative decoding ---------------------------------------------

CODE = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    if n < 2:
        return n
    a, b = 0, 1
    for _ in range(n - 1):
        a, b = b, a + b
    return b


def factorial(n):
    """Return n factorial."""
    result = 1
    for i in range(2, n + 1):
        result *= i
    return result
'''

# Requests of every kind the two sampling paths must agree on.
MIXED = [
    _req("Write a poem about the sea.", max_tokens=40, ignore_eos=True),
    GenerationRequest("t", SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=7, max_tokens=40),
                      prompt="Once upon a time"),
    _req("List colors:", max_tokens=32, repeat_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2),
    _req("Say yes", max_tokens=8, logprobs=True, top_logprobs=2),  # needs the host's logits
    _req("Name a fruit", max_tokens=16, logit_bias=((28, -100.0), (30, 5.0))),
    _req("Give a JSON object with a name:", max_tokens=24, constraint=Constraint("json")),  # a grammar
    _req("Count to ten:", max_tokens=40, stop=(" 7",)),
]


async def _all(e: LlamaCppEngine, reqs: list[GenerationRequest]) -> list[tuple[list[int], str]]:
    out = [await _run(e, r) for r in reqs]  # one after another: a chain per kind of request
    out += await asyncio.gather(*(_run(e, r) for r in reqs[:4]))  # and side by side
    return out


async def test_device_sampling_matches_host_sampling() -> None:
    """The sampler chains run inside llama.cpp's graph (here on its CPU backend, the same code path as on a
    GPU): greedy, seeded top-k/top-p/min-p, penalties and logit bias give the host's tokens; grammar and
    logprobs requests go back to the host on the same sequences."""
    host = await _engine("smollm2-135m-instruct", parallel=4, device_sampling="off")
    dev = await _engine("smollm2-135m-instruct", parallel=4, device_sampling="on")
    try:
        assert (host.info.extra["sampling"], dev.info.extra["sampling"]) == ("host", "device")
        expected = await _all(host, MIXED)
        got = await _all(dev, MIXED)
        for want, have, req in zip(expected, got, MIXED + MIXED[:4], strict=True):
            assert have == want, req.sampling
        assert dev._sched is not None and dev._sched._device.attaches >= 4
    finally:
        await host.close()
        await dev.close()


async def test_a_chain_is_attached_after_the_first_tokens_and_the_text_is_the_hosts() -> None:
    """Attaching a chain re-reserves llama.cpp's graphs (~46 ms for an 8B model on the H100), a
    stall that would sit in the request's time to its first token: a greedy or unseeded request on
    a sequence without a chain samples its first tokens on the host and gets its chain attached
    once no request waits for a first token. Greedy, with penalties or not, the tokens are the
    host's; a seeded one gets its chain at once (the device's random stream would not go on from
    the host's), and its text is the host's too."""
    host = await _engine("smollm2-135m-instruct", parallel=2, device_sampling="off")
    dev = await _engine("smollm2-135m-instruct", parallel=2, device_sampling="on")
    try:
        assert dev._sched is not None
        greedy = [_req("Write a poem about the sea.", max_tokens=24, ignore_eos=True),
                  _req("List colors:", max_tokens=24, repeat_penalty=1.3, frequency_penalty=0.5)]
        seeded = MIXED[1]
        want = await asyncio.gather(*(_run(host, r) for r in greedy))
        got = await asyncio.gather(*(_run(dev, r) for r in greedy))  # two at once, both without a chain
        assert got == want
        assert dev._sched._device.deferred == 2 and dev._sched._device.attaches == 2
        assert all(s.device_chain is not None for s in dev._sched._slots)  # attached mid-request
        await asyncio.sleep(IDLE_DETACH_S + 0.5)  # detached when idle
        assert all(s.device_chain is None for s in dev._sched._slots)
        assert await _run(dev, seeded) == await _run(host, seeded)
        assert dev._sched._device.deferred == 2 and dev._sched._device.attaches == 3
    finally:
        await host.close()
        await dev.close()


async def test_a_device_sampler_is_reused_by_requests_with_the_same_settings() -> None:
    """Attaching a chain makes llama.cpp re-reserve its graphs, so a sequence keeps its chain (reset per
    request) while requests keep the same settings; a request that needs the host detaches it."""
    e = await _engine("smollm2-135m-instruct", parallel=1, device_sampling="on")
    try:
        assert e._sched is not None
        req = GenerationRequest("t", SamplingParams(temperature=0.9, top_k=40, seed=11, max_tokens=24), prompt="Hello")
        first = await _run(e, req)
        assert await _run(e, req) == first  # reset re-seeds: same seed, same text
        assert await _run(e, req) == first
        assert e._sched._device.attaches == 1
        await _run(e, _req("Hello", max_tokens=4, logprobs=True))
        assert e._sched._slots[0].device_chain is None
        assert await _run(e, req) == first
        assert e._sched._device.attaches == 2
        # An idle sequence gives its chain back after IDLE_DETACH_S (llama.cpp builds every attached
        # chain into every step's graph), even when no request comes to wake the scheduler.
        await asyncio.sleep(IDLE_DETACH_S + 0.5)
        assert e._sched._slots[0].device_chain is None
        assert await _run(e, req) == first
        assert e._sched._device.attaches == 3
    finally:
        await e.close()


async def test_speculative_decoding_changes_speed_not_text() -> None:
    """n-gram drafts from the prompt are verified in one batch: on a prompt the model copies from, most
    draft tokens are accepted, and the output (greedy, seeded sampling, stops, grammars, logprobs, the
    max_tokens limit) is exactly what plain decoding gives."""
    copy = _req("# file a.py\n" + CODE + "\n\n# file b.py, a copy of a.py\n" + CODE[:30], max_tokens=120,
                ignore_eos=True)
    reqs = [copy, *MIXED, GenerationRequest("t", SamplingParams(temperature=0.7, seed=5, max_tokens=60),
                                            prompt=CODE + "\n" + CODE[:40]),
            _req(CODE + "\n" + CODE[:60], max_tokens=33, logprobs=True, top_logprobs=3)]
    plain = await _engine("smollm2-135m-instruct", parallel=4)
    spec = await _engine("smollm2-135m-instruct", parallel=4, draft_ngram=3, draft_max=8, draft_streams=4)
    try:
        assert spec.info.extra["speculative"] == "ngram 3, up to 8, at most 4 streams"
        events = [ev async for ev in spec.generate(copy)]
        usage = events[-1].usage
        assert usage is not None and usage.completion_tokens == 120
        assert usage.draft_tokens > 0 and usage.accepted_draft_tokens >= usage.draft_tokens // 3, usage
        # Both engines go through the same requests in the same order: the same prefix-cache states
        # (a prompt prefilled whole or from the cache can differ in the last bits of its logits).
        assert [t for ev in events for t in ev.token_ids] == (await _run(plain, copy))[0]
        expected = await _all(plain, reqs)
        got = await _all(spec, reqs)
        for want, have, req in zip(expected, got, reqs + reqs[:4], strict=True):
            assert have == want, req.sampling
        assert spec._sched is not None and spec._sched._spec.accepted > 0
        # The KV cache holds no rejected drafts: the next turn reuses the prefix and still agrees.
        follow = _req("# file a.py\n" + CODE + "\n\n# file b.py, a copy of a.py\n" + CODE[:30] + expected[0][1][:40],
                      max_tokens=20)
        assert await _run(spec, follow) == await _run(plain, follow)
    finally:
        await plain.close()
        await spec.close()


async def test_drafts_stop_when_more_streams_decode_than_allowed() -> None:
    """Verifying drafts costs the whole step (the logits of every draft position come back), so a
    model drafts only while at most `draft_streams` sequences are decoding."""
    copy = _req("# file a.py\n" + CODE + "\n\n# file b.py, a copy of a.py\n" + CODE[:30], max_tokens=60, ignore_eos=True)
    drafted = {}
    for streams in (1, 3):
        e = await _engine("smollm2-135m-instruct", parallel=3, draft_ngram=3, draft_max=8, draft_streams=streams)
        try:
            outs = await asyncio.gather(*(_run(e, copy) for _ in range(3)))
            assert all(len(toks) == 60 for toks, _ in outs)
            assert e._sched is not None
            drafted[streams] = e._sched._spec.drafted
        finally:
            await e.close()
    assert drafted[3] > 0 and drafted[1] < drafted[3] / 2, drafted


async def _events(e: LlamaCppEngine, req: GenerationRequest) -> list[object]:
    return [ev async for ev in e.generate(req)]


@pytest.mark.parametrize(("cut", "replay"), [(1, True), (9, True), (23, True), (9, False)])
async def test_a_resumed_request_continues_exactly_where_the_tokens_stop(smol: LlamaCppEngine, cut: int,
                                                                         replay: bool) -> None:
    """Failover's engine half: given the tokens already sent, the engine emits only what follows;
    replayed one per step, greedy output equals an uninterrupted run's (the prompt is cached for
    both, so its prefill has the same shape); usage counts every token once."""
    chat = (ChatMessage("user", "Tell a long story about a lighthouse keeper."),)
    whole = chat_request(smol, chat, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), "w")
    await _events(smol, whole)  # the prompt is in the cache for both runs below
    evs = await _events(smol, whole)
    toks = [t for ev in evs for t in ev.token_ids]  # type: ignore[attr-defined]
    sent = "".join(ev.text for ev in evs[:cut])  # type: ignore[attr-defined]
    text = "".join(ev.text for ev in evs)  # type: ignore[attr-defined]
    resumed = await _events(smol, replace(whole, request_id="r", resume_ids=tuple(toks[:cut]),
                                                  resume_replay=replay))
    got = [t for ev in resumed for t in ev.token_ids]  # type: ignore[attr-defined]
    assert len(got) == 48 - cut
    if replay:
        assert got == toks[cut:]
        assert sent + "".join(ev.text for ev in resumed) == text  # type: ignore[attr-defined]
    last, first_last = resumed[-1], evs[-1]
    assert last.finish_reason == "length" and last.usage.completion_tokens == 48  # type: ignore[attr-defined]
    assert last.usage.prompt_tokens == first_last.usage.prompt_tokens  # type: ignore[attr-defined]
    assert last.usage.prompt_ids == first_last.usage.prompt_ids  # type: ignore[attr-defined]


async def test_a_resumed_request_keeps_its_grammar_and_stop_strings(smol: LlamaCppEngine) -> None:
    import json

    sp = SamplingParams(temperature=0, max_tokens=60, constraint=Constraint("json"))
    chat = (ChatMessage("user", "Describe a cat as JSON with name and age."),)
    whole = chat_request(smol, chat, sp, "w")
    evs = await _events(smol, whole)
    toks = [t for ev in evs for t in ev.token_ids]  # type: ignore[attr-defined]
    text = "".join(ev.text for ev in evs)  # type: ignore[attr-defined]
    cut = len(evs) // 2
    rest = await _events(smol, replace(whole, request_id="r", resume_ids=tuple(toks[:cut])))
    assert "".join(ev.text for ev in evs[:cut]) + "".join(ev.text for ev in rest) == text  # type: ignore[attr-defined]
    if evs[-1].finish_reason == "stop":  # type: ignore[attr-defined]
        json.loads(text)
    # A stop string that the resumed tokens began is still held back, then matched.
    prompt = "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9"
    plain = await _events(smol, _req(prompt, max_tokens=40, ignore_eos=True))
    full = "".join(ev.text for ev in plain)  # type: ignore[attr-defined]
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut_run = await _events(smol, _req(prompt, max_tokens=40, ignore_eos=True, stop=(stop,)))
    ids = [t for ev in cut_run for t in ev.token_ids]  # type: ignore[attr-defined]
    k = max(1, len(ids) - 1)
    again = await _events(smol, GenerationRequest("r", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                                      stop=(stop,)), prompt=prompt,
                                                  resume_ids=tuple(ids[:k])))
    assert again[-1].finish_reason == "stop" and again[-1].stop_sequence == stop  # type: ignore[attr-defined]
    assert "".join(ev.text for ev in cut_run[:k]) + "".join(ev.text for ev in again) == \
        "".join(ev.text for ev in cut_run)  # type: ignore[attr-defined]


@pytest.mark.parametrize("kv_unified", [False, True])
async def test_the_warm_up_leaves_no_kv_behind_and_changes_no_output(kv_unified: bool, monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """The CUDA build runs one pass of each serving shape at load (its first pass of a shape is slow);
    forced on here on the CPU: every pass runs, no KV of it is left in any sequence, and a greedy
    answer is the one the engine without a warm-up gives."""
    from engines.llamacpp.engine import warm_up_wanted

    assert warm_up_wanted("cuda") and not warm_up_wanted("vulkan") and not warm_up_wanted("cpu")
    monkeypatch.setenv("GATEWAY_WARMUP", "off")
    assert not warm_up_wanted("cuda")
    monkeypatch.setenv("GATEWAY_WARMUP", "on")
    caplog.set_level("INFO", logger="engines.llamacpp.engine")
    extra = {"kv_unified": True, "sequences": 6} if kv_unified else {}
    e = await _engine("smollm2-135m-instruct", parallel=4, prefill_budget=64, **extra)
    try:
        import llama_cpp as lc

        # 1-6 sequences decoding (8, 16... exceed them), a 64-token chunk beside 5 of them, a full batch.
        n_seqs = 6 if kv_unified else 4
        assert f"warm-up: {n_seqs + 2} passes" in caplog.text, caplog.text
        mem = lc.llama_get_memory(e._ctx)
        assert all(lc.llama_memory_seq_pos_max(mem, s) == -1 for s in range(n_seqs))
        req = _req("The quick brown fox", max_tokens=12)
        warmed = await _run(e, req)
    finally:
        await e.close()
    monkeypatch.setenv("GATEWAY_WARMUP", "off")
    cold = await _engine("smollm2-135m-instruct", parallel=4, prefill_budget=64, **extra)
    try:
        assert warmed == await _run(cold, req)
    finally:
        await cold.close()


@pytest.mark.parametrize(("raw", "want"), [("", 8.0), ("3", 3.0), ("0", 0.0), ("1e9", 1e9), (" 2.5 ", 2.5)])
def test_trim_payback_reads_its_setting(monkeypatch: pytest.MonkeyPatch, raw: str, want: float) -> None:
    from engines.llamacpp.batch import TRIM_PAYBACK
    from engines.llamacpp.engine import trim_payback

    monkeypatch.setenv("GATEWAY_TRIM_PAYBACK", raw)
    assert trim_payback() == (TRIM_PAYBACK if raw == "" else want)


@pytest.mark.parametrize("raw", ["eight", "-1", "nan"])
async def test_a_malformed_trim_payback_stops_the_load_and_names_the_setting(
        monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    from engines.base import ModelLoadError

    monkeypatch.setenv("GATEWAY_TRIM_PAYBACK", raw)
    with pytest.raises(ModelLoadError, match=f"GATEWAY_TRIM_PAYBACK must be a number >= 0.*{raw!r}"):
        await _engine("smollm2-135m-instruct", parallel=1)


async def _long_prompt_engine(monkeypatch: pytest.MonkeyPatch, tokens: str, parallel: int) -> LlamaCppEngine:
    monkeypatch.setenv("GATEWAY_LONG_PROMPT_TOKENS", tokens)
    reg = load_registry(ROOT / "models.yaml")
    spec = reg.models["smollm2-135m-instruct"]
    e = LlamaCppEngine(EngineConfig(model_path=str(reg.resolve(spec, "gguf")), context_length=2048,
                                    chat_template=spec.chat_template, parallel=parallel))
    await e.load()
    return e


async def test_a_load_that_fails_part_way_frees_what_it_made(monkeypatch: pytest.MonkeyPatch) -> None:
    from engines.base import ModelLoadError

    made: list[LlamaCppEngine] = []

    def no_second_context(self: LlamaCppEngine, *args: object) -> None:
        made.append(self)
        assert self._model is not None and self._ctx is not None and self._sched is not None
        raise ModelLoadError("llama.cpp could not create the long prompts' context")

    monkeypatch.setattr(LlamaCppEngine, "_open_side", no_second_context)
    with pytest.raises(ModelLoadError, match="long prompts' context"):
        await _long_prompt_engine(monkeypatch, "256", 1)
    (e,) = made
    assert e._model is None and e._ctx is None and e._sched is None
    assert not e.health().ready


async def test_a_long_prompt_beside_a_running_stream_is_prefilled_in_a_second_context(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """GATEWAY_LONG_PROMPT_TOKENS: a long prompt arriving while another request decodes is
    prefilled (and decoded) in a second llama_context on its own thread: the running stream keeps
    producing tokens during that prefill, the long prompt's greedy tokens are a cold run's, its
    next turn goes back to the context holding its KV (usage counts it cached), and a long prompt
    arriving alone stays in the first context."""
    story = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 13} stones." for i in range(90))
    long_prompt = f"Read the list and answer.\n{story}\nQuestion: which box holds the most stones?"
    plain = await _long_prompt_engine(monkeypatch, "0", 1)
    try:
        assert plain._side is None
        cold, cold_text = await _run(plain, _req(long_prompt, max_tokens=12))
    finally:
        await plain.close()
    e = await _long_prompt_engine(monkeypatch, "256", 2)
    try:
        assert e._side is not None and e.info.extra["long_prompt_context"] == "from 256 uncached tokens"
        assert len(await e.tokenize(long_prompt)) > 600
        stream_times: list[float] = []
        first_long: list[float] = []
        started = asyncio.Event()

        async def running() -> None:
            async for ev in e.generate(_req("Once upon a time", max_tokens=80, ignore_eos=True)):
                if ev.token_ids:
                    stream_times.append(asyncio.get_running_loop().time())
                    started.set()

        async def long_one() -> tuple[list[int], float]:
            await started.wait()
            sent = asyncio.get_running_loop().time()
            toks: list[int] = []
            async for ev in e.generate(_req(long_prompt, max_tokens=12)):
                if ev.token_ids and not first_long:
                    first_long.append(asyncio.get_running_loop().time())
                toks += ev.token_ids
            return toks, sent

        _, (toks, sent) = await asyncio.gather(running(), long_one())
        assert e.long_prompts_beside == 1
        assert toks == cold
        during = [t for t in stream_times if sent < t < first_long[0]]
        assert len(during) >= 3, (len(during), first_long[0] - sent)  # the stream kept going
        # Its next turn, with the first context idle, goes where its KV is.
        follow_up = long_prompt + cold_text + " And the least?"
        evs = [ev async for ev in e.generate(_req(follow_up, max_tokens=4))]
        assert e.long_prompts_beside == 2
        assert evs[-1].usage is not None and evs[-1].usage.cached_tokens > 600, evs[-1].usage
        # Alone, a long prompt that neither context holds stays in the first one.
        await _run(e, _req("A different list.\n" + story[::-1], max_tokens=2))
        assert e.long_prompts_beside == 2
        health = e.health()
        assert health.running == 0 and health.kv is not None and health.kv.long_prompts_beside == 2
    finally:
        await e.close()


async def test_a_malformed_long_prompt_setting_stops_the_load(monkeypatch: pytest.MonkeyPatch) -> None:
    from engines.base import ModelLoadError

    with pytest.raises(ModelLoadError, match="GATEWAY_LONG_PROMPT_TOKENS must be a whole number >= 0, not 'many'"):
        await _long_prompt_engine(monkeypatch, "many", 1)


class _FakeSched:
    """What `_submit_gen` asks of a scheduler: what it holds of a prompt, its counts, submit."""

    def __init__(self, held: int = 0, running: int = 0, waiting: int = 0) -> None:
        self.held, self.running, self.waiting, self.got = held, running, waiting, []  # type: ignore[var-annotated]

    def held_prefix(self, tokens: list[int]) -> int:
        return min(self.held, len(tokens))

    def counts(self) -> tuple[int, int]:
        return self.running, self.waiting

    def submit(self, job: object) -> None:
        self.got.append(job)
        self.waiting += 1


@pytest.mark.parametrize(("prompt", "main", "side", "to_side"), [
    (5000, dict(running=3), {}, True),                    # long, uncached, others decoding: beside them
    (5000, {}, {}, False),                                # long but alone: the first context is free
    (1000, dict(running=3), {}, False),                   # short: chunked into the steps as before
    (5000, dict(running=3, held=4500), {}, False),        # mostly cached here: only 500 new tokens
    (5000, {}, dict(held=4800), True),                    # the second context holds its conversation
    (5000, dict(running=3), dict(running=1), False),      # the second context is busy
    (5000, dict(running=3), dict(waiting=1), False),      # ... or has one waiting
])
def test_long_prompts_are_routed_by_size_cache_and_load(prompt: int, main: dict, side: dict, to_side: bool) -> None:
    import threading
    from types import SimpleNamespace

    e = LlamaCppEngine.__new__(LlamaCppEngine)
    e._sched, e._side = _FakeSched(**main), _FakeSched(**side)
    e._long_min, e._route_lock, e.long_prompts_beside = 4096, threading.Lock(), 0
    job = SimpleNamespace(prompt_ids=list(range(prompt)))
    got = e._submit_gen(job)
    assert (got is e._side) == to_side and got.got == [job]
    assert e.long_prompts_beside == int(to_side)


async def test_a_long_prompt_rendered_off_the_event_loop_is_the_same_prompt(
        smol: LlamaCppEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts over LONG_RENDER_CHARS are tokenized on another thread: the same
    tokens, the same greedy answer, for messages and for a raw prompt."""
    import engines.llamacpp.engine as engine_module

    chat = chat_request(smol, (ChatMessage("system", "Answer briefly. " * 8), ChatMessage("user", "Name a colour.")),
                        SamplingParams(temperature=0, max_tokens=6))
    raw = _req("The capital of France is", max_tokens=6)
    monkeypatch.setattr(engine_module, "LONG_RENDER_CHARS", 10**9)
    on_loop = [await _run(smol, chat), await _run(smol, raw)]
    calls: list[str] = []
    real = smol.prompt_tokens

    def counted(request: GenerationRequest) -> list[int]:
        import threading
        calls.append(threading.current_thread().name)
        return real(request)

    monkeypatch.setattr(engine_module, "LONG_RENDER_CHARS", 10)
    monkeypatch.setattr(smol, "prompt_tokens", counted)
    off_loop = [await _run(smol, chat), await _run(smol, raw)]
    assert off_loop == on_loop
    assert len(calls) == 2 and all(name != "MainThread" for name in calls), calls
