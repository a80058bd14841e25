"""Bad input always gets the OpenAI error envelope with the right status, never a 500 or a hang."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import MODEL

MSG = [{"role": "user", "content": "hi"}]


def _check(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


CASES: list[tuple[str, dict[str, Any], int, str | None, str | None]] = [
    ("temperature too high", {"temperature": 2.5}, 400, "temperature", None),
    ("temperature negative", {"temperature": -0.1}, 400, "temperature", None),
    ("temperature wrong type", {"temperature": "hot"}, 400, "temperature", None),
    ("top_p above 1", {"top_p": 1.5}, 400, "top_p", None),
    ("top_p negative", {"top_p": -0.5}, 400, "top_p", None),
    ("max_tokens zero", {"max_tokens": 0}, 400, "max_tokens", None),
    ("max_completion_tokens negative", {"max_completion_tokens": -3}, 400, "max_completion_tokens", None),
    ("empty messages", {"messages": []}, 400, "messages", None),
    ("messages not a list", {"messages": "hi"}, 400, "messages", None),
    ("bad role", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", None),
    ("missing content type", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", None),
    ("image part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0].image_url.url", None),
    ("n too large", {"n": 100}, 400, "n", None),
    ("n zero", {"n": 0}, 400, "n", None),
    ("top_logprobs over 20", {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    ("top_logprobs without logprobs", {"top_logprobs": 2}, 400, "top_logprobs", None),
    ("stop wrong type", {"stop": 5}, 400, "stop", None),
    ("presence_penalty range", {"presence_penalty": 3}, 400, "presence_penalty", None),
    ("unknown field", {"frobnicate": True}, 400, "frobnicate", "unknown_parameter"),
    ("tools empty", {"tools": []}, 400, "tools", None),
    ("tool_choice without tools", {"tool_choice": "required"}, 400, "tool_choice", None),
    ("bad response_format", {"response_format": {"type": "xml"}}, 400, "response_format.type", None),
    ("json_schema without schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400, "response_format.json_schema", None),
    ("logit_bias key", {"logit_bias": {"abc": 1}}, 400, "logit_bias", None),
    ("stream_options without stream", {"stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ("missing model", {"model": None}, 400, "model", None),
]


@pytest.mark.parametrize("name,patch,status,param,code", CASES, ids=[c[0] for c in CASES])
def test_chat_bad_input(gateway_url: str, name: str, patch: dict[str, Any], status: int, param: str | None, code: str | None) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": MSG, "max_tokens": 2}
    body.update(patch)
    body = {k: v for k, v in body.items() if v is not None}
    _check(httpx.post(f"{gateway_url}/v1/chat/completions", json=body, timeout=30), status, param, code)


def test_malformed_json(gateway_url: str) -> None:
    r = httpx.post(
        f"{gateway_url}/v1/chat/completions",
        content=b'{"model": "x", "messages": [',
        headers={"content-type": "application/json"},
    )
    _check(r, 400, code="invalid_json")


def test_body_not_an_object(gateway_url: str) -> None:
    _check(httpx.post(f"{gateway_url}/v1/chat/completions", json=[1, 2]), 400)


def test_unknown_model(gateway_url: str) -> None:
    r = httpx.post(f"{gateway_url}/v1/chat/completions", json={"model": "nope", "messages": MSG})
    _check(r, 404, param="model", code="model_not_found")


@pytest.mark.parametrize("stream", [False, True])
def test_context_length_exceeded(gateway_url: str, stream: bool) -> None:
    long = "lorem ipsum dolor sit amet " * 600  # ~3000 tokens > 2048
    body = {"model": MODEL, "messages": [{"role": "user", "content": long}], "stream": stream}
    r = httpx.post(f"{gateway_url}/v1/chat/completions", json=body, timeout=60)
    # Decided before any stream byte: a plain JSON error, not an SSE stream.
    assert r.headers["content-type"].startswith("application/json")
    _check(r, 400, code="context_length_exceeded")


def test_completion_bad_input(gateway_url: str) -> None:
    url = f"{gateway_url}/v1/completions"
    _check(httpx.post(url, json={"model": MODEL, "prompt": "x", "suffix": "y"}), 400, param="suffix")
    _check(httpx.post(url, json={"model": MODEL, "prompt": "x", "logprobs": 50}), 400, param="logprobs")
    _check(httpx.post(url, json={"model": MODEL, "prompt": "x", "best_of": 3}), 400, param="best_of")
    _check(httpx.post(url, json={"model": MODEL, "prompt": []}), 400, param="prompt")
    _check(httpx.post(url, json={"model": MODEL, "prompt": ["a", 5]}), 400, param="prompt")
    _check(httpx.post(url, json={"model": MODEL}), 400, param="prompt")
    _check(httpx.post(url, json={"model": "nope", "prompt": "x"}), 404, code="model_not_found")


def test_unknown_route_and_method(gateway_url: str) -> None:
    _check(httpx.get(f"{gateway_url}/v1/nothing"), 404)
    _check(httpx.get(f"{gateway_url}/v1/chat/completions"), 405)


def test_a_response_message_goes_back_into_the_history_unchanged(gateway_url: str) -> None:
    """The OpenAI SDK pattern `messages.append(response.choices[0].message)`: our own message
    object, `refusal: null` and `tool_calls: null` included, is valid input for the next turn."""
    first = [{"role": "user", "content": "Name a fruit."}]
    r = httpx.post(f"{gateway_url}/v1/chat/completions", timeout=60,
                   json={"model": "smollm2-135m-instruct", "messages": first, "max_tokens": 4})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert "refusal" in message
    again = httpx.post(f"{gateway_url}/v1/chat/completions", timeout=60, json={
        "model": "smollm2-135m-instruct", "max_tokens": 4,
        "messages": [*first, message, {"role": "user", "content": "Another?"}]})
    assert again.status_code == 200, again.text
