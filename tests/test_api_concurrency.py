"""Concurrent requests share the batch without cross-talk; a client that leaves frees its sequence."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

from tests.conftest import MODEL

PROMPTS = [
    "Count from one to five.",
    "Name a fruit.",
    "What is two plus two?",
    "Say something about the sea.",
    "List three animals.",
    "What day comes after Monday?",
    "Describe the colour red.",
    "Write a greeting.",
]


def _ask(client: openai.OpenAI, prompt: str) -> tuple[str, str | None, int]:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=16, temperature=0
    )
    assert r.usage is not None
    return r.choices[0].message.content or "", r.choices[0].finish_reason, r.usage.completion_tokens


def test_eight_concurrent_requests_match_solo_runs(client: openai.OpenAI) -> None:
    solo = [_ask(client, p) for p in PROMPTS]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: _ask(client, p), PROMPTS))
    for p, a, b in zip(PROMPTS, solo, together, strict=True):
        assert b[0], p
        assert b[1] in ("stop", "length")
        # Greedy text in a batch of 8 equals the text generated alone: no cross-talk.
        assert a == b, f"{p!r}: alone {a!r} vs batched {b!r}"


def _idle(url: str) -> bool:
    m = httpx.get(f"{url}/health").json()["models"][MODEL]
    return bool(m["running"] == 0 and m["waiting"] == 0)


def test_disconnect_mid_stream_frees_engine(gateway_url: str) -> None:
    body = {
        "model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}],
        "max_tokens": 1500, "ignore_eos": True, "stream": True,
    }
    with httpx.stream("POST", f"{gateway_url}/v1/chat/completions", json=body, timeout=60) as r:
        it = r.iter_lines()
        got = [line for line in (next(it) for _ in range(6)) if line.startswith("data:")]
        assert got
        assert not _idle(gateway_url)
    t0 = time.monotonic()
    while not _idle(gateway_url):
        # Uncancelled, 1500 tokens would take ~20 s; 5 s leaves room for a loaded CI machine.
        assert time.monotonic() - t0 < 5.0, "generation still running 5 s after the client left"
        time.sleep(0.02)
    # The engine serves the next request normally.
    r2 = httpx.post(f"{gateway_url}/v1/chat/completions", json={"model": MODEL, "messages": body["messages"], "max_tokens": 3}, timeout=30)
    assert r2.status_code == 200
    assert r2.json()["usage"]["completion_tokens"] == 3


def test_disconnect_non_stream_frees_engine(gateway_url: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 1500, "ignore_eos": True}
    try:
        httpx.post(f"{gateway_url}/v1/chat/completions", json=body, timeout=0.5)
    except httpx.ReadTimeout:
        pass
    t0 = time.monotonic()
    while not _idle(gateway_url):
        assert time.monotonic() - t0 < 1.5, "non-stream generation not aborted after the client left"
        time.sleep(0.02)
