"""Tool calling through a chat template with native tool support (the Hermes / Qwen2.5 format):
the template renders the tools, calls and results; the model writes <tool_call>{...}</tool_call>,
constrained by a grammar that is lazy under `auto`. Served here on SmolLM2's weights with a
template of that family (SmolLM2 speaks ChatML, like Qwen2.5)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
import yaml

from engines.base import EngineConfig
from engines.llamacpp.engine import LlamaCppEngine
from gateway.app import create_app
from gateway.chat import formats
from gateway.chat.template import ChatMessage, ToolCallRecord, template_of
from gateway.models.registry import load_registry
from gateway.settings import Settings
from tests.chat import chat_request
from tests.conftest import MODEL, NO_CHECKS, ROOT, ServerThread
from tests.test_tools import ASK, SCHEMAS, TOOLS

# A ChatML template with Hermes-style tool support, written for this test.
HERMES = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You may call functions. Their signatures:
<tools>
{% for t in tools %}{{ t | tojson }}
{% endfor %}</tools>
For each call, return a JSON object with the function name and arguments within <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}{% if m.role == 'system' and loop.first %}{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% if m.content %}{{ m.content }}
{% endif %}{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% if not loop.last %}
{% endif %}{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    tmp = tmp_path_factory.mktemp("native")
    data = yaml.safe_load((ROOT / "models.yaml").read_text())
    spec = next(m for m in data["models"] if m["id"] == MODEL)
    spec["chat_template"] = HERMES
    data["models"] = [spec]
    cfg = tmp / "models.yaml"
    cfg.write_text(yaml.safe_dump(data))
    settings = Settings.from_env(env=NO_CHECKS, config=str(cfg), parallel=2, engine="cpu")
    server = ServerThread(create_app(settings, load_registry(cfg))).start()
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client
    server.stop()


def _valid(calls: Any) -> None:
    assert calls
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def test_required_and_named_give_valid_native_calls(native: openai.OpenAI) -> None:
    r = native.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
                                       max_tokens=200, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls"
    _valid(r.choices[0].message.tool_calls)
    named = native.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200, temperature=0,  # type: ignore[arg-type]
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert {c.function.name for c in named.choices[0].message.tool_calls} == {"get_time"}


def test_stream_equals_non_stream(native: openai.OpenAI) -> None:
    kw: Any = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200,
               "temperature": 0, "parallel_tool_calls": False}
    whole = native.chat.completions.create(**kw).choices[0].message.tool_calls
    with native.chat.completions.stream(**kw) as s:
        final = s.get_final_completion()
    assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole]


def test_auto_is_free_text_or_a_valid_call(native: openai.OpenAI) -> None:
    for msgs in (ASK, [{"role": "user", "content": "Say hello."}]):
        c = native.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=120,  # type: ignore[arg-type]
                                           temperature=0).choices[0]
        if c.finish_reason == "tool_calls":
            _valid(c.message.tool_calls)
        else:
            assert c.message.content and "<tool_call>" not in c.message.content


async def test_the_template_renders_tools_calls_and_results() -> None:
    reg = load_registry(ROOT / "models.yaml")
    path = reg.resolve(reg.models[MODEL], "gguf")
    engine = LlamaCppEngine(EngineConfig(model_path=str(path), chat_template=HERMES, parallel=1))
    await engine.load()
    try:
        assert formats.detect(template_of(engine.info)).name == "hermes"
        msgs = (ChatMessage("user", "Weather in Paris?"),
                ChatMessage("assistant", "", tool_calls=(ToolCallRecord("c1", "get_weather", '{"city": "Paris"}'),)),
                ChatMessage("tool", '{"temp_c": 18}', tool_call_id="c1"))
        ids = engine.prompt_tokens(chat_request(engine, msgs, tools=TOOLS))
        text = b"".join(engine.piece(t, special=True) for t in ids).decode()
        assert '"name": "get_weather"' in text and "<tools>" in text  # the tool list
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
        assert '<tool_response>\n{"temp_c": 18}\n</tool_response>' in text
    finally:
        await engine.close()


def test_plain_chat_still_works_with_a_tool_template(native: openai.OpenAI) -> None:
    r = native.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls

