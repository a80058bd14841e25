"""Ollama's API with the official `ollama` client and LangChain's ChatOllama, against the real engine
and model: list, show, ps, version, chat (streamed and not, tools, format), generate (templated and
raw), embed, keep_alive, errors in Ollama's shape, and the NDJSON bytes."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import ollama
import pytest

from tests.conftest import MODEL

GREEDY = {"temperature": 0, "num_predict": 24}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture
def client(gateway_url: str) -> Iterator[ollama.Client]:
    c = ollama.Client(host=gateway_url)
    yield c
    c._client.close()


def test_list_show_ps_version(client: ollama.Client) -> None:
    names = [m.model for m in client.list().models]
    assert MODEL in names
    shown = client.show(MODEL)
    assert "completion" in (shown.capabilities or []) and shown.details.format == "gguf"
    assert "<|im_start|>" in (shown.template or "")  # the GGUF's own chat template (ChatML)
    client.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], options={"num_predict": 1})
    assert MODEL in [m.model for m in client.ps().models]
    assert httpx.get(f"{client._client.base_url}/api/version").json()["version"]


def test_chat_whole_and_streamed_agree_at_temperature_0(client: ollama.Client) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}]
    whole = client.chat(model=MODEL, messages=msgs, options=GREEDY, stream=False)
    assert whole.done and whole.message.role == "assistant" and whole.message.content
    assert whole.done_reason in ("stop", "length") and whole.eval_count and whole.eval_count <= 24
    assert whole.prompt_eval_count is not None and whole.total_duration and whole.total_duration > 0
    assert whole.eval_duration and whole.eval_duration > 0
    parts = list(client.chat(model=MODEL, messages=msgs, options=GREEDY, stream=True))
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count


def test_num_predict_and_stop(client: ollama.Client) -> None:
    r = client.chat(model=MODEL, messages=[{"role": "user", "content": "Count to twenty."}],
                    options={"num_predict": 3})
    assert r.done_reason == "length" and r.eval_count == 3
    text = client.generate(model=MODEL, prompt="Count from 1 to 10, separated by commas.", options=GREEDY).response
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = client.generate(model=MODEL, prompt="Count from 1 to 10, separated by commas.",
                          options={**GREEDY, "stop": [stop]}).response
    assert cut == text[:text.index(stop)]


def test_chat_tools_round_trip(client: ollama.Client) -> None:
    msgs: list[Any] = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    first = client.chat(model=MODEL, messages=msgs, tools=[WEATHER], options={"temperature": 0, "num_predict": 96})
    calls = first.message.tool_calls or []
    if not calls:  # tool_choice is auto in Ollama's API: the model may answer instead
        assert first.message.content
        return
    assert calls[0].function.name == "get_weather" and isinstance(calls[0].function.arguments, dict)
    msgs += [first.message, {"role": "tool", "tool_name": "get_weather", "content": "Sunny, 21 C"}]
    second = client.chat(model=MODEL, messages=msgs, tools=[WEATHER], options={"temperature": 0, "num_predict": 48})
    assert second.done and second.prompt_eval_count is not None


def test_format_json_schema_is_enforced(client: ollama.Client) -> None:
    schema = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"],
              "additionalProperties": False}
    r = client.chat(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], format=schema,
                    options={"temperature": 0, "num_predict": 64})
    assert set(json.loads(r.message.content)) == {"colour"}
    r = client.generate(model=MODEL, prompt="Reply with a JSON object whose one key, colour, names a colour.",
                        format="json", options={"temperature": 0, "num_predict": 256})
    assert r.done_reason == "stop", r.response
    assert isinstance(json.loads(r.response), dict)


def test_generate_templated_and_raw(client: ollama.Client) -> None:
    r = client.generate(model=MODEL, prompt="Say hello.", system="Be brief.", options=GREEDY)
    assert r.done and r.response
    raw = client.generate(model=MODEL, prompt="The capital of France is", raw=True, options=GREEDY)
    assert raw.response and raw.prompt_eval_count and raw.prompt_eval_count < 12  # no chat template around it


def test_embed_and_the_older_embeddings(client: ollama.Client) -> None:
    r = client.embed(model=MODEL, input=["a cat", "a dog"])
    assert len(r.embeddings) == 2 and abs(sum(x * x for x in r.embeddings[0]) - 1) < 1e-3
    old = client.embeddings(model=MODEL, prompt="a cat")
    assert len(old.embedding) == len(r.embeddings[0])


def test_keep_alive_unloads(client: ollama.Client, gateway_url: str) -> None:
    other = "gemma-3-270m"
    r = client.generate(model=other, prompt="", keep_alive="1s")
    assert r.done and r.done_reason == "load"
    assert other in [m.model for m in client.ps().models]
    deadline = time.monotonic() + 30
    while other in [m.model for m in client.ps().models] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert other not in [m.model for m in client.ps().models]
    client.generate(model=other, prompt="", keep_alive=-1)
    assert other in [m.model for m in client.ps().models]
    r = client.generate(model=other, prompt="", keep_alive=0)
    assert r.done_reason == "unload" and other not in [m.model for m in client.ps().models]


@pytest.mark.parametrize(("path", "body", "status"), [
    ("/api/chat", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, 400),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "options": {"temperature": 9}}, 400),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi", "images": ["AA=="]}]}, 400),
    ("/api/generate", {"model": MODEL, "prompt": "x", "keep_alive": "5 parsecs"}, 400),
    ("/api/show", {"model": "nope"}, 404),
    ("/api/embed", {"model": MODEL}, 400),
])
def test_errors_in_ollama_shape(gateway_url: str, path: str, body: dict[str, Any], status: int) -> None:
    r = httpx.post(f"{gateway_url}{path}", json={"stream": False, **body}, timeout=60)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"} and isinstance(r.json()["error"], str) and r.json()["error"]


def test_the_client_raises_the_status(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 404 and "nope" in caught.value.error


def test_the_ndjson_bytes(gateway_url: str) -> None:
    with httpx.stream("POST", f"{gateway_url}/api/chat", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi."}], "options": {"num_predict": 5}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        raw = b"".join(r.iter_raw()).decode()
    lines = raw.split("\n")
    assert lines[-1] == "" and all(lines[:-1])
    objs = [json.loads(x) for x in lines[:-1]]
    assert [o["done"] for o in objs] == [False] * (len(objs) - 1) + [True]
    last = objs[-1]
    for key in ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count",
                "eval_duration", "done_reason", "created_at"):
        assert key in last, last
    assert last["created_at"].endswith("Z") and len(last["created_at"].split(".")[1]) == 10


def test_langchain_chat_ollama(gateway_url: str) -> None:
    from langchain_ollama import ChatOllama

    llm = ChatOllama(model=MODEL, base_url=gateway_url, temperature=0, num_predict=16)
    try:
        out = llm.invoke("Say hi.")
    finally:
        llm._client._client.close()  # its HTTP client is never closed otherwise (a leaked socket)
    assert isinstance(out.content, str) and out.content
    assert out.usage_metadata is not None and out.usage_metadata["output_tokens"] > 0
