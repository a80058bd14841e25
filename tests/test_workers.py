"""Engines in supervised worker processes, with the real model: crashes, hangs, retries, fallback,
and no orphans.  The gateway runs as a real process (`gateway serve`), as users run it."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from engines.base import EngineConfig, EngineCrashed, EngineInfo, GenerationRequest, SamplingParams
from engines.worker.client import WorkerEngine
from engines.worker.connections import LocalWorker, Supervision
from tests.conftest import MODEL, ROOT
from tests.test_production import LONG, Gateway, Stream, _chat, _is_envelope


def _worker(url: str) -> dict[str, Any]:
    worker: dict[str, Any] = httpx.get(f"{url}/health", timeout=10).json()["models"][MODEL]["worker"]
    return worker


def _alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def _ready_again(url: str, old_pid: int, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        model = httpx.get(f"{url}/health", timeout=10).json()["models"].get(MODEL, {})  # absent while it reloads
        w = model.get("worker", {})
        if w.get("pid", old_pid) != old_pid and model.get("ready"):
            return dict(w)
        time.sleep(0.1)
    raise AssertionError("the worker was not restarted")


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    # --max-queue-wait: the chaos test queues 6 streams behind 2 sequences through three restarts; the
    # admission estimate would otherwise refuse some at once (429), which is not what it tests.
    g = Gateway(tmp_path_factory.mktemp("workers"), "--parallel", "2", "--max-queue-wait", "600",
                # A failover per kill of the chaos test (three), for a stream that runs through all of
                # them, and as many again for restarted workers the 1-s heartbeat limit gives up on
                # while 8 streams resume on a loaded 2-core machine.
                env={"GATEWAY_WORKER_HEARTBEAT_TIMEOUT": "1", "GATEWAY_WORKER_MAX_CRASHES": "100",
                     "GATEWAY_FAILOVER_BUDGET": "6"})
    yield g
    g.stop()


def test_the_engine_runs_in_a_worker_process_of_the_gateway(gw: Gateway) -> None:
    r = _chat(gw.url)
    assert r.status_code == 200 and r.headers["x-engine"] == "llamacpp/cpu"
    w = _worker(gw.url)
    assert w["pid"] != gw.proc.pid and w["where"] == "local worker" and w["rss_bytes"] > 10 << 20
    cmdline = Path(f"/proc/{w['pid']}/cmdline").read_bytes().split(b"\0")
    assert b"engines.worker" in cmdline
    status = Path(f"/proc/{w['pid']}/status").read_text()
    assert f"PPid:\t{gw.proc.pid}\n" in status


def _greedy(url: str, max_tokens: int) -> dict[str, Any]:
    """The uninterrupted answer to the streams' request (LONG, greedy, ignore_eos), from a fresh
    worker: its prompt is prefilled whole, as the restarted worker will prefill it after the kill
    (llama.cpp's rounding depends on how tokens are batched, so a prompt half from the prefix
    cache can tip a near-tie later on)."""
    pid = _worker(url)["pid"]
    os.kill(pid, signal.SIGKILL)
    _ready_again(url, pid)
    body = {"model": MODEL, "messages": LONG, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _text(stream: Stream) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in stream.chunks() if c["choices"])


def _finished_cleanly(stream: Stream) -> None:
    chunks = stream.chunks()
    assert stream.status == 200 and stream.frames[-1] == "[DONE]", stream.frames[-3:]
    assert all("error" not in c for c in chunks), [c for c in chunks if "error" in c]
    assert len({c["id"] for c in chunks}) == 1
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]] \
        == ["length"]


def _started(stream: Stream, frames: int = 5) -> None:
    deadline = time.monotonic() + 60
    while len(stream.frames) < frames and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(stream.frames) >= frames, "the stream did not start"


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGKILL])
def test_a_worker_killed_mid_stream_does_not_end_the_stream(gw: Gateway, sig: int) -> None:
    reference = _greedy(gw.url, 200)
    before = _worker(gw.url)
    silent_before = gw.log().count("stopped answering heartbeats")
    stream = Stream(gw.url, max_tokens=200, include_usage=True)
    _started(stream)
    os.kill(before["pid"], sig)
    stream.wait(timeout=120)
    _finished_cleanly(stream)
    # One continuous answer: the greedy text of an uninterrupted run, exactly max_tokens tokens,
    # the prompt counted once.
    assert _text(stream) == reference["choices"][0]["message"]["content"]
    usage = stream.chunks()[-1]["usage"]
    assert usage["completion_tokens"] == 200 and usage["prompt_tokens"] == reference["usage"]["prompt_tokens"]
    # One failover for the kill; this gateway's 1 s heartbeat may also, on a loaded 2-core machine,
    # give up on the restarted worker (logged as such): each of those is one more, nothing else is.
    spurious = gw.log().count("stopped answering heartbeats") - silent_before
    assert usage["failovers"] == 1 + spurious, gw.log()[-4000:]
    after = _ready_again(gw.url, before["pid"])
    assert after["crashes"] >= before["crashes"] + 1
    assert gw.proc.poll() is None
    metrics = httpx.get(f"{gw.url}/metrics", timeout=10).text
    assert f'gateway_failovers_total{{model="{MODEL}",reason="restarted"}}' in metrics
    assert "gateway_failover_pause_seconds_count" in metrics


def test_a_non_streaming_request_cut_by_a_crash_is_answered_whole(gw: Gateway) -> None:
    import threading

    reference = _greedy(gw.url, 300)
    before = _worker(gw.url)
    result: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: result.setdefault("r", _chat(gw.url, messages=LONG, max_tokens=300,
                                                                      ignore_eos=True, temperature=0)))
    t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = httpx.get(f"{gw.url}/health", timeout=10).json()["models"][MODEL]
        if health["running"] >= 1:
            time.sleep(0.5)  # well into the generation
            break
        time.sleep(0.02)
    os.kill(before["pid"], signal.SIGKILL)
    t.join(120)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.headers["x-failover"] == "1"
    body = r.json()
    assert body["choices"][0]["message"]["content"] == reference["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] == 300 and body["usage"]["failovers"] == 1
    _ready_again(gw.url, before["pid"])


def _responses_text(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e.get("type") == "response.output_text.delta")


def _anthropic_text(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"].get("text", "") for e in events if e.get("type") == "content_block_delta")


def _ollama_text(events: list[dict[str, Any]]) -> str:
    return "".join(e.get("message", {}).get("content", "") for e in events)


def _completions_text(events: list[dict[str, Any]]) -> str:
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))


# Each protocol's streaming request (150 tokens, greedy), how its text is read, and how its stream
# says it failed (an error event, a failed response, an error line).
PROTOCOLS: dict[str, tuple[str, dict[str, Any], Any]] = {
    "responses": ("/v1/responses", {"input": LONG, "max_output_tokens": 150, "temperature": 0}, _responses_text),
    "anthropic": ("/v1/messages", {"messages": LONG, "max_tokens": 150, "temperature": 0}, _anthropic_text),
    "ollama": ("/api/chat", {"messages": LONG, "options": {"num_predict": 150, "temperature": 0}}, _ollama_text),
    "completions": ("/v1/completions", {"prompt": "Once upon a time, in a lighthouse by the sea,",
                                         "max_tokens": 150, "temperature": 0}, _completions_text),
}


def _protocol_stream(url: str, path: str, body: dict[str, Any], out: list[dict[str, Any]]) -> None:
    with httpx.stream("POST", f"{url}{path}", json={"model": MODEL, "stream": True, **body}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            # SSE `data:` lines, or Ollama's NDJSON; `event:` lines and comments (the server's
            # keep-alive `: ping` every 15 s, which a stream paused by a slow restart gets) skipped.
            if not line or line.startswith((":", "event: ")):
                continue
            data = line[6:] if line.startswith("data: ") else line
            if data != "[DONE]":
                out.append(json.loads(data))


def _failovers(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("gateway_failovers_total{") and 'reason="restarted"' in line)


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_every_protocol_streams_through_a_worker_crash(gw: Gateway, protocol: str) -> None:
    """Failover lives below the protocols: a Responses, Anthropic, Ollama or completions stream
    whose worker is killed goes on with no error event, and its text is the uninterrupted run's."""
    import threading

    path, body, text_of = PROTOCOLS[protocol]
    pid = _worker(gw.url)["pid"]
    os.kill(pid, signal.SIGKILL)  # the reference, like the resumed run, prefills its prompt in a fresh worker
    _ready_again(gw.url, pid)
    reference: list[dict[str, Any]] = []
    _protocol_stream(gw.url, path, body, reference)
    before, failovers = _worker(gw.url), _failovers(gw.url)
    events: list[dict[str, Any]] = []
    t = threading.Thread(target=_protocol_stream, args=(gw.url, path, body, events), daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while len(events) < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(before["pid"], signal.SIGKILL)
    t.join(120)
    assert not t.is_alive(), "the stream did not end"
    assert not [e for e in events if "error" in e or e.get("type") in ("error", "response.failed")], events[-3:]
    assert text_of(events) == text_of(reference) and text_of(events)
    # At least one: the kill came mid-stream. (The fixture's 1-s heartbeat limit can make a loaded
    # 2-core machine's restarted worker miss one and be killed too: the text must survive that as well.)
    assert _failovers(gw.url) >= failovers + 1, gw.log()[-3000:]
    _ready_again(gw.url, before["pid"])


def test_a_hung_worker_is_killed_by_the_watchdog_and_the_stream_goes_on(gw: Gateway) -> None:
    before = _worker(gw.url)
    stream = Stream(gw.url, max_tokens=200)
    _started(stream, 3)
    os.kill(before["pid"], signal.SIGSTOP)  # no more heartbeats, and no more tokens
    stream.wait(timeout=120)
    _finished_cleanly(stream)
    assert _wait_gone(before["pid"], 5), "the hung worker was not killed"
    assert "stopped answering heartbeats" in gw.log()
    _ready_again(gw.url, before["pid"])
    assert _chat(gw.url).status_code == 200


def test_running_and_waiting_requests_all_finish_after_a_crash(gw: Gateway) -> None:
    before = _worker(gw.url)
    # Two streams fill both sequences; the third waits for one, so it has produced nothing yet.
    running = [Stream(gw.url, max_tokens=120) for _ in range(2)]
    for s in running:
        _started(s, 3)
    queued = Stream(gw.url, max_tokens=8)
    time.sleep(0.5)
    assert not queued.frames, "the third request should be waiting for a sequence"
    os.kill(before["pid"], signal.SIGKILL)
    for s in (*running, queued):
        s.wait(120)
        _finished_cleanly(s)


def test_chaos_eight_streams_and_three_kills(gw: Gateway) -> None:
    """8 concurrent streams, the worker killed 3 times at random moments: 8 of 8 finish whole."""
    import random

    rng = random.Random(7)
    streams = [Stream(gw.url, max_tokens=150) for _ in range(8)]
    _started(streams[0], 3)
    for _ in range(3):
        time.sleep(rng.uniform(0.3, 2.0))
        watchdog_before = gw.log().count("): killing it")
        pid = _worker(gw.url)["pid"]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            # Gone by itself in between: only the watchdog may do that (the fixture's 1-s heartbeat
            # limit on a loaded 2-core machine; logged); a worker that crashed on its own is a failure.
            assert gw.log().count("): killing it") > watchdog_before, gw.log()[-6000:]
        _ready_again(gw.url, pid, timeout=120)
    for s in streams:
        s.wait(300)
        _finished_cleanly(s)
    assert gw.proc.poll() is None and _chat(gw.url).status_code == 200


def test_with_failover_off_a_crash_ends_the_stream_with_an_error_frame(tmp_path: Path) -> None:
    g = Gateway(tmp_path, "--parallel", "1", env={"GATEWAY_FAILOVER_BUDGET": "0", "GATEWAY_WORKER_MAX_CRASHES": "100"})
    try:
        before = _worker(g.url)
        stream = Stream(g.url, max_tokens=1500)
        _started(stream)
        os.kill(before["pid"], signal.SIGKILL)
        killed = time.monotonic()
        stream.wait(timeout=30)
        assert time.monotonic() - killed < 2.0, "the client learnt of the crash too late"
        assert stream.status == 200 and stream.frames[-1] == "[DONE]"
        err = json.loads(stream.frames[-2])
        assert _is_envelope(err, "engine_failed") and "SIGKILL" in err["error"]["message"], err
    finally:
        g.stop()


def test_worker_crashes_are_counted(gw: Gateway) -> None:
    text = httpx.get(f"{gw.url}/metrics", timeout=10).text
    line = next(ln for ln in text.splitlines() if ln.startswith("gateway_worker_crashes_total{"))
    assert float(line.rsplit(" ", 1)[1]) >= 8  # the tests above, in this module's order


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_no_worker_outlives_the_gateway(tmp_path: Path, how: str) -> None:
    g = Gateway(tmp_path)
    pid = _worker(g.url)["pid"]
    try:
        g.signal(getattr(signal, how))
        g.proc.wait(30)
        assert _wait_gone(pid, 5), f"worker {pid} outlived the gateway ({how})"
    finally:
        g.stop()


# --- the watchdog on a step that never returns (a stand-in runtime: tests/stuck_engine.py) ----------


async def test_a_stuck_engine_step_is_killed_by_the_watchdog() -> None:
    conn = LocalWorker("stuck", EngineConfig("unused"), plugins=("tests.stuck_engine",))
    engine = WorkerEngine(conn, EngineInfo("stuck", "cpu", "cpu"),
                          Supervision(heartbeat_s=0.2, step_timeout_s=1.0, max_crashes=1))
    failed: list[str] = []
    engine.on_failed = failed.append
    await engine.load()
    pid = engine.pid
    assert pid is not None
    req = GenerationRequest("stuck", SamplingParams(max_tokens=4), prompt="x")
    got: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(EngineCrashed, match="stuck in one engine step"):
        async for ev in engine.generate(req):
            got.append(ev.text)
    assert got == ["first"] and 1.0 < time.monotonic() - t0 < 4.0
    assert _wait_gone(pid, 5)
    assert failed and "stuck in one engine step" in failed[0]  # max_crashes=1: it gave up
    with pytest.raises(EngineCrashed):
        async for _ in engine.generate(req):
            pass
    await engine.close()


def test_a_token_id_beyond_64_bits_is_a_400_not_a_500(gw: Gateway) -> None:
    r = httpx.post(f"{gw.url}/v1/embeddings", timeout=30, json={"model": MODEL, "input": [[2**70]]})
    assert r.status_code == 400 and _is_envelope(r.json()), r.text


@pytest.mark.timeout(600)  # three loads on lavapipe, each with a functional check of ~70 s on 2 cores
def test_repeated_crashes_fall_back_to_the_next_candidate(tmp_path: Path) -> None:
    from tests.test_builds import _vulkan_host_or_skip

    _vulkan_host_or_skip()
    # auto with --device llvmpipe: the plan is Vulkan on lavapipe, then the CPU. Its own cache
    # folder: giving up on Vulkan is recorded in the functional-check cache, which must not reach
    # the other tests (or the next run on this machine).
    cfg = yaml.safe_load((ROOT / "models.yaml").read_text())
    cfg["cache_dir"] = str(tmp_path / "cache")
    (tmp_path / "models.yaml").write_text(yaml.safe_dump(cfg))
    g = Gateway(tmp_path, "--engine", "auto", "--device", "llvmpipe", "--parallel", "1",
                "--config", str(tmp_path / "models.yaml"), env={"GATEWAY_WORKER_MAX_CRASHES": "2"})
    try:
        # Each rung of the Vulkan build's ladder (repacking off, then a lower CPU variant)
        # gives up after two crashes; then the CPU candidate serves.
        seen = []
        for _ in range(5):
            r = _chat(g.url)
            assert r.status_code == 200, r.text
            health = httpx.get(f"{g.url}/health", timeout=10).json()["models"][MODEL]
            seen.append((r.headers["x-engine"], health.get("cpu_variant"), health["repack"]))
            if len(seen) == 2:
                reason = r.headers["x-fallback-reason"]
                assert "llamacpp/vulkan" in reason and "SIGSEGV" in reason and "2 crashes" in reason, reason
            if r.headers["x-engine"] == "llamacpp/cpu":
                break
            first = _worker(g.url)["pid"]
            os.kill(first, signal.SIGSEGV)
            second = _ready_again(g.url, first, timeout=120)["pid"]
            os.kill(second, signal.SIGSEGV)  # the second crash within the window: the next rung
            assert _wait_gone(second, 5)
        engines = [e for e, _, _ in seen]
        assert engines[-1] == "llamacpp/cpu" and set(engines[:-1]) == {"llamacpp/vulkan"} and len(engines) >= 3, seen
        assert seen[0][2] == "on" and seen[1][2] == "off", seen
        assert "SIGSEGV" in health["fallback_reason"]
        metrics = httpx.get(f"{g.url}/metrics", timeout=10).text
        assert 'reason="worker_crashed"' in metrics
        assert "worker crashed" in g.log() or "giving up" in g.log() or "excluded" in g.log()
    finally:
        g.stop()


def test_a_warm_standby_takes_over_at_once(tmp_path: Path) -> None:
    """models.yaml `standby: true`: a second worker waits loaded; when the serving one dies the
    standby serves the stream on (no restart wait), and another standby is loaded behind it."""
    cfg = yaml.safe_load((ROOT / "models.yaml").read_text())
    for m in cfg["models"]:
        if m["id"] == MODEL:
            m["standby"] = True
    (tmp_path / "models.yaml").write_text(yaml.safe_dump(cfg))
    g = Gateway(tmp_path, "--parallel", "1", "--config", str(tmp_path / "models.yaml"),
                env={"GATEWAY_WORKER_MAX_CRASHES": "100"})
    try:
        deadline = time.monotonic() + 120
        while not _worker(g.url).get("standby", {}).get("ready") and time.monotonic() < deadline:
            time.sleep(0.1)
        before = _worker(g.url)
        spare = before["standby"]
        assert spare["ready"] and spare["pid"] not in (None, before["pid"]) and spare["rss_bytes"] > 10 << 20
        stream = Stream(g.url, max_tokens=120)
        _started(stream)
        os.kill(before["pid"], signal.SIGKILL)
        stream.wait(120)
        _finished_cleanly(stream)
        after = _ready_again(g.url, before["pid"])
        assert after["pid"] == spare["pid"]  # the standby took over
        deadline = time.monotonic() + 120
        while not _worker(g.url).get("standby", {}).get("ready") and time.monotonic() < deadline:
            time.sleep(0.2)
        again = _worker(g.url)["standby"]
        assert again["ready"] and again["pid"] not in (spare["pid"], before["pid"])
        pids = (again["pid"], spare["pid"])
    finally:
        g.stop()
    for pid in pids:  # neither outlives the gateway
        assert _wait_gone(pid, 10)


def test_a_stream_continues_on_the_next_engine_when_its_own_gives_up(tmp_path: Path) -> None:
    """One counted crash gives up on that way of running the model (GATEWAY_WORKER_MAX_CRASHES=1):
    the stream continues on the next rung of the ladder (the same build, repacking off)."""
    cfg = yaml.safe_load((ROOT / "models.yaml").read_text())
    cfg["cache_dir"] = str(tmp_path / "cache")  # the crash verdict stays in this test's cache
    (tmp_path / "models.yaml").write_text(yaml.safe_dump(cfg))
    g = Gateway(tmp_path, "--parallel", "1", "--config", str(tmp_path / "models.yaml"),
                env={"GATEWAY_WORKER_MAX_CRASHES": "1"})
    try:
        assert httpx.get(f"{g.url}/health", timeout=10).json()["models"][MODEL]["repack"] == "on"
        before = _worker(g.url)
        stream = Stream(g.url, max_tokens=150, include_usage=True)
        _started(stream)
        os.kill(before["pid"], signal.SIGSEGV)
        stream.wait(180)
        _finished_cleanly(stream)
        assert stream.chunks()[-1]["usage"]["completion_tokens"] == 150
        model = httpx.get(f"{g.url}/health", timeout=10).json()["models"][MODEL]
        assert model["repack"] == "off" and model["worker"]["pid"] != before["pid"], model
        metrics = httpx.get(f"{g.url}/metrics", timeout=10).text
        assert f'gateway_failovers_total{{model="{MODEL}",reason="next_engine"}} 1.0' in metrics
    finally:
        g.stop()


# --- a load stopped from outside is not the engine's verdict -------------------------------------


async def _load_and(tmp_path: Path, crash: bool) -> BaseException:
    """Load the slow-loading stand-in; SIGKILL its worker from here (or let it crash itself)."""
    import asyncio

    pid_file = tmp_path / "pid"
    env = {"SLOW_LOAD_PID_FILE": str(pid_file), **({"SLOW_LOAD_CRASH": "1"} if crash else {})}
    conn = LocalWorker("slow-load", EngineConfig("unused"), env=env, plugins=("tests.stuck_engine",))
    opening = asyncio.ensure_future(conn.open())
    if not crash:
        for _ in range(300):
            if pid_file.exists() and pid_file.read_text():
                break
            await asyncio.sleep(0.05)
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
    try:
        await asyncio.wait_for(opening, 30)
    except BaseException as exc:  # noqa: BLE001 - the outcome under test
        return exc
    raise AssertionError("the load went on")


async def test_a_load_killed_from_outside_is_interrupted_not_failed(tmp_path: Path) -> None:
    """A `kill -9` (an operator, a supervisor) during a load says nothing about the engine: the
    pool does not keep it as the engine's failed check (which would stop it being tried again)."""
    from engines.base import LoadInterrupted, ModelLoadError

    killed = await _load_and(tmp_path, crash=False)
    assert isinstance(killed, LoadInterrupted), killed
    assert "SIGKILL from outside while loading" in str(killed)
    crashed = await _load_and(tmp_path, crash=True)
    assert isinstance(crashed, ModelLoadError) and not isinstance(crashed, LoadInterrupted), crashed
    assert "SIGSEGV" in str(crashed)
