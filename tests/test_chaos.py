"""Kills take nothing: a gateway with its defaults (the default model, its slots, its queue and
failover settings), eight streams through three SIGKILLs of its worker from outside, and a poison
request (one that crashes the worker each time it runs) dropped while the others finish."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import MODEL
from tests.poison_standin import POISON
from tests.test_production import Gateway, Stream, _is_envelope
from tests.test_workers import _finished_cleanly, _ready_again, _started, _worker


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    # Nothing tuned: the settings a user serves with (the plugin only acts on a POISON request).
    g = Gateway(tmp_path_factory.mktemp("chaos"), env={"GATEWAY_WORKER_PLUGINS": "tests.poison_standin"})
    yield g
    g.stop()


def test_eight_streams_finish_through_three_kills_from_outside(plain: Gateway) -> None:
    """8 streams of 160 tokens on the default 4 slots (4 run, 4 wait); the worker SIGKILLed three
    times, 2 s apart, each time after /health reports the model ready again: 8 of 8 finish whole,
    with no error and no 4xx/5xx (a kill from outside is nobody's doing: it uses up no request's
    failover budget and counts toward no poison rule)."""
    streams = [Stream(plain.url, max_tokens=160, include_usage=True) for _ in range(8)]
    _started(streams[0], 3)
    killed = 0
    for _ in range(3):
        watchdog_before = plain.log().count("): killing it")
        pid = _worker(plain.url)["pid"]
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except ProcessLookupError:
            # Gone by itself in between: only the watchdog may do that (a restarted worker replaying
            # eight streams on a loaded 2-core machine can miss its heartbeats; logged).
            assert plain.log().count("): killing it") > watchdog_before, plain.log()[-6000:]
        _ready_again(plain.url, pid, timeout=120)
        time.sleep(2)
    for s in streams:
        s.wait(300)
        _finished_cleanly(s)
        assert s.chunks()[-1]["usage"]["completion_tokens"] == 160
    log = plain.log()
    kills = [line for line in log.splitlines() if "from outside (not counted" in line and "crash(es) counted" in line]
    assert len(kills) == killed, log[-6000:]


def test_a_poison_request_is_dropped_after_two_crashes_while_the_others_finish(plain: Gateway) -> None:
    from concurrent.futures import ThreadPoolExecutor

    others = [Stream(plain.url, max_tokens=60) for _ in range(3)]
    _started(others[0], 3)
    with ThreadPoolExecutor(1) as pool:
        poison = pool.submit(httpx.post, f"{plain.url}/v1/chat/completions", timeout=300, json={
            "model": MODEL, "messages": [{"role": "user", "content": f"{POISON}: tell a story."}], "max_tokens": 20})
        r = poison.result(300)
    for s in others:
        s.wait(300)
        _finished_cleanly(s)
    assert r.status_code == 502 and _is_envelope(r.json(), "engine_failed"), r.text
    assert "2 crashes in a row" in r.json()["error"]["message"], r.text
    assert _worker(plain.url)["counted_crashes"] >= 2  # its two (the kills from outside before: none)
    ok = httpx.post(f"{plain.url}/v1/chat/completions", timeout=300, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert ok.status_code == 200, ok.text
