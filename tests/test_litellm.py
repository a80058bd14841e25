"""LiteLLM as a client of the gateway, on the real engine and model: its `ollama_chat/` provider
(/api/chat), its `ollama/` provider (/api/generate), its `openai/` provider (/v1/chat/completions)
and its `anthropic/` provider (/v1/messages), whole and streamed, sync and async, with tools.

LiteLLM's `ollama_chat/` requests are not what Ollama's own client sends: the sync client posts the
JSON body with no Content-Type and the async one (aiohttp) labels it application/octet-stream, and
every message carries `"images": []`. The gateway reads an Ollama body as JSON whatever its
Content-Type says, and an empty `images` is no image.

LiteLLM fetches its model cost map from the network when imported unless told to use the copy it
ships, and its tiktoken encodings are bundled: these tests talk to nothing beyond the loopback."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import ModuleType
from typing import Any

import httpx
import pytest

from tests.conftest import MODEL

# Pydantic's warnings about LiteLLM's own code: TypedDicts with ReadOnly items (once per class, as
# LiteLLM loads them) and, where it checks whether a stream chunk is empty, model_fields and
# model_computed_fields read off an instance.
pytestmark = [pytest.mark.filterwarnings("ignore:Item.* using the `ReadOnly` qualifier:UserWarning"),
              pytest.mark.filterwarnings("ignore:Accessing the 'model_(computed_)?fields' attribute on the instance")]

Q = [{"role": "user", "content": "Name three colours."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 12, "timeout": 240}


@pytest.fixture(scope="module")
def litellm() -> ModuleType:
    """LiteLLM, imported here rather than when the suite is collected (it takes seconds), after the
    switches that keep it from fetching its model cost map (its bundled copy serves)."""
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    os.environ["LITELLM_OFFLINE_MODE"] = "True"
    import litellm as module

    module.suppress_debug_info = True
    return module


def streamed(chunks: Any) -> tuple[str, list[str], Any]:
    """(the text, the finish reasons, the last usage seen) of a LiteLLM stream."""
    text, reasons, usage = "", [], None
    for c in chunks:
        if c.choices:
            text += c.choices[0].delta.content or ""
            if c.choices[0].finish_reason:
                reasons.append(c.choices[0].finish_reason)
        usage = getattr(c, "usage", None) or usage
    return text, reasons, usage


def assert_usage(usage: Any, completion_max: int, ollama: bool = False) -> None:
    """Ollama's prompt_eval_count (LiteLLM's prompt_tokens there) counts the prompt tokens evaluated,
    not those the cache held: at least the last one with llama.cpp, none if an engine kept them all."""
    assert usage is not None
    assert usage.prompt_tokens >= 0 if ollama else usage.prompt_tokens > 0
    assert 0 < usage.completion_tokens <= completion_max
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


# --- what LiteLLM puts on the wire ------------------------------------------------------------------


class Recorder:
    """A loopback reverse proxy in front of the gateway that keeps each request as it arrived
    (path, headers, body); answers are passed back whole."""

    def __init__(self, upstream: str) -> None:
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                headers = {k.lower(): v for k, v in self.headers.items()}
                recorder.requests.append((self.path, headers, body))
                forward = {k: v for k, v in headers.items() if k not in ("host", "content-length", "connection")}
                try:
                    r = httpx.post(upstream + self.path, content=body, headers=forward, timeout=240)
                    status, ctype, data = r.status_code, r.headers.get("content-type", ""), r.content
                except httpx.HTTPError as exc:
                    status, ctype, data = 502, "text/plain", str(exc).encode()
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(data)))
                self.send_header("connection", "close")
                self.close_connection = True
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def posted(self, path: str) -> list[tuple[dict[str, str], dict[str, Any]]]:
        return [(h, json.loads(b)) for p, h, b in self.requests if p == path]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def recorder(gateway_url: str) -> Iterator[Recorder]:
    r = Recorder(gateway_url)
    yield r
    r.close()


def test_ollama_chat_request_without_content_type_and_with_empty_images(litellm: ModuleType,
                                                                       recorder: Recorder) -> None:
    r = litellm.completion(model=f"ollama_chat/{MODEL}", api_base=recorder.url, messages=Q, **GREEDY)
    assert r.choices[0].message.content.strip() and r.choices[0].finish_reason == "length"
    [(headers, body)] = recorder.posted("/api/chat")
    assert "content-type" not in headers
    assert body["messages"] == [{**Q[0], "images": []}] and body["stream"] is False
    assert body["options"] == {"temperature": 0, "num_predict": 12}


async def test_ollama_chat_async_request_labelled_octet_stream(litellm: ModuleType,
                                                                recorder: Recorder) -> None:
    r = await litellm.acompletion(model=f"ollama_chat/{MODEL}", api_base=recorder.url, messages=Q, **GREEDY)
    assert r.choices[0].message.content.strip() and r.choices[0].finish_reason == "length"
    [(headers, body)] = recorder.posted("/api/chat")
    assert headers.get("content-type") in (None, "application/octet-stream")
    assert body["messages"] == [{**Q[0], "images": []}]


# --- ollama_chat/ -------------------------------------------------------------------------------------


def test_ollama_chat_whole_and_streamed(litellm: ModuleType, gateway_url: str) -> None:
    kw: dict[str, Any] = {"model": f"ollama_chat/{MODEL}", "api_base": gateway_url, "messages": Q, **GREEDY}
    whole = litellm.completion(**kw)
    c = whole.choices[0]
    assert c.message.role == "assistant" and c.message.content.strip()
    assert c.finish_reason == "length"  # 12 tokens do not name three colours
    assert whole.model == f"ollama_chat/{MODEL}"
    assert_usage(whole.usage, 12, ollama=True)
    assert whole.usage.completion_tokens == 12

    text, reasons, usage = streamed(litellm.completion(**kw, stream=True, stream_options={"include_usage": True}))
    assert text == c.message.content
    assert reasons == ["length"]
    assert_usage(usage, 12, ollama=True)


async def test_ollama_chat_async_streamed(litellm: ModuleType, gateway_url: str) -> None:
    kw: dict[str, Any] = {"model": f"ollama_chat/{MODEL}", "api_base": gateway_url, "messages": Q, **GREEDY}
    whole = await litellm.acompletion(**kw)
    stream = await litellm.acompletion(**kw, stream=True)
    text, reasons = "", []
    async for c in stream:
        if c.choices:
            text += c.choices[0].delta.content or ""
            reasons += [c.choices[0].finish_reason] if c.choices[0].finish_reason else []
    assert text and text == whole.choices[0].message.content
    assert reasons == ["length"]


def test_ollama_chat_tools_round_trip(litellm: ModuleType, gateway_url: str) -> None:
    """LiteLLM drops tool_choice for Ollama (its API has none): the model calls the tool or answers.
    A streamed call, rebuilt by LiteLLM, comes back in OpenAI's shape; its result goes back as a tool
    message with the call's id, which Ollama's messages do not carry (the gateway answers the oldest
    open call)."""
    kw: dict[str, Any] = {"model": f"ollama_chat/{MODEL}", "api_base": gateway_url, "tools": [WEATHER],
                          "temperature": 0, "timeout": 240}
    msgs: list[Any] = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    chunks = list(litellm.completion(**kw, messages=msgs, max_tokens=64, stream=True,
                                     stream_options={"include_usage": True}))
    first = litellm.stream_chunk_builder(chunks, messages=msgs)
    c = first.choices[0]
    assert_usage(first.usage, 64, ollama=True)
    if not c.message.tool_calls:
        assert c.message.content and c.finish_reason in ("stop", "length")
        return
    assert c.finish_reason == "tool_calls"
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)

    msgs += [c.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    second = litellm.completion(**kw, messages=msgs, max_tokens=32)
    s = second.choices[0]
    assert s.finish_reason in ("stop", "length", "tool_calls")
    assert s.message.content or s.message.tool_calls
    assert_usage(second.usage, 32, ollama=True)


# --- ollama/ (/api/generate) ----------------------------------------------------------------------------


def test_ollama_generate_whole_and_streamed(litellm: ModuleType, gateway_url: str) -> None:
    """LiteLLM's `ollama/` provider renders the messages into a prompt of its own and posts it to
    /api/generate (the gateway applies the model's chat template to it, as Ollama does). It reports
    every finish as "stop", whatever done_reason says."""
    kw: dict[str, Any] = {"model": f"ollama/{MODEL}", "api_base": gateway_url, "messages": Q, **GREEDY}
    whole = litellm.completion(**kw)
    c = whole.choices[0]
    assert c.message.content.strip() and c.finish_reason == "stop"
    assert_usage(whole.usage, 12, ollama=True)
    text, reasons, _ = streamed(litellm.completion(**kw, stream=True))
    assert text == c.message.content and reasons == ["stop"]


# --- openai/ ------------------------------------------------------------------------------------------


def openai_kw(gateway_url: str) -> dict[str, Any]:
    return {"model": f"openai/{MODEL}", "api_base": f"{gateway_url}/v1", "api_key": "x", "max_retries": 0,
            "messages": Q, **GREEDY}


def test_openai_whole_and_streamed(litellm: ModuleType, gateway_url: str) -> None:
    whole = litellm.completion(**openai_kw(gateway_url))
    c = whole.choices[0]
    assert c.message.role == "assistant" and c.message.content.strip() and c.finish_reason == "length"
    assert whole.id.startswith("chatcmpl-") and whole.model == MODEL
    assert_usage(whole.usage, 12)
    assert whole.usage.completion_tokens == 12

    stream = litellm.completion(**openai_kw(gateway_url), stream=True, stream_options={"include_usage": True})
    text, reasons, usage = streamed(stream)
    assert text == c.message.content and reasons == ["length"]
    assert_usage(usage, 12)
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_openai_required_tool_call(litellm: ModuleType, gateway_url: str) -> None:
    kw = {**openai_kw(gateway_url), "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
          "tools": [WEATHER], "tool_choice": "required", "max_tokens": 96}
    r = litellm.completion(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    call = c.message.tool_calls[0]
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    assert_usage(r.usage, 96)


async def test_openai_acompletion(litellm: ModuleType, gateway_url: str) -> None:
    r = await litellm.acompletion(**openai_kw(gateway_url))
    assert r.choices[0].message.content.strip() and r.choices[0].finish_reason == "length"
    assert_usage(r.usage, 12)


# --- anthropic/ -----------------------------------------------------------------------------------------


def test_anthropic_whole_and_streamed(litellm: ModuleType, gateway_url: str) -> None:
    kw: dict[str, Any] = {"model": f"anthropic/{MODEL}", "api_base": gateway_url, "api_key": "x", "messages": Q,
                          **GREEDY}
    whole = litellm.completion(**kw)
    c = whole.choices[0]
    assert c.message.content.strip() and c.finish_reason == "length"  # Anthropic's max_tokens
    assert_usage(whole.usage, 12)
    text, reasons, _ = streamed(litellm.completion(**kw, stream=True))
    assert text == c.message.content and reasons == ["length"]
