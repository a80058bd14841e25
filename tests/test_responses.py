"""The OpenAI Responses API with the official `openai` client, against the real engine and model:
create, stream, parse, function calls and their outputs, stored responses across a restart, the
fields agents send that are accepted and named, and the byte-level event stream."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from pydantic import BaseModel, Field

from tests.conftest import MODEL, ROOT
from tests.test_production import Gateway, _is_envelope

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city now.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}, "strict": True}


def test_create_returns_a_response_the_sdk_parses(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="Say hello in one short sentence.", max_output_tokens=24,
                                temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status in ("completed", "incomplete") and r.output_text.strip()
    msg = r.output[0]
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    assert r.usage is not None and r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 24
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.temperature == 0 and r.max_output_tokens == 24


def test_max_output_tokens_gives_incomplete_with_the_reason(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="Write a long story about the sea.", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 5


def test_instructions_and_message_items_with_parts(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, instructions="You answer in French.", max_output_tokens=16, input=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hello!"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Bonjour !"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "user", "content": "How are you?"},
    ])
    assert r.status in ("completed", "incomplete") and r.output_text and r.instructions == "You answer in French."


def test_stream_accumulates_to_the_final_text(client: openai.OpenAI) -> None:
    deltas: list[str] = []
    kinds: list[str] = []
    with client.responses.stream(model=MODEL, input="Say hello in three words.", max_output_tokens=200,
                                 temperature=0) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert final.output_text == "".join(deltas) and deltas
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    order = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
             "response.output_text.done", "response.content_part.done", "response.output_item.done"]
    squeezed = [k for n, k in enumerate(kinds) if k in order and (n == 0 or kinds[n - 1] != k)]
    assert squeezed == order, kinds


class City(BaseModel):
    # Lengths bound the strings, as a schema for a small model should: the grammar then closes
    # each string in time (greedy text from a 135M model may otherwise run on inside one).
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    r = client.responses.parse(model=MODEL, input="Name a big city in France and its country.", text_format=City,
                               max_output_tokens=64, temperature=0)
    assert isinstance(r.output_parsed, City) and r.output_parsed.name


def test_a_function_call_and_its_output_round_trip(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice="required", temperature=0, max_output_tokens=96)
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert "city" in json.loads(calls[0].arguments)
    # The answer to the call, continuing from the stored response.
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER], max_output_tokens=48,
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "Sunny, 21 C"}])
    assert second.status in ("completed", "incomplete") and second.previous_response_id == first.id
    # The same conversation sent whole, as stateless clients (store: false) do.
    third = client.responses.create(model=MODEL, store=False, tools=[WEATHER], max_output_tokens=48, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"},
    ])
    assert third.output and third.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(third.id)


def test_streamed_function_call_arguments_concatenate(client: openai.OpenAI) -> None:
    args: list[str] = []
    with client.responses.stream(model=MODEL, input="Weather in Rome?", tools=[WEATHER], tool_choice="required",
                                 temperature=0, max_output_tokens=96) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                args.append(event.delta)
        final = stream.get_final_response()
    call = next(o for o in final.output if o.type == "function_call")
    assert "".join(args) == call.arguments and json.loads(call.arguments)


def test_custom_tools_and_hosted_tools_are_accepted(gateway_url: str) -> None:
    r = httpx.post(f"{gateway_url}/v1/responses", timeout=120, json={
        "model": MODEL, "input": "Use the patch tool to add a line.", "max_output_tokens": 200, "temperature": 0,
        "tool_choice": "required",
        "tools": [{"type": "custom", "name": "apply_patch", "description": "Apply a patch",
                   "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
                  {"type": "web_search"}, {"type": "namespace", "name": "mcp", "tools": []}],
        "reasoning": {"effort": "low"}, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "k",
        "text": {"verbosity": "low"}, "store": False, "service_tier": "auto", "truncation": "auto"})
    assert r.status_code == 200, r.text
    assert r.headers["x-skipped-tools"] == "namespace, web_search"
    ignored = r.headers["x-ignored-fields"]
    for name in ("reasoning", "include", "text.verbosity", "service_tier", "truncation", "lark grammar"):
        assert name in ignored, ignored
    items = r.json()["output"]
    call = next(o for o in items if o["type"] == "custom_tool_call")
    assert call["name"] == "apply_patch" and isinstance(call["input"], str)


@pytest.mark.parametrize(("body", "param"), [
    ({"temperature": 3}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tools": [{"name": "x"}]}, "tools[0].type"),
    ({"input": [{"type": "message", "role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"frobnicate": 1}, None),
])
def test_bad_input_is_a_400_in_the_openai_envelope(gateway_url: str, body: dict[str, Any], param: str | None) -> None:
    r = httpx.post(f"{gateway_url}/v1/responses", timeout=30, json={"model": MODEL, "input": "hi", **body})
    assert r.status_code == 400, r.text
    assert _is_envelope(r.json()), r.text
    if param is not None:
        assert r.json()["error"]["param"] == param, r.text


def test_unknown_model_and_unknown_response_are_404(gateway_url: str) -> None:
    r = httpx.post(f"{gateway_url}/v1/responses", timeout=30, json={"model": "nope", "input": "hi"})
    assert r.status_code == 404 and _is_envelope(r.json(), "model_not_found")
    for method in ("GET", "DELETE"):
        r = httpx.request(method, f"{gateway_url}/v1/responses/resp_missing", timeout=30)
        assert r.status_code == 404 and _is_envelope(r.json(), "response_not_found")


def test_the_event_stream_bytes(gateway_url: str) -> None:
    """`event:` and `data:` lines as OpenAI sends them, sequence numbers from 0 without gaps, the type
    in the data equal to the event name, no [DONE], the terminal event last."""
    with httpx.stream("POST", f"{gateway_url}/v1/responses", timeout=120, json={
            "model": MODEL, "input": "Say hi.", "max_output_tokens": 8, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_raw()).decode()
    blocks = [b for b in raw.replace("\r\n", "\n").split("\n\n") if b.strip() and not b.startswith(":")]
    seqs, names = [], []
    for block in blocks:
        lines = block.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: ") and len(lines) == 2, block
        name, data = lines[0][7:], json.loads(lines[1][6:])
        assert data["type"] == name
        seqs.append(data["sequence_number"])
        names.append(name)
    assert seqs == list(range(len(seqs)))
    assert names[0] == "response.created" and names[-1] in ("response.completed", "response.incomplete")
    assert "[DONE]" not in raw


@pytest.fixture
def stored_gateway(tmp_path: Path) -> Iterator[Gateway]:
    cfg = yaml.safe_load((ROOT / "models.yaml").read_text())
    cfg["cache_dir"] = str(tmp_path / "cache")
    (tmp_path / "models.yaml").write_text(yaml.safe_dump(cfg))
    g = Gateway(tmp_path, "--config", str(tmp_path / "models.yaml"))
    yield g
    g.stop()


def test_stored_responses_survive_a_restart(stored_gateway: Gateway, tmp_path: Path) -> None:
    c = openai.OpenAI(base_url=f"{stored_gateway.url}/v1", api_key="x", max_retries=0)
    first = c.responses.create(model=MODEL, input="My name is Ada. Say OK.", max_output_tokens=8)
    stored_gateway.signal()  # SIGTERM: drain and exit
    stored_gateway.proc.wait(timeout=60)
    stored_gateway.stop()
    g = Gateway(tmp_path, "--config", str(tmp_path / "models.yaml"))
    try:
        c = openai.OpenAI(base_url=f"{g.url}/v1", api_key="x", max_retries=0)
        again = c.responses.retrieve(first.id)
        assert again.id == first.id and again.output_text == first.output_text
        items = c.responses.input_items.list(first.id)
        assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text.startswith("My name")
        second = c.responses.create(model=MODEL, previous_response_id=first.id, input="What is my name?",
                                    max_output_tokens=16)
        assert second.previous_response_id == first.id and second.usage.input_tokens > first.usage.input_tokens
        c.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(first.id)
        # The second still continues: each stored response holds its whole conversation.
        third = c.responses.create(model=MODEL, previous_response_id=second.id, input="Thanks.", max_output_tokens=8)
        assert third.status in ("completed", "incomplete")
    finally:
        g.stop()


def test_what_codex_cli_sends_is_accepted(gateway_url: str) -> None:
    """Found running `codex exec` 0.169 against the gateway: client_metadata on every turn, a
    "namespace" tool, and outputs of its own tools with a name and no call_id."""
    r = httpx.post(f"{gateway_url}/v1/responses", timeout=120, json={
        "model": MODEL, "max_output_tokens": 4, "client_metadata": {"x": "y"}, "store": False,
        "tools": [{"type": "namespace", "name": "agent", "tools": []}],
        "input": [{"role": "user", "content": "Set a goal."},
                  {"type": "function_call_output", "name": "goal_objective", "namespace": "agent", "output": "key"}]})
    assert r.status_code == 200, r.text
    assert "client_metadata" in r.headers["x-ignored-fields"] and r.headers["x-skipped-tools"] == "namespace"
