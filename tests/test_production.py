"""Production behaviour against a real `gateway serve` process on the real model: drain on
SIGTERM, honest overload, bounded input, CORS and the Host check, API keys."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import MODEL, ROOT, free_port, wait_for

KEYS = ("sk-first-0123456789", "sk-second-abcdefghij")
METRICS_KEY = "metrics-key-42"
LONG = [{"role": "user", "content": "Tell a long story about a lighthouse keeper."}]


class Gateway:
    """`gateway serve` in its own process (signals need a real process), on a free loopback port."""

    # Every one started in this test session: a failed test's report gets the log tails of those
    # still running or started during it (tests/conftest.py), so a CI failure says what the server saw.
    started: list[Gateway] = []

    def __init__(self, tmp: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.started_at = time.time()
        Gateway.started.append(self)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"gateway-{self.port}.log"
        self._log = self.log_path.open("w")
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--engine", "cpu", "--port", str(self.port),
               "--config", str(ROOT / "models.yaml"), *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "GATEWAY_LOG_LEVEL": "info", **(env or {})})
        if not wait_for(f"{self.url}/health", 300, alive=lambda: self.proc.poll() is None):
            state = "exited early" if self.proc.poll() is not None else "did not become ready"
            log = self.log()
            self.stop()
            raise AssertionError(f"gateway {state}:\n{log}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._log.close()


class Stream:
    """A streaming chat request read in a thread; `started` is set at its first data frame."""

    def __init__(self, url: str, max_tokens: int, headers: dict[str, str] | None = None,
                 include_usage: bool = False, messages: list[dict[str, str]] | None = None) -> None:
        self.frames: list[str] = []
        self.status = 0
        self.error: Exception | None = None  # the connection broke (a server that exited at once)
        self.started = threading.Event()
        self.done = threading.Event()
        body: dict[str, Any] = {"model": MODEL, "messages": messages or LONG, "max_tokens": max_tokens, "ignore_eos": True,
                                "stream": True, "temperature": 0}
        if include_usage:
            body["stream_options"] = {"include_usage": True}
        self._thread = threading.Thread(target=self._run, args=(url, body, headers or {}), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=300) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.frames.append(line[6:])
                        self.started.set()
        except httpx.HTTPError as exc:
            self.error = exc
        finally:
            self.started.set()
            self.done.set()

    def wait(self, timeout: float = 300) -> None:
        assert self.done.wait(timeout), "stream did not end"

    def chunks(self) -> list[dict[str, Any]]:
        return [json.loads(f) for f in self.frames if f != "[DONE]"]


def _chat(url: str, headers: dict[str, str] | None = None, **kw: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **kw}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers or {}, timeout=300)


def _is_envelope(body: dict[str, Any], code: str | None = None) -> bool:
    err = body.get("error")
    ok = isinstance(err, dict) and set(err) == {"message", "type", "param", "code"} and bool(err["message"])
    return ok and (code is None or err["code"] == code)


# --- drain -------------------------------------------------------------------------------------


def test_sigterm_lets_running_streams_finish_and_refuses_new_requests(tmp_path: Path) -> None:
    gw = Gateway(tmp_path, "--drain-timeout", "120", "--parallel", "2")
    try:
        stream = Stream(gw.url, max_tokens=300)
        assert stream.started.wait(120) and stream.status == 200
        gw.signal(signal.SIGTERM)
        # Draining: /health says so, and a new request is refused with a Retry-After.
        t0 = time.monotonic()
        while (h := httpx.get(f"{gw.url}/health", timeout=10)).json().get("status") != "draining":
            assert time.monotonic() - t0 < 30, h.text
            time.sleep(0.05)
        assert h.status_code == 503 and int(h.headers["retry-after"]) >= 1
        # Kubernetes takes it out of the endpoints, and does not restart it while it finishes its work.
        ready = httpx.get(f"{gw.url}/health/ready", timeout=10)
        assert ready.status_code == 503 and ready.json()["status"] == "draining"
        live = httpx.get(f"{gw.url}/health/live", timeout=10)
        assert live.status_code == 200 and live.json()["status"] == "alive"
        r = _chat(gw.url)
        assert r.status_code == 503 and _is_envelope(r.json(), "server_draining")
        assert int(r.headers["retry-after"]) >= 1
        assert not stream.done.is_set(), "the stream should still be running during the drain"
        stream.wait()
        # The running stream was not cut: it reached its finish reason and [DONE].
        assert stream.frames[-1] == "[DONE]"
        chunks = stream.chunks()
        assert all("error" not in c for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert gw.proc.wait(timeout=60) == 0
        assert "draining" in gw.log()
    finally:
        gw.stop()


def test_drain_timeout_ends_the_rest_with_an_error_frame_then_done(tmp_path: Path) -> None:
    gw = Gateway(tmp_path, "--drain-timeout", "1", "--parallel", "2")
    try:
        stream = Stream(gw.url, max_tokens=1800)
        assert stream.started.wait(120) and stream.status == 200
        with ThreadPoolExecutor(1) as pool:
            body = {"model": MODEL, "messages": LONG, "max_tokens": 1800, "ignore_eos": True}
            plain = pool.submit(httpx.post, f"{gw.url}/v1/chat/completions", json=body, timeout=300)
            t0 = time.monotonic()
            while httpx.get(f"{gw.url}/health", timeout=10).json()["models"][MODEL]["running"] < 2:
                assert time.monotonic() - t0 < 60
                time.sleep(0.05)
            gw.signal(signal.SIGTERM)
            stream.wait(120)
            r = plain.result(timeout=120)
        assert stream.frames[-1] == "[DONE]"
        last = json.loads(stream.frames[-2])
        assert _is_envelope(last, "server_shutdown"), last
        assert r.status_code == 503 and _is_envelope(r.json(), "server_shutdown")
        # Unloaded and exited cleanly, well before any client time-out.
        assert gw.proc.wait(timeout=60) == 0
    finally:
        gw.stop()


def test_a_second_signal_exits_at_once(tmp_path: Path) -> None:
    gw = Gateway(tmp_path, "--drain-timeout", "300")
    try:
        stream = Stream(gw.url, max_tokens=1800)
        assert stream.started.wait(120)
        gw.signal(signal.SIGTERM)
        t0 = time.monotonic()
        while httpx.get(f"{gw.url}/health", timeout=10).json().get("status") != "draining":
            assert time.monotonic() - t0 < 30
            time.sleep(0.05)
        gw.signal(signal.SIGINT)
        # Exits without waiting out the 300 s drain (the stream still had ~1,800 tokens to go).
        assert gw.proc.wait(timeout=30) != 0
        assert "second signal" in gw.log()
        stream.wait(30)
        assert stream.error is not None or stream.frames[-1] != "[DONE]"  # cut, as asked
    finally:
        gw.stop()


# --- one gateway with every guard on -----------------------------------------------------------


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("guarded")
    keyfile = tmp / "keys"
    keyfile.write_text(f"# API keys\n{KEYS[0]}\n\n{KEYS[1]}\n")
    gw = Gateway(tmp, "--api-key-file", str(keyfile), "--metrics-api-key", METRICS_KEY,
                 "--allowed-origins", "https://app.example.org", "--max-body", "64k",
                 "--parallel", "1", "--max-queue", "3", "--max-queue-wait", "2.4",
                 env={"GATEWAY_MAX_MESSAGES": "50", "GATEWAY_MAX_PROMPT_CHARS": "20000"})
    yield gw
    gw.stop()


AUTH = {"Authorization": f"Bearer {KEYS[0]}"}


def test_api_keys(guarded: Gateway) -> None:
    r = _chat(guarded.url)
    assert r.status_code == 401 and _is_envelope(r.json(), "invalid_api_key")
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert _chat(guarded.url, {"Authorization": "Bearer sk-first-012345678X"}).status_code == 401
    for key in KEYS:  # every key in the file works
        assert _chat(guarded.url, {"Authorization": f"Bearer {key}"}).status_code == 200
    assert httpx.get(f"{guarded.url}/v1/models", headers=AUTH).status_code == 200
    for path in ("/health", "/health/ready", "/health/live"):
        assert httpx.get(f"{guarded.url}{path}").status_code == 200, path  # open, as documented
    m = httpx.get(f"{guarded.url}/metrics", headers=AUTH)
    assert m.status_code == 401  # the API key is not the metrics key
    assert httpx.get(f"{guarded.url}/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"}).status_code == 200
    log = guarded.log()
    assert all(k not in log for k in (*KEYS, METRICS_KEY)), "a key leaked into the log"


def _limit_bodies(turns: int, chars: int) -> dict[str, tuple[dict[str, Any], str]]:
    """A request of `turns` messages (or a prompt of `chars` characters) for each generation route,
    with the name its protocol gives the field."""
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": "Hi"} for i in range(turns)]
    long = "word " * (chars // 5)
    return {
        "/v1/chat/completions": ({"model": MODEL, "messages": msgs, "max_tokens": 2}, "messages"),
        "/v1/responses": ({"model": MODEL, "input": msgs, "max_output_tokens": 2}, "input"),
        "/v1/messages": ({"model": MODEL, "messages": msgs, "max_tokens": 2}, "messages"),
        "/api/chat": ({"model": MODEL, "messages": msgs, "stream": False}, "messages"),
        "/v1/completions": ({"model": MODEL, "prompt": long, "max_tokens": 2}, "prompt"),
        "/api/generate": ({"model": MODEL, "prompt": long, "stream": False}, "prompt"),
    }


@pytest.mark.parametrize("over", ["messages", "characters"])
def test_request_limits_hold_on_every_protocol(guarded: Gateway, over: str) -> None:
    """GATEWAY_MAX_MESSAGES and GATEWAY_MAX_PROMPT_CHARS are checked once, for every protocol: a
    400 in the envelope of the protocol asked, naming its own field."""
    turns, chars = (51, 10) if over == "messages" else (3, 20_500)
    for path, (body, field) in _limit_bodies(turns, chars).items():
        if over == "characters" and "messages" in body:
            body["messages"][0]["content"] = "word " * (chars // 5)
        if over == "characters" and "input" in body:
            body["input"][0]["content"] = "word " * (chars // 5)
        if over == "messages" and field == "prompt":
            continue  # a raw prompt has no messages
        r = httpx.post(f"{guarded.url}{path}", json=body, headers={**AUTH, "anthropic-version": "2023-06-01"},
                       timeout=300)
        assert r.status_code == 400, (path, r.status_code, r.text)
        err = r.json()
        if path == "/v1/messages":
            assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
            assert field in err["error"]["message"], err
        elif path.startswith("/api/"):
            assert set(err) == {"error"} and "limit" in err["error"], err
        else:
            assert _is_envelope(err) and err["error"]["param"] == field, (path, err)
    # Just under the limits every route answers.
    for path, (body, _field) in _limit_bodies(49, 10).items():
        r = httpx.post(f"{guarded.url}{path}", json=body, headers={**AUTH, "anthropic-version": "2023-06-01"},
                       timeout=300)
        assert r.status_code == 200, (path, r.text)


def test_cors_preflight_from_a_loopback_origin_is_allowed(guarded: Gateway) -> None:
    for origin in ("http://localhost:5173", "http://127.0.0.1:3000", "http://[::1]:8000", "https://app.example.org"):
        r = httpx.options(f"{guarded.url}/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os, x-stainless-retry-count",
        })
        assert r.status_code == 204, (origin, r.text)
        assert r.headers["access-control-allow-origin"] == origin
        assert "POST" in r.headers["access-control-allow-methods"]
        allowed = {h.strip() for h in r.headers["access-control-allow-headers"].split(",")}
        assert {"authorization", "content-type", "x-stainless-os"} <= allowed
    # The actual request from that origin carries the CORS headers and exposes ours.
    r = _chat(guarded.url, {**AUTH, "Origin": "http://localhost:5173"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://localhost:5173"
    assert "X-Engine" in r.headers["access-control-expose-headers"]


def test_cors_refuses_other_origins(guarded: Gateway) -> None:
    r = httpx.options(f"{guarded.url}/v1/chat/completions", headers={
        "Origin": "https://example.com", "Access-Control-Request-Method": "POST"})
    assert r.status_code == 403 and _is_envelope(r.json(), "origin_not_allowed")
    assert "access-control-allow-origin" not in r.headers
    # A page on another origin cannot use the API even with a simple (non-preflighted) request.
    r = _chat(guarded.url, {**AUTH, "Origin": "http://localhost.evil.example"})
    assert r.status_code == 403 and _is_envelope(r.json(), "origin_not_allowed")


def test_dns_rebinding_host_is_refused(guarded: Gateway) -> None:
    r = _chat(guarded.url, {**AUTH, "Host": "evil.example"})
    assert r.status_code == 403 and _is_envelope(r.json(), "host_not_allowed")
    assert httpx.get(f"{guarded.url}/health", headers={"Host": f"evil.example:{guarded.port}"}).status_code == 403
    for host in (f"localhost:{guarded.port}", f"127.0.0.1:{guarded.port}", "localhost"):
        assert _chat(guarded.url, {**AUTH, "Host": host}).status_code == 200, host


def _raw(port: int, head: str, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """Send a request head (and a little body) on a raw socket; read the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head.encode() + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
            if b"\r\n\r\n" in data:
                h, _, rest = data.partition(b"\r\n\r\n")
                headers = dict(line.split(": ", 1) for line in h.decode().split("\r\n")[1:])
                headers = {k.lower(): v for k, v in headers.items()}
                if len(rest) >= int(headers.get("content-length", "-1")) >= 0:
                    return int(h.split()[1]), headers, rest[: int(headers["content-length"])]
    raise AssertionError(f"incomplete answer: {data[:300]!r}")


def test_a_50_mb_body_is_refused_before_it_is_sent(guarded: Gateway) -> None:
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEYS[0]}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {50 * 1024 * 1024}\r\n\r\n")
    t0 = time.perf_counter()
    status, _, body = _raw(guarded.port, head, b'{"model": "' + b"x" * 1000)
    # The answer came while 50 MB minus 1 KB of the body were still unsent.
    print(f"50 MB body refused in {1000 * (time.perf_counter() - t0):.1f} ms")
    assert status == 413 and _is_envelope(json.loads(body), "request_too_large")


def test_a_chunked_body_over_the_limit_is_refused(guarded: Gateway) -> None:
    chunk = b"x" * 16384
    body = b"".join(b"%x\r\n" % len(chunk) + chunk + b"\r\n" for _ in range(6)) + b"0\r\n\r\n"
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEYS[0]}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    status, _, answer = _raw(guarded.port, head, body)
    assert status == 413 and _is_envelope(json.loads(answer), "request_too_large")


def test_message_and_prompt_limits_apply_before_tokenizing(guarded: Gateway) -> None:
    many = [{"role": "user", "content": "hi"}] * 51
    r = _chat(guarded.url, AUTH, messages=many)
    assert r.status_code == 400 and _is_envelope(r.json(), "too_many_messages")
    r = _chat(guarded.url, AUTH, messages=[{"role": "user", "content": "word " * 5000}])
    assert r.status_code == 400 and _is_envelope(r.json(), "prompt_too_long")
    r = httpx.post(f"{guarded.url}/v1/completions", headers=AUTH, timeout=60,
                   json={"model": MODEL, "prompt": "a" * 20001, "max_tokens": 2})
    assert r.status_code == 400 and _is_envelope(r.json(), "prompt_too_long")
    deep = b'{"model": "m", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    r = httpx.post(f"{guarded.url}/v1/chat/completions", headers={**AUTH, "Content-Type": "application/json"},
                   content=deep, timeout=60)
    assert r.status_code == 400 and _is_envelope(r.json())
    bad_utf8 = b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "\xff\xfe"}]}'
    r = httpx.post(f"{guarded.url}/v1/chat/completions", headers={**AUTH, "Content-Type": "application/json"},
                   content=bad_utf8, timeout=60)
    assert r.status_code == 400 and _is_envelope(r.json())


def _metrics(gw: Gateway) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(f"{gw.url}/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"}).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _sum(m: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return sum(v for (n, lb), v in m.items() if n == name and set(labels.items()) <= set(lb))


def test_overload_is_refused_with_429_and_retry_after_never_5xx(guarded: Gateway) -> None:
    before = _metrics(guarded)
    # One slot, a queue of 3, at most 2.4 s of waiting: 16 concurrent streams overload it.
    with ThreadPoolExecutor(16) as pool:
        streams = list(pool.map(lambda _: Stream(guarded.url, max_tokens=64, headers=AUTH), range(16)))
        for s in streams:
            s.wait()
    statuses = [s.status for s in streams]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) >= 1 and statuses.count(200) >= 1, statuses
    accepted = [s for s in streams if s.status == 200]
    for s in accepted:
        assert s.frames[-1] == "[DONE]" and all("error" not in c for c in s.chunks())
    after = _metrics(guarded)
    rejected = _sum(after, "gateway_requests_total", outcome="rejected", status="429") - \
        _sum(before, "gateway_requests_total", outcome="rejected", status="429")
    assert rejected == statuses.count(429)
    # No accepted request waited longer than --max-queue-wait (2.4 s, a bucket edge of the histogram).
    waits = _sum(after, "gateway_admission_wait_seconds_count") - _sum(before, "gateway_admission_wait_seconds_count")
    within = _sum(after, "gateway_admission_wait_seconds_bucket", le="2.4") - \
        _sum(before, "gateway_admission_wait_seconds_bucket", le="2.4")
    assert waits == len(accepted) and within == waits


def test_429_carries_a_numeric_retry_after(guarded: Gateway) -> None:
    # Hold the only slot with a long stream, fill the queue, and look at a refused request.
    holder = Stream(guarded.url, max_tokens=400, headers=AUTH)
    assert holder.started.wait(120) and holder.status == 200
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: _chat(guarded.url, AUTH, max_tokens=2), range(8)))
    refused = [r for r in answers if r.status_code == 429]
    assert refused, [r.status_code for r in answers]
    for r in refused:
        assert _is_envelope(r.json()) and r.json()["error"]["code"] in ("queue_full", "queue_wait_exceeded")
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert int(r.headers["retry-after"]) >= 1
    assert all(r.status_code in (200, 429) for r in answers)
    holder.wait()
