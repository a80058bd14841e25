"""Tool calling: the pure parser fed at every split, and the API on the real model through the
official client and LangChain. Validity is asserted (arguments parse and follow the tool's schema),
not which tool a 135M model picks under `auto`."""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from gateway.chat.formats.base import ArgumentsDelta, CallStarted, ContentDelta
from gateway.chat.formats.jsonscan import StreamParser
from tests.conftest import MODEL

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}  # no parameters
TOOLS: list[Any] = [WEATHER, TIME]
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": {"type": "object", "properties": {}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

CANONICAL = [
    '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Par\\"is \\u00e9", "n": [1, 2.5e3, true, null],'
    ' "x": {"y": "}]"}}}, {"name": "get_time", "arguments": {}}]}',
    '{"tool_call": {"name": "f", "arguments": {"a": -1}}}',
    '{"response": "Hello \\u00e9\\n\\t\\"quoted\\" \\ud83d\\ude00 \\\\ end"}',
    '{"response": {"k": [1, "a}"], "z": false}}',
]


def replay(text: str, cuts: list[int]) -> tuple[list[tuple[str, str]], str, StreamParser]:
    """Feed `text` in pieces cut at `cuts`; rebuild calls and content from the events alone."""
    p = StreamParser()
    calls: list[list[str]] = []
    content = ""
    bounds = [0, *sorted(cuts), len(text)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        for ev in p.feed(text[a:b]):
            if isinstance(ev, CallStarted):
                assert ev.index == len(calls)
                calls.append([ev.name, ""])
            elif isinstance(ev, ArgumentsDelta):
                assert calls and ev.index == len(calls) - 1 and calls[-1][0], "arguments before the call's name"
                calls[-1][1] += ev.text
            elif isinstance(ev, ContentDelta):
                content += ev.text
    return [(n, a) for n, a in calls], content, p


@pytest.mark.parametrize("text", CANONICAL)
def test_parser_gives_the_same_answer_at_every_split(text: str) -> None:
    whole_calls, whole_content, whole = replay(text, [])
    assert whole.done
    obj = json.loads(text)
    if "response" in obj:
        r = obj["response"]
        assert whole_content == (r if isinstance(r, str) else text[text.index(":") + 2 : -1])
        assert whole_calls == []
    else:
        items = obj.get("tool_calls") or [obj["tool_call"]]
        assert [n for n, _ in whole_calls] == [c["name"] for c in items]
        # Arguments text is the model's own JSON text, and parses to the arguments.
        assert [json.loads(a) for _, a in whole_calls] == [c["arguments"] for c in items]
    for cut in range(1, len(text)):
        assert replay(text, [cut])[:2] == (whole_calls, whole_content), cut
    rng = random.Random(0)
    for _ in range(200):
        cuts = rng.sample(range(1, len(text)), k=rng.randint(2, 12))
        assert replay(text, cuts)[:2] == (whole_calls, whole_content), cuts
    # Character by character, as a stream of one-character tokens would be.
    assert replay(text, list(range(1, len(text))))[:2] == (whole_calls, whole_content)


def test_parser_reports_an_unfinished_answer() -> None:
    _, _, p = replay(CANONICAL[0][:50], [])
    assert not p.done


def _valid(calls: list[Any]) -> None:
    assert calls, "no tool call"
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])


def create(client: openai.OpenAI, **kw: Any) -> Any:
    args: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 160, "temperature": 0}
    args.update(kw)
    return client.chat.completions.create(**args)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_returns_valid_calls(client: openai.OpenAI, parallel: bool) -> None:
    r = create(client, tool_choice="required", parallel_tool_calls=parallel)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    _valid(c.message.tool_calls)
    assert parallel or len(c.message.tool_calls) == 1


def test_named_tool_choice_is_honoured(client: openai.OpenAI) -> None:
    for name in ("get_time", "get_weather"):
        r = create(client, tool_choice={"type": "function", "function": {"name": name}})
        calls = r.choices[0].message.tool_calls
        _valid(calls)
        assert {c.function.name for c in calls} == {name}
    r = create(client, tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False)
    assert r.choices[0].message.tool_calls[0].function.arguments == "{}"  # a tool without parameters


def test_auto_answers_validly_either_way(client: openai.OpenAI) -> None:
    for messages in (ASK, [{"role": "user", "content": "Say hello to me."}]):
        c = create(client, messages=messages, tool_choice="auto").choices[0]
        if c.finish_reason == "tool_calls":
            _valid(c.message.tool_calls)
        else:
            assert c.finish_reason == "stop" and isinstance(c.message.content, str) and not c.message.tool_calls


def test_stream_accumulates_to_the_same_calls(client: openai.OpenAI, gateway_url: str) -> None:
    whole = create(client, tool_choice="required").choices[0].message.tool_calls
    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
                                        max_tokens=160, temperature=0) as stream:
        final = stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in whole]
    # The raw chunks: index on every fragment, id/type/name once per call, then arguments only.
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 160,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{gateway_url}/v1/chat/completions", json=body, timeout=120) as r:
        frames = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    seen: dict[int, str] = {}
    for ch in chunks[:-2]:
        for tc in ch["choices"][0]["delta"].get("tool_calls", []):
            assert "index" in tc
            if tc["index"] not in seen:
                assert tc["id"].startswith("call_") and tc["type"] == "function" and tc["function"]["name"]
                seen[tc["index"]] = tc["function"].get("arguments", "")
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                seen[tc["index"]] += tc["function"]["arguments"]
    assert [seen[i] for i in sorted(seen)] == [c.function.arguments for c in whole]


def test_a_two_turn_exchange_sends_the_result_back(client: openai.OpenAI) -> None:
    first = create(client, tool_choice="required", parallel_tool_calls=False).choices[0].message
    call = first.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 18, "sky": "clear"})}]
    second = create(client, messages=history, tool_choice="auto").choices[0]
    if second.finish_reason == "tool_calls":
        _valid(second.message.tool_calls)
    else:
        assert second.message.content
    # Without tools, the same history still renders (calls and results as text).
    plain = client.chat.completions.create(model=MODEL, messages=history, max_tokens=16, temperature=0)  # type: ignore[arg-type]
    assert plain.choices[0].message.content


def test_max_tokens_cut_comes_back_as_content_with_length(client: openai.OpenAI) -> None:
    c = create(client, tool_choice="required", max_tokens=6).choices[0]
    assert c.finish_reason == "length" and c.message.content and not c.message.tool_calls


def test_response_format_goes_in_the_response_branch(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"greeting": {"type": "string"}}, "required": ["greeting"]}
    c = create(client, messages=[{"role": "user", "content": "Greet me."}], tool_choice="auto",
               response_format={"type": "json_schema", "json_schema": {"name": "g", "schema": schema}}).choices[0]
    if c.finish_reason == "tool_calls":
        _valid(c.message.tool_calls)
    else:
        jsonschema.validate(json.loads(c.message.content), schema)


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": []}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
    ({"messages": [*ASK, {"role": "assistant", "content": None}]}, "messages[1].content"),
])
def test_bad_tool_requests_are_400_with_param(gateway_url: str, body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{gateway_url}/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


class Weather(BaseModel):
    city: str
    unit: str


def test_langchain_bind_tools_stream_and_structured_output(gateway_url: str) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str, unit: str = "c") -> str:
        """Current weather in a city."""
        return f"18 {unit} in {city}"

    with httpx.Client(timeout=120) as http:
        llm = ChatOpenAI(model=MODEL, base_url=f"{gateway_url}/v1", api_key="unused",  # type: ignore[arg-type]
                         temperature=0, max_tokens=160, http_client=http)
        bound = llm.bind_tools([get_weather], tool_choice="required")
        msg = bound.invoke("What is the weather in Paris?")
        assert msg.tool_calls and all(tc["name"] == "get_weather" and isinstance(tc["args"]["city"], str)
                                      for tc in msg.tool_calls)
        total: Any = None
        for chunk in bound.stream("What is the weather in Paris?"):
            total = chunk if total is None else total + chunk
        assert [(tc["name"], tc["args"]) for tc in total.tool_calls] == [(tc["name"], tc["args"]) for tc in msg.tool_calls]
        structured = llm.with_structured_output(Weather, method="function_calling")
        out = structured.invoke("Weather report for Paris in celsius.")
        assert isinstance(out, Weather) and out.city


ONE_TOOL = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _distinct(calls: list[tuple[str, str]]) -> bool:
    keys = [(n, json.dumps(json.loads(a), sort_keys=True)) for n, a in calls]
    return len(keys) == len(set(keys))


def test_a_repeated_call_does_not_eat_the_budget(client: openai.OpenAI, gateway_url: str) -> None:
    """A case seen with the default model: one tool, required, temperature 0, max_tokens 96 — the default model
    repeats the same call inside the parallel array until max_tokens. The answer ends at the first
    exact repeat, with the calls before it, whole or streamed, in both OpenAI protocols."""
    kw: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                          "tools": ONE_TOOL, "tool_choice": "required", "temperature": 0, "max_tokens": 96}
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
    assert _distinct([(t.function.name, t.function.arguments) for t in c.message.tool_calls])
    with client.chat.completions.stream(**kw) as stream:  # the SDK's helper parses every chunk
        for _ in stream:
            pass
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.tool_calls
    assert _distinct([(t.function.name, t.function.arguments) for t in final.message.tool_calls])
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?", tool_choice="required",
                                temperature=0, max_output_tokens=96, tools=[{"type": "function", **ONE_TOOL[0]["function"]}])
    calls = [(o.name, o.arguments) for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and calls and _distinct(calls)


def test_an_answer_cut_short_keeps_its_complete_calls(client: openai.OpenAI) -> None:
    """max_tokens that ends a parallel answer inside a later call: the calls completed before it are
    the answer (finish "tool_calls"), not raw text with "length"."""
    cut = []
    for m in range(16, 96, 8):
        r = create(client, tool_choice="required", parallel_tool_calls=True, max_tokens=m)
        c = r.choices[0]
        if r.usage.completion_tokens == m and c.message.tool_calls:  # truncated, yet calls came back
            assert c.finish_reason == "tool_calls" and c.message.content is None
            _valid(c.message.tool_calls)
            cut.append(m)
    assert cut, "no max_tokens between 16 and 88 cut the answer after a complete call"


def test_an_answer_cut_short_before_any_call_is_the_text_the_model_wrote(client: openai.OpenAI) -> None:
    """max_tokens that ends a tool answer inside its first call: no call, finish "length", and the
    content is what the model wrote from its first token (the whole partial call, not its tail)."""
    r = create(client, tool_choice="required", max_tokens=6)
    c = r.choices[0]
    assert c.finish_reason == "length" and not c.message.tool_calls, c
    assert r.usage.completion_tokens == 6
    text = c.message.content or ""
    # The answer's opening (the constrained envelope, or a native call's tag), not a fragment of it.
    assert text.lstrip().startswith(("{", "<tool_call>")), text
