"""Anthropic's and Ollama's request bodies, typed, on a scripted engine: errors name the field as
the protocol does (`messages[0].content[1].type`, `options.top_p`), what the official clients send
by default is accepted, fields the models do not define are accepted and named in
`X-Ignored-Fields` at any depth, and the OpenAPI document shows the schemas."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import ollama
import pytest

from engines.base import EngineConfig
from gateway.app import create_app
from gateway.models.registry import load_registry
from gateway.settings import Settings
from tests import hosts
from tests.conftest import NO_CHECKS, ServerThread
from tests.fakes import FakeEngine

YAML = """
default: m
models:
  - id: m
    formats: {gguf: {path: a.gguf}}
  - id: e
    formats: {gguf: {path: a.gguf}}
    embedding_only: true
"""
MSG = [{"role": "user", "content": "Hi"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city now.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    d = tmp_path_factory.mktemp("schemas")
    (d / "a.gguf").write_bytes(b"GGUF")
    (d / "models.yaml").write_text(YAML)

    def factory(runtime: str, config: EngineConfig) -> FakeEngine:
        return FakeEngine(config, script="Hello there")

    settings = Settings.from_env(env=NO_CHECKS, config=str(d / "models.yaml"), functional_check=False)
    app = create_app(settings, load_registry(d / "models.yaml", cache_dir=d / "cache"), engine_factory=factory,
                     host=hosts.CPU_ONLY)
    server = ServerThread(app).start()
    yield server.url
    server.stop()


def _messages(url: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/messages", json={"model": "m", "max_tokens": 8, **body}, timeout=10)


def _anthropic_error(r: httpx.Response) -> str:
    assert r.status_code == 400, r.text
    j = r.json()
    assert j["type"] == "error" and j["error"]["type"] == "invalid_request_error", j
    message: str = j["error"]["message"]
    return message


# --- Anthropic ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("messages", "where", "says"), [
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "video", "url": "x"}]}],
     "messages[0].content[1].type", "unknown content block type 'video'"),
    ([{"role": "user", "content": [{"text": "no type"}]}], "messages[0].content[0].type", "missing"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text", "missing"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content[0].text", "string"),
    ([{"role": "user", "content": ["a string is not a block"]}], "messages[0].content[0]", "must be an object"),
    ([{"role": "user", "content": 5}], "messages[0].content", "a string or a list of content blocks"),
    ([*MSG, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "input": {}}]}],
     "messages[1].content[0].name", "missing"),
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "tool_use"}]}]}],
     "messages[0].content[0].content[0].type", "unknown content block type 'tool_use'"),
])
def test_a_bad_block_is_400_naming_it(url: str, messages: list[Any], where: str, says: str) -> None:
    message = _anthropic_error(_messages(url, messages=messages))
    assert where in message and says in message, message
    assert "tagged-union" not in message and ".text.text" not in message


@pytest.mark.parametrize(("body", "where"), [
    ({"tools": [{"description": "no name", "input_schema": {"type": "object"}}]}, "tools[0].name"),
    ({"tools": [{"name": "", "input_schema": {"type": "object"}}]}, "tools[0].name"),
    ({"tools": [WEATHER, {"name": "f"}]}, "tools[1].input_schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "maybe"}}, "thinking.type"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
    ({"system": [{"type": "text"}]}, "system[0].text"),
    ({"top_k": -1}, "top_k"),
])
def test_bad_tools_choices_and_settings_are_400_naming_them(url: str, body: dict[str, Any], where: str) -> None:
    message = _anthropic_error(_messages(url, messages=MSG, **body))
    assert where in message, message


def test_what_the_sdk_sends_is_accepted(url: str) -> None:
    """Prompt caching's `cache_control`, `citations: null`, `metadata`, blocks of the gateway's own
    answer sent back (a thinking block with its empty signature), a tool round trip."""
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0) as claude:
        m = claude.messages.create(  # type: ignore[call-overload]
            model="m", max_tokens=8, metadata={"user_id": "u"},
            system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            tools=[{**WEATHER, "cache_control": {"type": "ephemeral"}}],
            messages=[{"role": "user", "content": [{"type": "text", "text": "Weather?", "citations": None,
                                                    "cache_control": {"type": "ephemeral", "ttl": "5m"}}]},
                      {"role": "assistant", "content": [
                          {"type": "thinking", "thinking": "They ask.", "signature": ""},
                          {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Rome"}}]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": False,
                                                    "content": [{"type": "text", "text": "Sunny"}]}]}])
        raw = claude.messages.with_raw_response.create(model="m", max_tokens=8, messages=MSG)  # type: ignore[arg-type]
    assert m.type == "message" and m.stop_reason is not None
    assert raw.http_response.status_code == 200 and "x-ignored-fields" not in raw.headers


def test_fields_not_defined_are_named_at_any_depth(url: str) -> None:
    r = _messages(url, context_management={"edits": []}, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Hi", "frobnicate": 1}], "note": "x"}],
        thinking={"type": "enabled", "budget_tokens": 2048, "display": "omitted"},
        output_config={"effort": "low"}, tools=[{**WEATHER, "defer_loading": True}, {"type": "bash_20250124",
                                                                                     "name": "bash"}])
    assert r.status_code == 200, r.text
    # The scripted model does not think: `thinking` is named whole.
    assert r.headers["x-ignored-fields"].split(", ") == [
        "context_management", "messages[0].content[0].frobnicate", "messages[0].note", "output_config.effort",
        "thinking", "thinking.display", "tools[0].defer_loading"]
    assert r.headers["x-skipped-tools"] == "bash"


# --- Ollama -------------------------------------------------------------------------------------------


def _ollama(url: str, path: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": "m", "stream": False, **body}, timeout=10)


def _ollama_error(r: httpx.Response) -> str:
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"}
    error: str = r.json()["error"]
    return error


@pytest.mark.parametrize(("options", "where"), [
    ({"top_p": 2}, "options.top_p"),
    ({"temperature": -1}, "options.temperature"),
    ({"top_k": 2.5}, "options.top_k"),
    ({"min_p": 1.5}, "options.min_p"),
    ({"presence_penalty": 3}, "options.presence_penalty"),
    ({"repeat_penalty": 0}, "options.repeat_penalty"),
    ({"seed": "lucky"}, "options.seed"),
    ({"num_predict": "many"}, "options.num_predict"),
])
def test_an_option_out_of_range_is_400_naming_it(url: str, options: dict[str, Any], where: str) -> None:
    for path, body in (("/api/chat", {"messages": MSG}), ("/api/generate", {"prompt": "Hi"})):
        error = _ollama_error(_ollama(url, path, options=options, **body))
        assert where in error, error


def test_options_without_a_sampler_and_unknown_ones_are_accepted_and_named(url: str) -> None:
    r = _ollama(url, "/api/chat", messages=MSG, options={"temperature": 0, "num_predict": 2, "mirostat": 1,
                                                         "num_ctx": 4096, "frobnicate": True, "seed": None})
    assert r.status_code == 200, r.text
    assert r.headers["x-ignored-fields"] == "options.frobnicate, options.mirostat, options.num_ctx"
    r = _ollama(url, "/api/generate", prompt="Hi", options={"num_predict": 2, "stop": "x"})
    assert r.status_code == 200 and "x-ignored-fields" not in r.headers, r.text


@pytest.mark.parametrize(("body", "where"), [
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content"),
    ({"messages": [*MSG, {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}}}]}]},
     "messages[1].tool_calls[0].function.name"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools[0].function.name"),
    ({"messages": MSG, "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": [{"role": "user", "content": "hi", "images": ["AA=="]}]}, "messages[0].images[0]"),
    ({"messages": MSG, "format": "xml"}, "format"),
])
def test_bad_chat_bodies_are_400_naming_the_field(url: str, body: dict[str, Any], where: str) -> None:
    error = _ollama_error(_ollama(url, "/api/chat", **body))
    assert where in error, error


def test_what_ollama_clients_send_is_accepted(url: str) -> None:
    """The client's tool round trip with the gateway's own message sent back (its call `id` and
    `index`), an empty `images`, and fields Ollama's API does not define, named."""
    client = ollama.Client(host=url)
    try:
        first = client.chat(model="m", messages=MSG, options={"num_predict": 2})
    finally:
        client._client.close()
    assert first.message.content
    r = _ollama(url, "/api/chat", logprobs=True, messages=[
        {"role": "user", "content": "Weather?", "images": []},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0", "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_name": "get_weather", "tool_call_id": "call_0", "content": "Sunny"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"]}}])
    assert r.status_code == 200, r.text
    assert r.headers["x-ignored-fields"] == "logprobs, messages[2].tool_call_id"


def test_ollama_routes_read_json_whatever_the_content_type(url: str) -> None:
    r = httpx.post(f"{url}/api/chat", timeout=10, headers={"content-type": "text/plain"},
                   content=b'{"model": "m", "stream": false, "messages": [{"role": "user", "content": "Hi"}]}')
    assert r.status_code == 200 and r.json()["message"]["content"], r.text


def test_create_parameters_are_the_options(url: str) -> None:
    error = _ollama_error(_ollama(url, "/api/create", model="mine", parameters={"top_p": 7}, **{"from": "m"}))
    assert "parameters.top_p" in error


# --- the OpenAPI document -----------------------------------------------------------------------------


def _schema(doc: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = doc["components"]["schemas"][ref["$ref"].rsplit("/", 1)[1]]
    return found


def _body(doc: dict[str, Any], path: str) -> dict[str, Any]:
    return _schema(doc, doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"])


def test_the_openapi_document_shows_the_typed_bodies(url: str) -> None:
    doc = httpx.get(f"{url}/openapi.json", timeout=10).json()
    messages = _body(doc, "/v1/messages")["properties"]
    message = _schema(doc, messages["messages"]["items"])
    assert message["properties"]["role"]["enum"] == ["user", "assistant", "system"]
    blocks = next(m for m in message["properties"]["content"]["oneOf"] if m.get("type") == "array")["items"]
    assert blocks["discriminator"]["propertyName"] == "type"
    assert {"text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking", "document"} <= \
        set(blocks["discriminator"]["mapping"])
    tool_result = _schema(doc, {"$ref": blocks["discriminator"]["mapping"]["tool_result"]})
    assert tool_result["required"] == ["type", "tool_use_id"]
    tool = _schema(doc, next(m for m in messages["tools"]["anyOf"] if m.get("type") == "array")["items"]["oneOf"][0])
    assert {"name", "description", "input_schema"} <= set(tool["properties"]) and "name" in tool["required"]
    choices = next(m for m in messages["tool_choice"]["anyOf"] if "discriminator" in m)["discriminator"]["mapping"]
    assert set(choices) == {"auto", "any", "tool", "none"}
    thinking = next(m for m in messages["thinking"]["anyOf"] if "discriminator" in m)["discriminator"]["mapping"]
    assert set(thinking) == {"enabled", "adaptive", "disabled"}

    chat = _body(doc, "/api/chat")["properties"]
    ollama_message = _schema(doc, chat["messages"]["items"])
    assert ollama_message["properties"]["role"]["enum"] == ["system", "user", "assistant", "tool"]
    assert {"content", "images", "tool_calls", "thinking", "tool_name"} <= set(ollama_message["properties"])
    options = _schema(doc, next(m for m in chat["options"]["anyOf"] if "$ref" in m))["properties"]
    top_p = next(m for m in options["top_p"]["anyOf"] if m.get("type") == "number")
    assert (top_p["minimum"], top_p["maximum"]) == (0, 1)
    assert {"num_predict", "temperature", "top_k", "min_p", "seed", "stop", "repeat_penalty", "presence_penalty",
            "frequency_penalty", "num_ctx"} <= set(options)
    function = _schema(doc, _schema(doc, next(m for m in chat["tools"]["anyOf"] if m.get("type") == "array")["items"])
                       ["properties"]["function"])
    assert function["required"] == ["name"]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/messages", {"model": "e", "max_tokens": 8, "messages": MSG}),
    ("/api/chat", {"model": "e", "messages": MSG, "stream": False}),
    ("/api/generate", {"model": "e", "prompt": "Hi", "stream": False}),
    ("/v1/responses", {"model": "e", "input": "Hi"}),
    ("/v1/chat/completions", {"model": "e", "messages": MSG}),
])
def test_errors_name_no_other_protocols_route(url: str, path: str, body: dict[str, Any]) -> None:
    """A generation request for an embedding model is a 400 that names the model in the client's own
    envelope, and tells no Anthropic or Ollama client about another protocol's route."""
    r = httpx.post(f"{url}{path}", json=body, timeout=10)
    assert r.status_code == 400, r.text
    j = r.json()
    message = j["error"]["message"] if isinstance(j["error"], dict) else j["error"]
    assert "e" in message and "/v1/" not in message and "/api/" not in message, message
    if path == "/v1/messages":
        assert j["type"] == "error" and j["error"]["type"] == "invalid_request_error"


def test_a_field_named_with_control_characters_is_named_safely(url: str) -> None:
    """An unknown field whose name holds a NUL or a newline is named in `X-Ignored-Fields` with `?`
    in their place: a header with control characters would cut the connection instead."""
    r = _messages(url, messages=MSG, **{"\u0000": None, "a\nb": 1})
    assert r.status_code == 200, r.text
    named = r.headers["x-ignored-fields"]
    assert "?" in named and "\x00" not in named and "\n" not in named, named
