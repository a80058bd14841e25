"""Admission gates: slots, a queue bounded in length and in time, honest Retry-After."""

from __future__ import annotations

import asyncio

import pytest

from gateway.api.admission import Admission, Gate, GateClosed, Rejected


async def test_slots_then_fifo_queue() -> None:
    g = Gate(slots=2, max_queue=4, max_wait=5)
    assert await g.acquire() == 0.0 and await g.acquire() == 0.0
    order: list[int] = []

    async def wait(i: int) -> None:
        await g.acquire()
        order.append(i)

    tasks = [asyncio.create_task(wait(i)) for i in range(3)]
    await asyncio.sleep(0)
    assert (g.running, g.waiting) == (2, 3)
    for _ in range(3):
        g.release(1, held_s=1.0)
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]


async def test_full_queue_is_refused_at_once_with_retry_after() -> None:
    g = Gate(slots=1, max_queue=1, max_wait=60)
    await g.acquire()
    waiter = asyncio.create_task(g.acquire())
    await asyncio.sleep(0)
    with pytest.raises(Rejected) as r:
        await g.acquire()
    assert r.value.code == "queue_full" and r.value.retry_after >= 1
    g.release(1)
    await waiter


async def test_estimated_wait_over_the_limit_is_refused_at_once() -> None:
    g = Gate(slots=2, max_queue=100, max_wait=10)
    g.release(0, held_s=8.0)  # measured: a request holds its slot 8 s, so a slot frees every 4 s
    await g.acquire()
    await g.acquire()
    waiters = [asyncio.create_task(g.acquire()) for _ in range(2)]  # estimated waits 4 s and 8 s
    await asyncio.sleep(0)
    assert g.waiting == 2
    # The third in line would wait (2 + 1) * 4 = 12 s > 10 s: refused without queueing.
    with pytest.raises(Rejected) as r:
        await g.acquire()
    assert r.value.code == "queue_wait_exceeded"
    assert r.value.retry_after == 2  # ceil(12 - 10)
    assert g.waiting == 2
    g.close("test over")
    for w in waiters:
        with pytest.raises(GateClosed):
            await w


async def test_an_admitted_request_never_waits_past_the_limit() -> None:
    g = Gate(slots=1, max_queue=10, max_wait=0.2)
    await g.acquire()  # never released: no history, so the request is admitted to the queue
    with pytest.raises(Rejected) as r:
        await g.acquire()
    assert r.value.code == "queue_wait_exceeded"
    assert g.waiting == 0  # it left the queue


async def test_a_cancelled_waiter_leaves_the_queue_and_its_slot_is_not_lost() -> None:
    g = Gate(slots=1, max_queue=10, max_wait=10)
    await g.acquire()
    w = asyncio.create_task(g.acquire())
    await asyncio.sleep(0)
    w.cancel()
    with pytest.raises(asyncio.CancelledError):
        await w
    assert g.waiting == 0
    g.release(1)
    assert g.free == 1
    assert await g.acquire() == 0.0


async def test_a_request_for_several_choices_holds_several_slots() -> None:
    adm = Admission(max_queue=4, max_wait=5)
    t = await adm.admit("m", slots=4, n=3)
    g = adm.gates()["m"]
    assert g.free == 1
    t.release()
    t.release()  # idempotent
    assert g.free == 4
    big = await adm.admit("m", slots=4, n=16)  # more choices than slots: takes all of them
    assert g.free == 0
    big.release()


async def test_slots_granted_while_a_leaving_client_is_noticed_go_back() -> None:
    """The request is admitted in the moment the gateway checks whether its client is still there;
    the client has gone: the slot it was just given is released, not held by no one (a gateway
    whose clients time out under load otherwise ends with every slot taken and its engine idle)."""
    from gateway.api.errors import ClientDisconnected
    from gateway.api.sse import until_disconnect

    g = Gate(slots=1, max_queue=4, max_wait=30)
    await g.acquire()  # another request holds the only slot

    class Admitted:
        def __init__(self) -> None:
            self.released = False

        def release(self) -> None:
            self.released = True
            g.release(1)

    admitted = Admitted()

    async def prepare() -> Admitted:
        await g.acquire()
        return admitted

    class LeavingClient:
        async def is_disconnected(self) -> bool:
            g.release(1)  # the other request ends: the waiting one is admitted ...
            await asyncio.sleep(0.01)  # ... while this check is under way
            return True

    with pytest.raises(ClientDisconnected):
        await until_disconnect(LeavingClient(), prepare())  # type: ignore[arg-type]
    assert admitted.released and g.running == 0


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": True}),
    ("/api/chat", {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}),
])
def test_a_stream_whose_response_cannot_start_gives_its_slots_back(
        tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, path: str, body: dict[str, object]) -> None:
    """The server refuses to start the response (here a header value HTTP does not allow): the
    request's slots come back at once, not when the collector gets to the work behind the stream
    (which held them for minutes while the engine sat idle and other requests queued)."""
    import time
    from pathlib import Path

    import httpx

    from engines.base import EngineConfig
    from gateway.api import adapter
    from gateway.app import create_app
    from gateway.models.registry import load_registry
    from gateway.settings import Settings
    from tests import hosts
    from tests.conftest import NO_CHECKS, ServerThread
    from tests.fakes import FakeEngine

    d = Path(str(tmp_path))
    (d / "a.gguf").write_bytes(b"GGUF")
    (d / "models.yaml").write_text("default: m\nmodels:\n  - id: m\n    formats: {gguf: {path: a.gguf}}\n")

    def factory(runtime: str, config: EngineConfig) -> FakeEngine:
        return FakeEngine(config, script="one two three four five six seven eight", token_delay=0.05)

    app = create_app(Settings.from_env(env=NO_CHECKS, config=str(d / "models.yaml"), functional_check=False,
                                       parallel=2),
                     load_registry(d / "models.yaml", cache_dir=d / "cache"), engine_factory=factory,
                     host=hosts.CPU_ONLY)
    server = ServerThread(app).start()
    try:
        monkeypatch.setattr(adapter, "_read", lambda headers: {"X-Broken": "a, "})  # ends in whitespace
        with pytest.raises(httpx.HTTPError):  # the connection closed without a response
            httpx.post(f"{server.url}{path}", json=body, timeout=30)
        deadline = time.monotonic() + 3
        while (running := app.state.admission.gates()["m"].running) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running == 0
    finally:
        server.stop()
