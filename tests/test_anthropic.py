"""Anthropic's Messages API with the official `anthropic` client and LangChain's ChatAnthropic,
against the real engine and model: create, stream (the SDK's accumulator), a tool_use ->
tool_result round trip, stop sequences, count_tokens, the models list in Anthropic's shape, error
types in Anthropic's envelope, and the event stream's bytes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from tests.conftest import MODEL

WEATHER = {"name": "get_weather", "description": "The weather in a city now.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


# The SDK has no temperature argument any more; the API (and the gateway) still take it.
GREEDY = {"temperature": 0}


@pytest.fixture
def claude(gateway_url: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=gateway_url, api_key="unused", max_retries=0) as c:
        yield c


def test_create_returns_a_message_the_sdk_parses(claude: anthropic.Anthropic) -> None:
    m = claude.messages.create(model=MODEL, max_tokens=24, system="You are terse.",
                               messages=[{"role": "user", "content": "Say hello."}], extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.content and m.content[0].type == "text" and m.content[0].text.strip()
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.input_tokens > 5 and 0 < m.usage.output_tokens <= 24
    # The same prompt again: the engine's prefix cache shows as cache_read_input_tokens, and
    # Anthropic counts those apart from input_tokens.
    again = claude.messages.create(model=MODEL, max_tokens=4, system="You are terse.",
                                   messages=[{"role": "user", "content": "Say hello."}], extra_body=GREEDY)
    total = m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    assert again.usage.input_tokens + (again.usage.cache_read_input_tokens or 0) == total
    assert (again.usage.cache_read_input_tokens or 0) > 0


def test_max_tokens_and_stop_sequences_give_their_stop_reasons(claude: anthropic.Anthropic) -> None:
    # Greedy: sampled at the default temperature the model may end its answer within 3 tokens.
    m = claude.messages.create(model=MODEL, max_tokens=3, extra_body=GREEDY,  # type: ignore[arg-type]
                               messages=[{"role": "user", "content": "Count to ten."}])
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
    count = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    # Twice: the second answer, like the one with the stop below, starts from the prompt's cached KV (a
    # prompt prefilled whole and one from the cache may tip a near-tie another way at temperature 0).
    claude.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, messages=count)  # type: ignore[arg-type]
    first = claude.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, messages=count)  # type: ignore[arg-type]
    text = first.content[0].text
    assert len(text) > 8, text
    # Stop at a piece of the text the model writes at temperature 0: the stop reason names it.
    stop = text[len(text) // 2:len(text) // 2 + 2]
    m = claude.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, stop_sequences=[stop, "@@never@@"],
                               messages=count)  # type: ignore[arg-type]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop, m
    assert "".join(b.text for b in m.content if b.type == "text") == text[:text.index(stop)]


def test_stream_accumulates_to_the_final_message(claude: anthropic.Anthropic) -> None:
    deltas: list[str] = []
    kinds: list[str] = []
    with claude.messages.stream(model=MODEL, max_tokens=24, extra_body=GREEDY,
                                messages=[{"role": "user", "content": "Name a colour."}]) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                deltas.append(event.delta.text)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.content[0].text == "".join(deltas) and deltas
    assert final.usage.output_tokens > 0 and final.stop_reason in ("end_turn", "max_tokens")


def test_a_tool_use_and_its_result_round_trip(claude: anthropic.Anthropic) -> None:
    first = claude.messages.create(model=MODEL, max_tokens=96, extra_body=GREEDY, tools=[WEATHER],
                                   tool_choice={"type": "any"},
                                   messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and isinstance(uses[0].input, dict) and "city" in uses[0].input
    second = claude.messages.create(model=MODEL, max_tokens=48, extra_body=GREEDY, tools=[WEATHER], messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny, 21 C"}]},
    ])
    assert second.content and second.usage.input_tokens + (second.usage.cache_read_input_tokens or 0) > \
        first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)


def test_streamed_tool_input_concatenates_to_the_input(claude: anthropic.Anthropic) -> None:
    parts: list[str] = []
    with claude.messages.stream(model=MODEL, max_tokens=96, extra_body=GREEDY, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[{"role": "user", "content": "Weather in Rome?"}]) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                parts.append(event.delta.partial_json)
        final = stream.get_final_message()
    use = next(b for b in final.content if b.type == "tool_use")
    assert json.loads("".join(parts)) == use.input and final.stop_reason == "tool_use"


def test_output_config_format_is_enforced(claude: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"colour": {"type": "string"}, "count": {"type": "integer"}},
              "required": ["colour", "count"], "additionalProperties": False}
    m = claude.messages.create(model=MODEL, max_tokens=128, extra_body=GREEDY,
                               output_config={"format": {"type": "json_schema", "schema": schema}},
                               messages=[{"role": "user", "content": "Name a colour and a number."}])
    value = json.loads(m.content[0].text)
    assert set(value) == {"colour", "count"} and isinstance(value["count"], int)


def test_count_tokens_matches_what_a_request_uses(claude: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": "How many tokens is this?"}]
    counted = claude.messages.count_tokens(model=MODEL, messages=messages, system="Be brief.")
    used = claude.messages.create(model=MODEL, max_tokens=2, messages=messages, system="Be brief.")
    assert counted.input_tokens == used.usage.input_tokens + (used.usage.cache_read_input_tokens or 0) > 5


def test_stream_reports_the_prompt_tokens_up_front(claude: anthropic.Anthropic) -> None:
    """As Anthropic does, `message_start` carries the prompt's tokens (context meters and cost
    trackers read them there), split into input and cache reads as the final usage is."""
    messages: Any = [{"role": "user", "content": "Name two rivers of Europe, please."}]
    counted = claude.messages.count_tokens(model=MODEL, messages=messages, system="Be brief.").input_tokens
    for _ in range(2):  # the second finds its prompt in the prefix cache
        with claude.messages.stream(model=MODEL, max_tokens=6, system="Be brief.", messages=messages,
                                    extra_body=GREEDY) as stream:
            events = list(stream)
        start = events[0]
        assert start.type == "message_start"
        up_front = start.message.usage
        assert up_front.input_tokens > 0 and up_front.output_tokens == 0
        assert up_front.input_tokens + (up_front.cache_read_input_tokens or 0) == counted
        delta = next(e for e in events if e.type == "message_delta")
        assert delta.usage.input_tokens == up_front.input_tokens
        assert delta.usage.cache_read_input_tokens == up_front.cache_read_input_tokens
    assert (up_front.cache_read_input_tokens or 0) > 0


def test_models_list_in_anthropic_shape(claude: anthropic.Anthropic) -> None:
    models = claude.models.list()
    assert MODEL in [m.id for m in models.data] and all(m.type == "model" for m in models.data)
    assert claude.models.retrieve(MODEL).id == MODEL


@pytest.mark.parametrize(("body", "status", "kind", "where"), [
    ({"max_tokens": 8}, 400, "invalid_request_error", "messages"),
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 8, "messages": [{"role": "robot", "content": "hi"}]}, 400, "invalid_request_error", "role"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     400, "invalid_request_error", "not PNG, JPEG, WebP or GIF"),
    ({"max_tokens": 8, "temperature": 1.5, "messages": [{"role": "user", "content": "hi"}]},
     400, "invalid_request_error", "temperature"),
    ({"max_tokens": 8, "model": "nope", "messages": [{"role": "user", "content": "hi"}]},
     404, "not_found_error", "nope"),
])
def test_errors_in_anthropic_envelope(gateway_url: str, body: dict[str, Any], status: int, kind: str,
                                      where: str) -> None:
    r = httpx.post(f"{gateway_url}/v1/messages", timeout=60, json={"model": MODEL, **body})
    assert r.status_code == status, r.text
    j = r.json()
    assert j["type"] == "error" and j["error"]["type"] == kind and where in j["error"]["message"], j
    if "messages" in body and "max_tokens" in body:  # what the SDK can send: it raises the status's error
        fields = {"model": MODEL, **body}
        extra = {k: fields.pop(k) for k in ("temperature",) if k in fields}
        with anthropic.Anthropic(base_url=gateway_url, api_key="x", max_retries=0) as c, \
                pytest.raises(anthropic.APIStatusError) as caught:
            c.messages.create(**fields, extra_body=extra)
        assert caught.value.status_code == status


def test_fields_and_tools_it_cannot_honour_are_named(gateway_url: str) -> None:
    r = httpx.post(f"{gateway_url}/v1/messages", timeout=60, headers={"anthropic-version": "2023-06-01"}, json={
        "model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
        "metadata": {"user_id": "u"}, "thinking": {"type": "enabled", "budget_tokens": 1024},
        "context_management": {"edits": []}, "service_tier": "auto",
        "tools": [{"type": "bash_20250124", "name": "bash"}, WEATHER]})
    assert r.status_code == 200, r.text
    assert r.headers["x-skipped-tools"] == "bash"
    assert r.headers["x-ignored-fields"] == "context_management, service_tier, thinking"


def test_the_event_stream_bytes(gateway_url: str) -> None:
    """`event:` then `data:` per event, the type in the data equal to the event name, in
    Anthropic's order; no [DONE]."""
    with httpx.stream("POST", f"{gateway_url}/v1/messages", timeout=120, json={
            "model": MODEL, "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "Hi."}]}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_raw()).decode()
    names = []
    for block in (b for b in raw.replace("\r\n", "\n").split("\n\n") if b.strip() and not b.startswith(":")):
        lines = block.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        assert json.loads(lines[1][6:])["type"] == lines[0][7:]
        names.append(lines[0][7:])
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    body = names[2:-2]
    assert body[0] == "content_block_start" and body[-1] == "content_block_stop"
    assert set(body[1:-1]) == {"content_block_delta"}
    assert "[DONE]" not in raw


def test_langchain_chat_anthropic(gateway_url: str) -> None:
    from langchain_anthropic import ChatAnthropic

    llm = ChatAnthropic(model=MODEL, base_url=gateway_url, api_key="unused", max_tokens=16, temperature=0,
                        max_retries=0)
    out = llm.invoke("Say hi.")
    assert isinstance(out.content, str | list) and out.content
    assert out.usage_metadata is not None and out.usage_metadata["output_tokens"] > 0
