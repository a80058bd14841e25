"""The OpenAI API through the official client, on the real engine and model."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import MODEL

Q = [{"role": "user", "content": "Name three colours."}]


def chat(client: openai.OpenAI, **kw: object):  # type: ignore[no-untyped-def]
    args = {"model": MODEL, "messages": Q, "max_tokens": 12, "temperature": 0}
    args.update(kw)
    if "max_completion_tokens" in kw:
        del args["max_tokens"]
    return client.chat.completions.create(**args)  # type: ignore[call-overload]


def test_non_stream_chat(client: openai.OpenAI) -> None:
    r = chat(client)
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    assert r.model == MODEL
    c = r.choices[0]
    assert c.message.role == "assistant"
    assert isinstance(c.message.content, str) and c.message.content.strip()
    assert c.finish_reason in ("stop", "length")
    assert r.usage is not None
    assert r.usage.prompt_tokens > 5
    assert 0 < r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_stream_equals_non_stream_at_temperature_zero(client: openai.OpenAI) -> None:
    whole = chat(client, max_tokens=20).choices[0].message.content
    chunks = list(chat(client, max_tokens=20, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole


def test_stream_chunk_format(gateway_url: str) -> None:
    body = {"model": MODEL, "messages": Q, "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{gateway_url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        # The engine that serves (llama.cpp on the CPU in CI; Vulkan or CUDA on a GPU host), as /health says.
        serving = httpx.get(f"{gateway_url}/health").json()["models"][MODEL]["engine"]
        assert r.headers["x-engine"] == serving and serving.startswith("llamacpp/")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    # OpenAI's first chunk names the role alone (strict stream parsers expect it); the text follows.
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "logprobs" not in chunks[0]["choices"][0] or chunks[0]["choices"][0]["logprobs"] is None
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert finishes == ["length"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks)


def test_include_usage(client: openai.OpenAI) -> None:
    chunks = list(chat(client, max_tokens=7, stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens == 7
    assert all(c.usage is None for c in chunks[:-1])
    content_chunks = [c for c in chunks[:-1] if c.choices and c.choices[0].delta.content]
    assert 1 <= len(content_chunks) <= 7


def test_continuous_usage_stats_count_every_token(client: openai.OpenAI) -> None:
    """vLLM's stream_options.continuous_usage_stats: each chunk says how many tokens were generated
    up to it (a chunk can carry several tokens' text), so a client can time tokens, not chunks."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(chat(client, max_tokens=9, stream=True, stream_options=opts))
    final = chunks[-1].usage
    assert chunks[-1].choices == [] and final is not None and final.completion_tokens == 9
    body = [c for c in chunks[:-1] if c.choices]
    assert all(c.usage is not None for c in body)
    counts = [c.usage.completion_tokens for c in body if c.usage and c.choices[0].delta.content]
    assert counts == sorted(set(counts)) and 1 <= counts[0] and counts[-1] <= 9
    assert all(c.usage and c.usage.prompt_tokens == final.prompt_tokens for c in body)
    assert body[-1].usage is not None and body[-1].usage.completion_tokens == 9  # the finish chunk
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert text == chat(client, max_tokens=9).choices[0].message.content
    # Without include_usage it asks for nothing (as vLLM), and completions take it too.
    plain = list(chat(client, max_tokens=3, stream=True, stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in plain)
    done = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0,
                                          stream=True, stream_options=opts))  # type: ignore[arg-type]
    seen = [c.usage.completion_tokens for c in done[:-1] if c.usage]
    assert len(seen) == len(done) - 1 and seen[-1] == 5 and seen == sorted(seen)


def test_seed_determinism(client: openai.OpenAI) -> None:
    a = chat(client, temperature=1.0, seed=1234, max_tokens=24).choices[0].message.content
    b = chat(client, temperature=1.0, seed=1234, max_tokens=24).choices[0].message.content
    assert a == b
    others = {chat(client, temperature=1.0, seed=s, max_tokens=24).choices[0].message.content for s in (1, 2, 3)}
    assert len(others | {a}) > 1, "different seeds should sample different text"


def test_max_tokens_and_finish_reason(client: openai.OpenAI) -> None:
    r = chat(client, max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 3
    r2 = chat(client, max_completion_tokens=2)
    assert r2.usage is not None and r2.usage.completion_tokens == 2


def test_stop_string(client: openai.OpenAI) -> None:
    full = chat(client, max_tokens=24).choices[0].message.content or ""
    words = [w for w in full.split() if len(w) > 3]
    assert words, full
    stop = words[len(words) // 2]
    r = chat(client, max_tokens=24, stop=[stop, "zzzz-unused"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[: full.index(stop)]


def test_logprobs(client: openai.OpenAI) -> None:
    r = chat(client, max_tokens=5, logprobs=True, top_logprobs=3)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content is not None
    assert len(lp.content) == 5
    text = ""
    for t in lp.content:
        assert t.logprob <= 0
        assert len(t.top_logprobs) == 3
        values = [x.logprob for x in t.top_logprobs]
        assert values == sorted(values, reverse=True)
        # Greedy decoding picks the most likely token.
        assert t.top_logprobs[0].token == t.token
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-6
        assert bytes(t.bytes or []).decode("utf-8", "replace") == t.token
        text += t.token
    assert text == r.choices[0].message.content


def test_json_schema_output_validates(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    r = chat(
        client,
        messages=[{"role": "user", "content": "Give a person's name and age as JSON."}],
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )
    assert r.choices[0].finish_reason == "stop"
    data = json.loads(r.choices[0].message.content or "")
    jsonschema.validate(data, schema)


def test_json_object_mode(client: openai.OpenAI) -> None:
    r = chat(client, max_tokens=80, response_format={"type": "json_object"},
             messages=[{"role": "user", "content": "Reply with a JSON object describing a cat."}])
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    else:  # cut by max_tokens: still a valid JSON prefix starting an object
        assert (r.choices[0].message.content or "").lstrip().startswith("{")


def test_multi_turn_with_system_message(client: openai.OpenAI) -> None:
    messages = [
        {"role": "system", "content": "You are a terse assistant. Answer in one word. " * 6},
        {"role": "user", "content": "What colour is the sky?"},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And grass?"},
    ]
    r = chat(client, messages=messages, max_tokens=8)
    single = chat(client, messages=[messages[-1]], max_tokens=8)
    assert r.choices[0].message.content
    assert r.usage is not None and single.usage is not None
    # The long system message and the earlier turns reach the model (SmolLM2's default system
    # prompt, used when none is given, is shorter than ours).
    assert r.usage.prompt_tokens > single.usage.prompt_tokens + 40


def test_n_choices(client: openai.OpenAI) -> None:
    r = chat(client, n=2, temperature=1.0, seed=7, max_tokens=6)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.content for c in r.choices)
    assert r.usage is not None and r.usage.completion_tokens == sum(
        6 if c.finish_reason == "length" else 0 for c in r.choices
    ) or all(c.finish_reason for c in r.choices)


def test_n_choices_stream(client: openai.OpenAI) -> None:
    chunks = list(chat(client, n=2, max_tokens=4, stream=True))
    finishes = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finishes == {0: "length", 1: "length"}


def test_user_field_accepted(client: openai.OpenAI) -> None:
    assert chat(client, user="someone", max_tokens=2).choices[0].message.content is not None


def test_legacy_completion(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text
    assert r.usage is not None and r.usage.completion_tokens <= 8
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_legacy_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    assert lp.top_logprobs is not None and all(len(d) <= 2 for d in lp.top_logprobs)


def test_models_endpoint(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list().data]
    assert MODEL in ids and "gemma-3-270m" in ids


@pytest.mark.parametrize("path", ["/health"])
def test_health_ready(gateway_url: str, path: str) -> None:
    r = httpx.get(gateway_url + path)
    assert r.status_code == 200
    assert r.json()["models"][MODEL]["ready"] is True


def test_stream_starts_role_only_and_adds_up_to_the_answer(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=12, temperature=0, logprobs=True)
    chunks = list(client.chat.completions.create(model=MODEL, messages=Q, max_tokens=12, temperature=0,
                                                 logprobs=True, stream=True))
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.content == "" and first.logprobs is None
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    # Each token's logprobs ride on the chunk of its text, none on the role chunk.
    streamed = [t.token for c in chunks[1:] if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content or []]
    assert whole.choices[0].logprobs is not None and whole.choices[0].logprobs.content is not None
    assert streamed == [t.token for t in whole.choices[0].logprobs.content]


@pytest.mark.parametrize("path", ["/chat/completions", "/completions", "/models", "/embeddings"])
def test_paths_without_v1_are_the_v1_routes(gateway_url: str, path: str) -> None:
    """Clients configured with a base URL without /v1 (as llama-server allows) reach the same routes."""
    bodies = {"/chat/completions": {"model": MODEL, "messages": Q, "max_tokens": 6, "temperature": 0},
              "/completions": {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0},
              "/embeddings": {"model": MODEL, "input": "hello"}}

    def call(p: str) -> httpx.Response:
        if path == "/models":
            return httpx.get(f"{gateway_url}{p}", timeout=60)
        return httpx.post(f"{gateway_url}{p}", json=bodies[path], timeout=60)

    plain, versioned = call(path), call(f"/v1{path}")
    assert plain.status_code == versioned.status_code == 200, plain.text
    a, b = plain.json(), versioned.json()
    assert {k: v for k, v in a.items() if k not in ("id", "created", "usage")} == {k: v for k, v in b.items() if k not in ("id", "created", "usage")}
    # Errors keep the OpenAI envelope on the unversioned paths too.
    if path != "/models":
        bad = httpx.post(f"{gateway_url}{path}", json={**bodies[path], "model": "no-such-model"}, timeout=60)
        assert bad.status_code == 404 and bad.json()["error"]["type"]
