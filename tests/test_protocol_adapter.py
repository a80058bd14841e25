"""A new protocol is one adapter module: a small "echo protocol" (its own paths, field names, error
envelope and framing) added to a real gateway at start-up, served by the real engine, with nothing
in the neutral service changed. Its requests get the limits, errors and streaming every protocol
gets."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from gateway.api.adapter import Adapter, Protocols, drain, respond
from gateway.api.errors import APIError
from gateway.api.serving import Service
from gateway.app import create_app
from gateway.conversation import Conversation, Finished, Sampling, TextDelta, Turn
from gateway.models.registry import load_registry
from gateway.settings import Settings
from tests.conftest import NO_CHECKS, ROOT, ServerThread

MODEL = "smollm2-135m-instruct"

# --- the protocol: one module's worth --------------------------------------------------------------


def _envelope(err: APIError) -> tuple[int, dict[str, Any]]:
    return err.status, {"echo_error": {"field": err.param, "what": err.message}}


ECHO = Adapter("echo", "sse", owns=lambda path: path.startswith("/echo/"), envelope=_envelope,
               field_names={"messages": "lines", "max_tokens": "most"})


class SayRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    lines: list[str] = Field(min_length=1)
    most: int = Field(ge=1)
    stream: bool = False


echo_router = APIRouter()


@echo_router.post("/echo/say")
async def say(body: SayRequest, request: Request) -> Response:
    service: Service = request.app.state.chat
    conv = Conversation(turns=tuple(Turn.of("user", line) for line in body.lines),
                        sampling=Sampling(temperature=0.0, max_tokens=body.most))
    p = await service.prepare_conversation(service.spec(body.model), conv, 1, "echo", time.perf_counter())
    request.state.observer = p.observer
    said: list[str] = []
    end: dict[str, Any] = {}

    async def frames() -> AsyncIterator[str]:
        async for _i, e in service.conversation_events(p):
            if isinstance(e, TextDelta) and e.text:
                said.append(e.text)
                yield json.dumps({"piece": e.text})
            elif isinstance(e, Finished):
                end.update(why=e.reason, tokens=e.usage.completion_tokens if e.usage else None)
                yield json.dumps(end)

    async def whole() -> dict[str, Any]:
        await drain(frames())
        return {"said": "".join(said), **end}

    return await respond(request, ECHO, stream=body.stream, frames=frames, whole=whole, headers=p.headers,
                         release=p.release)


# --- the test -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def echo_url() -> Iterator[str]:
    registry = ROOT / "models.yaml"
    settings = Settings.from_env(env=NO_CHECKS, config=str(registry), parallel=2, max_resident=1, max_messages=3)
    app = create_app(settings, load_registry(registry))
    protocols: Protocols = app.state.protocols
    protocols.add(ECHO)
    app.include_router(echo_router)
    server = ServerThread(app).start()
    yield server.url
    server.stop()


def test_echo_protocol_answers_whole_and_streamed(echo_url: str) -> None:
    ask = {"model": MODEL, "lines": ["What is the capital of France?"], "most": 8}
    r = httpx.post(f"{echo_url}/echo/say", json=ask, timeout=120)
    assert r.status_code == 200, r.text
    whole = r.json()
    assert whole["said"].strip() and whole["why"] in ("stop", "length") and 0 < whole["tokens"] <= 8
    assert r.headers["x-engine"]  # the neutral service's headers reach the new protocol too

    with httpx.stream("POST", f"{echo_url}/echo/say", json={**ask, "stream": True}, timeout=120) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        data = [line.removeprefix("data: ") for line in s.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    frames = [json.loads(d) for d in data[:-1]]
    assert "".join(f.get("piece", "") for f in frames) == whole["said"]  # temperature 0: the same answer
    assert frames[-1] == {"why": whole["why"], "tokens": whole["tokens"]}


@pytest.mark.parametrize(("body", "status", "field", "words"), [
    # The neutral limit (max_messages 3), in the echo protocol's name for the field.
    ({"model": MODEL, "lines": ["a", "b", "c", "d"], "most": 4}, 400, "lines", "4 lines exceed the limit of 3"),
    ({"model": "no-such-model", "lines": ["a"], "most": 4}, 404, "model", "no-such-model"),
    ({"model": MODEL, "lines": ["a"], "most": 0}, 400, "most", "most"),
    ({"model": MODEL, "lines": ["a"], "most": 4, "extra": 1}, 400, "extra", "extra"),
])
def test_echo_protocol_errors_in_its_own_envelope(echo_url: str, body: dict[str, Any], status: int, field: str,
                                                   words: str) -> None:
    r = httpx.post(f"{echo_url}/echo/say", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["echo_error"]
    assert err["field"] == field and words in err["what"], err
    assert "messages" not in err["what"] or field != "lines"  # never the neutral name of the field


def test_echo_protocol_refusals_before_the_route_use_its_envelope(echo_url: str) -> None:
    """Bad JSON and the body limit are answered outside the route, still in the echo envelope; the
    other protocols keep theirs on the same app."""
    r = httpx.post(f"{echo_url}/echo/say", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "echo_error" in r.json(), r.text
    r = httpx.post(f"{echo_url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(f"{echo_url}/api/chat", content=b"{not json")
    assert r.status_code == 400 and isinstance(r.json()["error"], str)
