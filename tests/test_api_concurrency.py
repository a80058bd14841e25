"""Concurrent requests share the batch without cross-talk; a client that leaves frees its sequence."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

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


def _counters(url: str) -> tuple[float, float]:
    """(requests that ended cancelled, tokens generated), summed over every engine."""
    cancelled = tokens = 0.0
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in fam.samples:
            if s.name == "gateway_requests_total" and s.labels.get("outcome") == "cancelled":
                cancelled += s.value
            elif s.name == "gateway_generation_tokens_total":
                tokens += s.value
    return cancelled, tokens


def _wait_idle(url: str, limit_s: float = 120.0) -> None:
    # A bound only against a hang: the assertions below are about what happened, not how fast.
    t0 = time.monotonic()
    while not _idle(url):
        assert time.monotonic() - t0 < limit_s, "the engine never became idle"
        time.sleep(0.05)


def _assert_aborted(url: str, before: tuple[float, float], max_tokens: int) -> None:
    """The engine saw the cancel: the request ended as `cancelled`, well short of its max_tokens."""
    _wait_idle(url)
    cancelled, tokens = _counters(url)
    assert cancelled == before[0] + 1, "the request was not recorded as cancelled"
    assert tokens - before[1] < max_tokens / 2, f"{tokens - before[1]:.0f} tokens generated: not aborted"


def test_disconnect_mid_stream_frees_engine(gateway_url: str) -> None:
    body = {
        "model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}],
        "max_tokens": 1500, "ignore_eos": True, "stream": True,
    }
    _wait_idle(gateway_url)
    before = _counters(gateway_url)
    with httpx.stream("POST", f"{gateway_url}/v1/chat/completions", json=body, timeout=60) as r:
        it = r.iter_lines()
        got = [line for line in (next(it) for _ in range(6)) if line.startswith("data:")]
        assert got
        assert not _idle(gateway_url)
    _assert_aborted(gateway_url, before, 1500)
    # The engine serves the next request normally.
    r2 = httpx.post(f"{gateway_url}/v1/chat/completions", json={"model": MODEL, "messages": body["messages"], "max_tokens": 3}, timeout=30)
    assert r2.status_code == 200
    assert r2.json()["usage"]["completion_tokens"] == 3


def test_disconnect_non_stream_frees_engine(gateway_url: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 1500, "ignore_eos": True}
    _wait_idle(gateway_url)
    before = _counters(gateway_url)
    host, port = gateway_url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        t0 = time.monotonic()
        while _idle(gateway_url):  # until the generation has started
            assert time.monotonic() - t0 < 60, "the request never started"
            time.sleep(0.02)
    # The client has left mid-generation (socket closed).
    _assert_aborted(gateway_url, before, 1500)
