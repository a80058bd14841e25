"""Remote workers: `gateway worker --listen` processes on loopback ports serve a model through the
gateway (models.yaml `workers:`), least-loaded first with conversation affinity; a wrong token is
refused; a lost worker leaves the others serving."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from engines.base import EngineInfo, GenerationRequest, ModelLoadError, SamplingParams
from engines.worker.client import WorkerEngine
from engines.worker.connections import RemoteWorker, Supervision
from tests.conftest import ROOT, free_port
from tests.test_production import Gateway

TOKEN = "worker-token-0123456789abcdef"
REMOTE = "smol-remote"


class Worker:
    def __init__(self, tmp: Path, token_file: Path, *extra: str) -> None:
        self.port = free_port()
        self.log_path = tmp / f"worker-{self.port}.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "worker", "--listen", f"127.0.0.1:{self.port}",
             "--token-file", str(token_file), "--engine", "cpu", "--parallel", "2", "--threads", "1",
             "--config", str(ROOT / "models.yaml"), *extra],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_listening(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.2)
        raise AssertionError(f"worker did not listen:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._log.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, list[Worker]]]:
    tmp = tmp_path_factory.mktemp("remote")
    token_file = tmp / "token"
    token_file.write_text(TOKEN + "\n")
    workers = [Worker(tmp, token_file) for _ in range(2)]
    gateway: Gateway | None = None
    try:
        for w in workers:
            w.wait_listening()
        cfg = yaml.safe_load((ROOT / "models.yaml").read_text())
        cfg["models"].append({"id": REMOTE, "description": "SmolLM2 on two remote workers",
                              "workers": [{"url": f"tcp://127.0.0.1:{w.port}", "token_file": str(token_file)}
                                          for w in workers]})
        cfg_path = tmp / "models.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg))
        gateway = Gateway(tmp, "--config", str(cfg_path), "--model", REMOTE)
        yield gateway, workers
    finally:
        if gateway is not None:
            gateway.stop()
        for w in workers:
            w.stop()


def _status(url: str) -> dict[str, Any]:
    health: dict[str, Any] = httpx.get(f"{url}/health", timeout=10).json()["models"][REMOTE]
    return health


def _routed(url: str) -> list[int]:
    return [w["routed"] for w in _status(url)["worker"]["workers"]]


def _chat(url: str, messages: list[dict[str, str]], max_tokens: int = 8) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": REMOTE, "messages": messages, "max_tokens": max_tokens, "temperature": 0})


def test_a_remote_worker_serves_chat_through_the_gateway(cluster: tuple[Gateway, list[Worker]]) -> None:
    gw, workers = cluster
    r = _chat(gw.url, [{"role": "user", "content": "Name a colour."}])
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    assert r.headers["x-engine"] == "llamacpp/cpu" and f"127.0.0.1:{workers[0].port}" in r.headers["x-device"]
    st = _status(gw.url)
    assert st["ready"] and [w["pid"] for w in st["worker"]["workers"]] == [w.proc.pid for w in workers]


def test_follow_up_turns_go_to_the_worker_holding_the_conversation(cluster: tuple[Gateway, list[Worker]]) -> None:
    gw, _ = cluster
    before = _routed(gw.url)
    messages = [{"role": "system", "content": "You are a terse assistant who answers in one sentence. " * 8},
                {"role": "user", "content": "What is the capital of France?"}]
    cached = []
    for turn in range(3):
        r = _chat(gw.url, messages)
        assert r.status_code == 200
        body = r.json()
        cached.append(body["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))
        messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"And question {turn + 2}?"}]
    delta = [a - b for a, b in zip(_routed(gw.url), before, strict=True)]
    assert sorted(delta) == [0, 3], delta  # all three turns on one worker
    assert cached[1] > 50 and cached[2] > cached[1], cached  # whose KV still held the conversation


def test_concurrent_conversations_spread_over_the_least_loaded_workers(cluster: tuple[Gateway, list[Worker]]) -> None:
    gw, _ = cluster
    before = _routed(gw.url)
    results: list[int] = []

    def one(i: int) -> None:
        r = _chat(gw.url, [{"role": "user", "content": f"Conversation {i}: tell a long story."}], max_tokens=48)
        results.append(r.status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(120)
    delta = [a - b for a, b in zip(_routed(gw.url), before, strict=True)]
    assert results == [200] * 4 and delta == [2, 2], delta


async def test_a_wrong_token_is_refused(cluster: tuple[Gateway, list[Worker]]) -> None:
    _, workers = cluster
    engine = WorkerEngine(RemoteWorker("127.0.0.1", workers[0].port, "not-the-token-at-all"),
                          EngineInfo("remote", "remote", "x"), Supervision())
    with pytest.raises(ModelLoadError, match="refused the token"):
        await engine.load()
    with pytest.raises(ModelLoadError, match="refused the token"):
        await WorkerEngine(RemoteWorker("127.0.0.1", workers[0].port, ""), EngineInfo("r", "r", "x")).load()
    assert "refused a connection" in workers[0].log_path.read_text()


def test_a_worker_lost_mid_stream_leaves_the_other_serving_the_stream(cluster: tuple[Gateway, list[Worker]]) -> None:
    gw, workers = cluster
    body = {"model": REMOTE, "messages": [{"role": "user", "content": "Tell a long story about a lighthouse keeper."}],
            "max_tokens": 120, "temperature": 0, "ignore_eos": True}
    reference = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=120).json()
    before = _routed(gw.url)
    frames: list[str] = []

    def read() -> None:
        with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
            frames.extend(line[6:] for line in r.iter_lines() if line.startswith("data: "))

    # Frames are read as they come: the kill lands while the stream runs.
    t = threading.Thread(target=read, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while _routed(gw.url) == before and time.monotonic() < deadline:
        time.sleep(0.02)
    victim = next(i for i, (a, b) in enumerate(zip(_routed(gw.url), before, strict=True)) if a > b)
    time.sleep(0.3)
    os.kill(workers[victim].proc.pid, signal.SIGKILL)
    workers[victim].proc.wait(10)
    t.join(120)
    chunks = [json.loads(f) for f in frames if f != "[DONE]"]
    assert frames[-1] == "[DONE]" and all("error" not in c for c in chunks), frames[-3:]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == reference["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    for i in range(3):
        r = _chat(gw.url, [{"role": "user", "content": f"After the loss {i}"}])
        assert r.status_code == 200, r.text
    st = _status(gw.url)
    assert [w["ready"] for w in st["worker"]["workers"]] == [i != victim for i in range(2)]
    assert st["ready"]


async def test_a_worker_over_tls(tmp_path: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("openssl is needed to make the test certificate (Debian: apt-get install openssl)")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    worker = Worker(tmp_path, token_file, "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        worker.wait_listening()
        trusted = ssl.create_default_context(cafile=str(cert))
        engine = WorkerEngine(RemoteWorker("127.0.0.1", worker.port, TOKEN, trusted), EngineInfo("r", "r", "x"))
        await engine.load()
        req = GenerationRequest("tls", SamplingParams(temperature=0, max_tokens=4), prompt="Hello")
        tokens = [t async for ev in engine.generate(req) for t in ev.token_ids]
        assert len(tokens) == 4
        await engine.close()
        # A client that does not trust the worker's certificate does not get to talk to it.
        untrusting = WorkerEngine(RemoteWorker("127.0.0.1", worker.port, TOKEN, ssl.create_default_context()),
                                  EngineInfo("r", "r", "x"))
        with pytest.raises(ModelLoadError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            await untrusting.load()
    finally:
        worker.stop()
