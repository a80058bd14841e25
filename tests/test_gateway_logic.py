"""Gateway logic on a fake engine: LRU residency, /health while loading, load failures, queue full."""

from __future__ import annotations

import asyncio
import functools
import json
from pathlib import Path

import httpx
import pytest

from engines.base import EngineConfig, EngineHealth, GenerationRequest, SamplingParams
from gateway.app import create_app
from gateway.models.registry import load_registry
from gateway.models.routing import WorkerGroup
from gateway.settings import Settings
from tests import hosts
from tests.conftest import NO_CHECKS, ServerThread
from tests.fakes import FakeEngine

YAML = """
default: a
models:
  - id: a
    formats: {gguf: {path: a.gguf}}
  - id: b
    formats: {gguf: {path: b.gguf}}
  - id: c
    formats: {gguf: {path: c.gguf}}
"""


@pytest.fixture
def registry_file(tmp_path: Path) -> Path:
    for name in "abc":
        (tmp_path / f"{name}.gguf").write_bytes(b"GGUF")
    p = tmp_path / "models.yaml"
    p.write_text(YAML)
    return p


def _server(registry_file: Path, check: bool = True, **engine_kw: object) -> tuple[ServerThread, list[FakeEngine]]:
    made: list[FakeEngine] = []

    def factory(runtime: str, config: EngineConfig) -> FakeEngine:
        e = FakeEngine(config, **engine_kw)  # type: ignore[arg-type]
        made.append(e)
        return e

    settings = Settings.from_env(env=NO_CHECKS, config=str(registry_file), max_resident=2, functional_check=check)
    app = create_app(settings, load_registry(registry_file, cache_dir=registry_file.parent / "cache"), engine_factory=factory, host=hosts.CPU_ONLY)  # type: ignore[arg-type]
    return ServerThread(app), made


def _chat(url: str, model: str, **kw: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "x"}], **kw}, timeout=10)


def test_lru_keeps_at_most_n_models(registry_file: Path) -> None:
    server, made = _server(registry_file)
    server.start()
    try:
        for m in ("a", "b", "a", "c"):
            assert _chat(server.url, m).status_code == 200
        by_path = {Path(e.config.model_path).stem: e for e in made}
        # "b" was least recently used when "c" arrived; "a" stays.
        assert by_path["b"].closed and not by_path["a"].closed and not by_path["c"].closed
        loaded = {m["id"]: m["loaded"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
        assert loaded == {"a": True, "b": False, "c": True}
        assert len(made) == 3  # "a" was not loaded twice
    finally:
        server.stop()


def test_health_is_503_while_default_loads(registry_file: Path) -> None:
    server, _ = _server(registry_file, load_delay=1.5)
    server.start(wait_ready=False)
    try:
        r = httpx.get(f"{server.url}/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        for _ in range(100):
            if httpx.get(f"{server.url}/health").status_code == 200:
                break
            asyncio.run(asyncio.sleep(0.05))
        assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    finally:
        server.stop()


def test_load_failure_is_reported(registry_file: Path) -> None:
    server, _ = _server(registry_file, fail_load=True)
    server.start(wait_ready=False)
    try:
        for _ in range(50):
            h = httpx.get(f"{server.url}/health")
            if h.json()["status"] != "loading":
                break
            asyncio.run(asyncio.sleep(0.05))
        assert h.status_code == 503 and h.json()["status"] == "error"
        assert "fake load failure" in h.json()["models"]["a"]["error"]
        r = _chat(server.url, "a")
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed"
    finally:
        server.stop()


def test_queue_full_is_429(registry_file: Path) -> None:
    # An engine with no room at all cannot pass the one-token functional check: skip it here.
    server, _ = _server(registry_file, check=False, capacity=0)
    server.start()
    try:
        r = _chat(server.url, "a")
        assert r.status_code == 429
        assert r.json()["error"]["code"] == "queue_full"
    finally:
        server.stop()


def test_api_key(registry_file: Path) -> None:
    settings = Settings.from_env(env=NO_CHECKS, config=str(registry_file), api_key="s3cret")
    app = create_app(settings, load_registry(registry_file, cache_dir=registry_file.parent / "cache"), engine_factory=functools.partial(lambda r, c: FakeEngine(c)),
                     host=hosts.CPU_ONLY)
    server = ServerThread(app).start()
    try:
        assert _chat(server.url, "a").status_code == 401
        ok = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": "Bearer s3cret"},
                        json={"model": "a", "messages": [{"role": "user", "content": "x"}]})
        assert ok.status_code == 200
        assert ok.json()["choices"][0]["message"]["content"] == "hello from the fake engine"
    finally:
        server.stop()


def test_error_after_stream_started_is_sent_in_band(registry_file: Path) -> None:
    server, _ = _server(registry_file, fail_after=2)
    server.start()
    try:
        body = {"model": "a", "messages": [{"role": "user", "content": "x"}], "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=10) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2][6:])
        assert err["error"]["code"] == "engine_error" and "crashed mid-stream" in err["error"]["message"]
        assert json.loads(lines[0][6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert json.loads(lines[1][6:])["choices"][0]["delta"]["content"] == "hello"
    finally:
        server.stop()


def test_an_unexpected_exception_is_a_500_envelope_a_logged_traceback_and_counted(
    registry_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # bug_after=0: a plain exception (not an EngineError) in the engine, before any output.
    server, _ = _server(registry_file, check=False, bug_after=0)
    server.start()
    try:
        with caplog.at_level("ERROR", logger="gateway"):
            r = _chat(server.url, "a", max_tokens=5)
            s = httpx.post(f"{server.url}/v1/chat/completions", timeout=10, json={
                "model": "a", "messages": [{"role": "user", "content": "x"}], "stream": True})
        assert r.status_code == 500 and s.status_code == 500
        for resp in (r, s):
            err = resp.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert (err["type"], err["code"]) == ("server_error", "internal_error")
            rid = resp.headers["x-request-id"]
            assert rid in err["message"]
            logged = [rec for rec in caplog.records if rid in rec.getMessage()]
            assert logged and logged[0].exc_info is not None, "no traceback logged with the request id"
            assert "ZeroDivisionError" in caplog.text
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'outcome="error",status="500"} 2.0' in metrics
    finally:
        server.stop()


def test_an_unexpected_exception_mid_stream_ends_with_an_error_frame(registry_file: Path) -> None:
    server, _ = _server(registry_file, check=False, bug_after=2)
    server.start()
    try:
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=10, json={
                "model": "a", "messages": [{"role": "user", "content": "x"}], "stream": True}) as r:
            frames = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
        assert r.status_code == 200 and frames[-1] == "[DONE]"
        err = json.loads(frames[-2])["error"]
        assert err["code"] == "internal_error" and r.headers["x-request-id"] in err["message"]
        assert 'outcome="error",status="500"} 1.0' in httpx.get(f"{server.url}/metrics").text
    finally:
        server.stop()


def test_an_embedding_only_model_serves_embeddings_and_refuses_chat(tmp_path: Path) -> None:
    (tmp_path / "e.gguf").write_bytes(b"GGUF")
    cfg = tmp_path / "models.yaml"
    cfg.write_text("models:\n  - id: e\n    embedding_only: true\n    embedding: {pooling: cls, normalize: false}\n"
                   "    formats: {gguf: {path: e.gguf}}\n")
    server, made = _server(cfg, check=False)
    server.start()
    try:
        card = httpx.get(f"{server.url}/v1/models/e").json()
        assert card["endpoints"] == ["embeddings"]
        r = _chat(server.url, "e")
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported"
        e = httpx.post(f"{server.url}/v1/embeddings", json={"model": "e", "input": ["a b", "c"]}, timeout=10)
        assert e.status_code == 200 and len(e.json()["data"]) == 2
        # models.yaml's pooling options reach the engine.
        assert (made[0].config.pooling, made[0].config.normalize_embeddings) == ("cls", False)
    finally:
        server.stop()


@pytest.mark.parametrize("rank", [False, True])
def test_rank_by_speed_serves_the_faster_engine_on_one_device(tmp_path: Path, rank: bool) -> None:
    from engines.ortgenai import OrtBuild

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "m-onnx").mkdir()
    cfg = tmp_path / "models.yaml"
    cfg.write_text("models:\n  - id: m\n    formats: {gguf: {path: m.gguf}, onnx: {path: m-onnx}}\n")
    host = hosts.host(ort=OrtBuild((("onnxruntime-genai", "0.18.0"),), ("CPUExecutionProvider",)))
    made: list[str] = []

    def factory(runtime: str, config: EngineConfig) -> FakeEngine:
        made.append(runtime)
        # llama.cpp comes first in the plan; here ORT GenAI decodes 10x faster on the same CPU.
        return FakeEngine(config, token_delay=0.02 if runtime == "llamacpp" else 0.002)

    def serve() -> str:
        settings = Settings.from_env(env=NO_CHECKS, config=str(cfg), rank_by_speed=rank)
        app = create_app(settings, load_registry(cfg, cache_dir=tmp_path / "cache"), engine_factory=factory,  # type: ignore[arg-type]
                         host=host)
        server = ServerThread(app).start()
        try:
            r = _chat(server.url, "m")
            assert r.status_code == 200
            return r.headers["x-engine"]
        finally:
            server.stop()

    assert serve() == serve_label(rank)
    loads = len(made)
    assert serve() == serve_label(rank)
    # The second start reads the measured speeds from the check cache: one load, no measuring.
    assert len(made) - loads == 1
    if rank:
        checks = json.loads((tmp_path / "cache" / "functional-checks.json").read_text())
        speeds = sorted(v["tok_s"] for v in checks.values() if "tok_s" in v)
        assert len(speeds) == 2 and speeds[1] > 3 * speeds[0]


def serve_label(rank: bool) -> str:
    return "ortgenai/cpu" if rank else "llamacpp/cpu"


def test_a_responses_stream_that_fails_after_its_start_ends_with_response_failed(registry_file: Path) -> None:
    server, _ = _server(registry_file, fail_after=2)
    server.start()
    try:
        body = {"model": "a", "input": "x", "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/responses", json=body, timeout=10) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        assert [e["type"] for e in events][:2] == ["response.created", "response.in_progress"]
        last = events[-1]
        assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
        assert "crashed mid-stream" in last["response"]["error"]["message"]
        assert any(e["type"] == "response.output_text.delta" and e["delta"] == "hello" for e in events)
        # Not streamed, the same failure is an error status in the envelope.
        r2 = httpx.post(f"{server.url}/v1/responses", json={"model": "a", "input": "x"}, timeout=10)
        assert r2.status_code >= 500 and r2.json()["error"]["code"] == "engine_error"
    finally:
        server.stop()


def test_responses_stream_closes_each_call_before_the_next_is_added() -> None:
    """Codex and the SDK read items in order: a call's arguments.done and output_item.done come
    before the next item's output_item.added (found with a model that made two calls at once)."""
    from gateway.api.openai.responses import Assembler
    from gateway.conversation import ArgumentsDelta, CallStarted, Finished, ToolCall, Usage

    asm = Assembler(None)  # type: ignore[arg-type]
    calls = (ToolCall("call_a", "f", '{"x": 1}'), ToolCall("call_b", "g", '{"y": 2}'))
    neutral = [CallStarted(0, "call_a", "f"), ArgumentsDelta(0, '{"x": '), ArgumentsDelta(0, "1}"),
               CallStarted(1, "call_b", "g"), ArgumentsDelta(1, '{"y": 2}')]
    out = [kind_data for e in neutral for kind_data in asm.feed(e)]
    out += asm.feed(Finished("tool_calls", calls, usage=Usage(3, 2)))
    order = [(kind, data.get("output_index")) for kind, data in out]
    assert order == [
        ("response.output_item.added", 0), ("response.function_call_arguments.delta", 0),
        ("response.function_call_arguments.delta", 0), ("response.function_call_arguments.done", 0),
        ("response.output_item.done", 0), ("response.output_item.added", 1),
        ("response.function_call_arguments.delta", 1), ("response.function_call_arguments.done", 1),
        ("response.output_item.done", 1)]
    done = [data["item"] for kind, data in out if kind == "response.output_item.done"]
    assert [(d["call_id"], d["arguments"]) for d in done] == [("call_a", '{"x": 1}'), ("call_b", '{"y": 2}')]
    assert [data["sequence_number"] for _, data in out] == list(range(len(out)))


class _LaggingEngine(FakeEngine):
    """Reports no requests in its health, as a worker does until its connection's loop registers them."""

    def health(self) -> EngineHealth:
        return EngineHealth(ready=self.loaded and not self.closed)


async def test_a_burst_spreads_over_workers_whose_own_counts_lag_the_pick() -> None:
    members = [_LaggingEngine(EngineConfig(model_path="fake", backend="cpu", parallel=2), token_delay=0.01)
               for _ in range(2)]
    for m in members:
        await m.load()
    group = WorkerGroup(list(members))
    streams = [group.generate(GenerationRequest(f"r{i}", SamplingParams(max_tokens=8), prompt=f"conversation {i}"))
               for i in range(4)]
    for s in streams:
        await anext(s)  # picked and started, one after another
    assert group.served == {0: 2, 1: 2} and group.routing == {0: 2, 1: 2}
    for s in streams[:3]:
        async for _ in s:
            pass
    await streams[3].aclose()  # cut off mid-stream: no longer counted either
    assert group.routing == {0: 0, 1: 0}
