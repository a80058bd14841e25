"""The fuzzing stage: schemathesis generates requests for every operation of the gateway's own
OpenAPI document and sends them to the real gateway on the real model.

Checks: no 5xx; status codes, content types and JSON bodies as documented; every error in the
OpenAI envelope; every SSE stream made of documented chunks (or an in-band error) ending in
`[DONE]`. Valid and invalid (negative) requests are both generated. The model is fixed to the
served one and `max_tokens` kept at most 4 so the stage takes minutes on 2 cores.

Deterministic by default (`derandomize`), so CI cannot turn red without a commit; set
FUZZ_RANDOM=1 and FUZZ_EXAMPLES=N to explore further.
"""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from pydantic import BaseModel, ValidationError
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.config import SchemathesisConfig

from gateway.api.anthropic.messages import MessageStreamEvent
from gateway.api.ollama.adapter import owns as is_ollama
from gateway.api.openai.protocol import ChatCompletionChunk, Completion, ErrorResponse
from gateway.api.openai.responses_schema import ResponseStreamEvent
from tests.conftest import MODEL

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "120"))
MAX_TOKENS = 4

@pytest.fixture(scope="session")
def api_schema(gateway_url: str) -> Any:
    # Whole streams: schemathesis stops reading an event stream after 20 events by default, and
    # n=16 choices of MAX_TOKENS tokens send about 100.
    config = SchemathesisConfig.from_dict({"max-stream-events": 1000})
    return schemathesis.openapi.from_url(f"{gateway_url}/openapi.json", config=config)


def _is_envelope(body: Any) -> bool:
    try:
        ErrorResponse.model_validate(body)
    except ValidationError:
        return False
    return set(body["error"]) == {"message", "type", "param", "code"}


class FuzzFailure(AssertionError):
    pass


def _is_anthropic_envelope(body: Any) -> bool:
    return (isinstance(body, dict) and set(body) == {"type", "error"} and body["type"] == "error"
            and isinstance(body["error"], dict) and set(body["error"]) == {"type", "message"}
            and all(isinstance(v, str) for v in body["error"].values()))


def error_envelope(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every error response is the OpenAI envelope with all four fields (Anthropic's on its routes)."""
    if response.status_code < 400 or case.method.upper() == "HEAD":  # a HEAD answer has no body
        return None
    try:
        body = json.loads(response.content)
    except ValueError:
        raise FuzzFailure(f"{response.status_code} body is not JSON: {response.content[:200]!r}") from None
    if is_ollama(case.path):
        if not (isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], str)):
            raise FuzzFailure(f"{response.status_code} is not in Ollama's error shape: {body!r}")
        return True
    if case.path.startswith("/v1/messages"):
        if not _is_anthropic_envelope(body):
            raise FuzzFailure(f"{response.status_code} is not in Anthropic's error envelope: {body!r}")
        return True
    if not _is_envelope(body):
        raise FuzzFailure(f"{response.status_code} is not in the OpenAI error envelope: {body!r}")
    return True


def sse_stream(ctx: Any, response: Any, case: Any) -> bool | None:
    """An SSE answer: documented chunks (or one in-band error envelope), then `data: [DONE]`."""
    if not response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        return None
    if case.path == "/v1/responses":
        return _responses_stream(response)
    if case.path == "/v1/messages":
        return _messages_stream(response)
    chunk: type[BaseModel] = ChatCompletionChunk if case.path.endswith("/chat/completions") else Completion
    frames = [ln[6:] for ln in response.content.decode().splitlines() if ln.startswith("data: ")]
    if not frames or frames[-1] != "[DONE]":
        raise FuzzFailure(f"stream does not end with [DONE]: {frames[-3:]!r}")
    for f in frames[:-1]:
        data = json.loads(f)
        if "error" in data:
            if not _is_envelope(data) or f is not frames[-2]:
                raise FuzzFailure(f"bad in-band error frame: {f[:300]}")
            continue
        try:
            chunk.model_validate(data)
        except ValidationError as exc:
            raise FuzzFailure(f"chunk does not match {chunk.__name__}: {exc}; {f[:300]}") from None
    return True


def _responses_stream(response: Any) -> bool:
    """Named events (`event:` then `data:`), numbered from 0, the type repeated in the data, the last one
    terminal, no [DONE]."""
    blocks = [b for b in response.content.decode().replace("\r\n", "\n").split("\n\n") if b.strip()
              and not b.startswith(":")]
    events = []
    for b in blocks:
        lines = b.split("\n")
        if len(lines) != 2 or not lines[0].startswith("event: ") or not lines[1].startswith("data: "):
            raise FuzzFailure(f"not an `event:` + `data:` block: {b[:200]!r}")
        data = ResponseStreamEvent.model_validate(json.loads(lines[1][6:]))
        if data.type != lines[0][7:]:
            raise FuzzFailure(f"event {lines[0][7:]!r} carries type {data.type!r}")
        events.append(data)
    if [e.sequence_number for e in events] != list(range(len(events))):
        raise FuzzFailure("sequence numbers are not 0, 1, 2, ...")
    if not events or events[-1].type not in ("response.completed", "response.incomplete", "response.failed"):
        raise FuzzFailure(f"the stream does not end with a terminal event: {events[-1:]!r}")
    return True


def ndjson_stream(ctx: Any, response: Any, case: Any) -> bool | None:
    """Ollama's stream: one JSON object per line, `done: false` until the last (`done: true`), or an
    `{"error"}` line last."""
    if not response.headers.get("content-type", [""])[0].startswith("application/x-ndjson"):
        return None
    lines = response.content.decode().split("\n")
    if lines[-1] != "" or not all(lines[:-1]):
        raise FuzzFailure(f"not newline-terminated JSON lines: {response.content[-200:]!r}")
    objs = [json.loads(x) for x in lines[:-1]]
    if objs and set(objs[-1]) == {"error"}:
        objs = objs[:-1]
    elif case.path in ("/api/pull", "/api/create"):  # progress lines, then success
        if not objs or objs[-1] != {"status": "success"}:
            raise FuzzFailure(f"a {case.path} stream does not end with success: {objs[-1:]!r}")
        return True
    elif not objs or objs[-1].get("done") is not True:
        raise FuzzFailure(f"the stream does not end with done: {objs[-1:]!r}")
    if any(o.get("done") for o in objs[:-1]):
        raise FuzzFailure("done before the last line")
    return True


def _messages_stream(response: Any) -> bool:
    """Anthropic's named events in order: message_start, ping, blocks (start, deltas, stop), then
    message_delta and message_stop; or an in-band error event last."""
    blocks = [b for b in response.content.decode().replace("\r\n", "\n").split("\n\n") if b.strip()
              and not b.startswith(":")]
    names = []
    for b in blocks:
        lines = b.split("\n")
        if len(lines) != 2 or not lines[0].startswith("event: ") or not lines[1].startswith("data: "):
            raise FuzzFailure(f"not an `event:` + `data:` block: {b[:200]!r}")
        data = MessageStreamEvent.model_validate(json.loads(lines[1][6:]))
        if data.type != lines[0][7:]:
            raise FuzzFailure(f"event {lines[0][7:]!r} carries type {data.type!r}")
        names.append(data.type)
    if names[-1:] == ["error"]:
        return True
    if names[:2] != ["message_start", "ping"] or names[-2:] != ["message_delta", "message_stop"]:
        raise FuzzFailure(f"events out of Anthropic's order: {names!r}")
    return True


def _pin(body: Any, path: str = "") -> None:
    """The served model and a few output tokens; everything else as generated."""
    if not isinstance(body, dict):
        return
    if is_ollama(path):  # Ollama's: the limit is options.num_predict; keep the model loaded
        if "model" in body:
            body["model"] = MODEL
        if path in ("/api/pull", "/api/delete"):  # never a Hub name: nothing is downloaded, nothing removed
            body["model"] = MODEL
            body.pop("name", None)
        if path == "/api/create":  # one model of its own, made from the served one (nothing downloaded)
            body.update({"model": MADE[0], "from": MODEL})
            for key in ("name", "files", "quantize", "modelfile"):
                body.pop(key, None)
        if path == "/api/copy":
            body.update({"source": MODEL, "destination": MADE[1]})
        if path in ("/api/chat", "/api/generate"):
            options = body.get("options") if isinstance(body.get("options"), dict) else {}
            body["options"] = {**options, "num_predict": MAX_TOKENS}
        body.pop("keep_alive", None)
        return
    if "model" in body or "messages" in body or "prompt" in body or "input" in body:
        body["model"] = MODEL
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body.get(key), bool) and body[key] > MAX_TOKENS:
            body[key] = MAX_TOKENS
    generates = "messages" in body or "prompt" in body
    if generates and not any(isinstance(body.get(k), int) for k in ("max_tokens", "max_completion_tokens")):
        body["max_tokens"] = MAX_TOKENS  # absent or null would mean "until the context is full"
    if "input" in body and not isinstance(body.get("max_output_tokens"), int):
        body["max_output_tokens"] = MAX_TOKENS


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          error_envelope, sse_stream, ndjson_stream]


# Every operation of the document; test_every_operation_is_fuzzed keeps this list complete.
OPERATIONS = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/embeddings"),
              ("POST", "/apply-template"),
              ("GET", "/v1/models"), ("GET", "/v1/models/{model_id}"), ("GET", "/health"), ("GET", "/metrics"),
              ("GET", "/v1/checks/{model_id}"), ("POST", "/v1/checks/{model_id}"),
              ("GET", "/health/ready"), ("GET", "/health/live"),
              ("GET", "/api/status"), ("GET", "/api/devices"),
              ("POST", "/api/models/{model_id}/load"), ("POST", "/api/models/{model_id}/unload"),
              ("POST", "/v1/responses"), ("GET", "/v1/responses/{response_id}"),
              ("DELETE", "/v1/responses/{response_id}"), ("GET", "/v1/responses/{response_id}/input_items"),
              ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"),
              ("POST", "/api/chat"), ("POST", "/api/generate"), ("POST", "/api/embed"), ("POST", "/api/embeddings"),
              ("GET", "/api/tags"), ("POST", "/api/show"), ("GET", "/api/ps"), ("GET", "/api/version"),
              ("POST", "/api/pull"), ("DELETE", "/api/delete"), ("POST", "/api/create"), ("POST", "/api/copy"),
              ("HEAD", "/api/blobs/{digest}"), ("POST", "/api/blobs/{digest}")]
# The models the fuzzed /api/create and /api/copy make (removed after them).
MADE = ("fuzz-made", "fuzz-copy")


def test_every_operation_is_fuzzed(api_schema: Any) -> None:
    documented = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert documented == set(OPERATIONS)


# schemathesis' own pytest plugin does not run under pytest 9, so the strategies are driven here.
# Invalid (negative) requests only where there is input to break: the request bodies (load/unload and the
# capability check have none).
CASES = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + \
    [(m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS
     if m == "POST" and p.startswith("/v1/") and not p.startswith("/v1/checks/")]


@pytest.mark.parametrize(("method", "path", "mode"), CASES,
                         ids=[f"{m} {p} {g.value}" for m, p, g in CASES])
def test_api(api_schema: Any, gateway_url: str, method: str, path: str, mode: GenerationMode) -> None:
    operation = api_schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES if method == "POST" else 10, deadline=None,
              derandomize=os.environ.get("FUZZ_RANDOM") != "1", suppress_health_check=list(HealthCheck),
              database=None)
    def run(case: Any) -> None:
        _pin(case.body, path)
        response = case.call(timeout=120)
        case.validate_response(response, checks=CHECKS)

    try:
        run()
    finally:
        if path in ("/api/create", "/api/copy"):
            for name in MADE:
                httpx.request("DELETE", f"{gateway_url}/api/delete", json={"model": name}, timeout=30)
