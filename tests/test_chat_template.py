"""The gateway's one renderer gives, for the real models' templates, exactly the prompt the
llama.cpp engine rendered itself before (llama-cpp-python's Jinja2ChatFormatter, transformers'
environment): so the greedy answers of every engine are what they were. Tools, past calls,
results and the reasoning switch included."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from engines.base import EngineConfig, TemplateSource
from engines.llamacpp.engine import LlamaCppEngine
from gateway.chat.template import ChatMessage, ChatTemplate, TemplateError, ToolCallRecord, template_message
from gateway.models.registry import load_registry
from tests.conftest import ROOT
from tests.test_reasoning import QWEN3
from tests.test_tools_native import HERMES, TOOLS

CALL = ToolCallRecord("c1", "get_weather", '{"city": "Paris"}')
CONVERSATIONS: list[tuple[ChatMessage, ...]] = [
    (ChatMessage("user", "Hi"),),
    (ChatMessage("system", "You are terse."), ChatMessage("user", "Name a colour.")),
    (ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello! How can I help?"), ChatMessage("user", "A joke, please.")),
    (ChatMessage("user", "Unicode: café, 東京, emoji 🙂 and \"quotes\"\nnewline"),),
    (ChatMessage("user", "Weather in Paris?"), ChatMessage("assistant", "", tool_calls=(CALL,)),
     ChatMessage("tool", '{"temp_c": 18}', tool_call_id="c1")),
]


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "gemma-3-270m"])
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[LlamaCppEngine]:
    reg = load_registry(ROOT / "models.yaml")
    spec = reg.models[request.param]  # its template: the GGUF's, or models.yaml's where the GGUF has none
    e = LlamaCppEngine(EngineConfig(model_path=str(reg.resolve(spec, "gguf")), parallel=1, context_length=512,
                                    chat_template=spec.chat_template))
    await e.load()
    yield e
    await e.close()


def _reference(source: TemplateSource, messages: tuple[ChatMessage, ...], tools: list[dict[str, Any]] | None = None,
               **kwargs: Any) -> str:
    formatter = Jinja2ChatFormatter(template=source.text, eos_token=source.eos_token, bos_token=source.bos_token)
    return formatter(messages=[template_message(m) for m in messages], tools=tools, **kwargs).prompt  # type: ignore[arg-type]


@pytest.mark.parametrize("k", range(len(CONVERSATIONS)))
async def test_the_models_own_templates_render_as_before(engine: LlamaCppEngine, k: int) -> None:
    source = engine.info.template
    assert source is not None and source.bos_token and source.eos_token  # the texts read from the GGUF
    msgs = CONVERSATIONS[k]
    try:
        want = _reference(source, msgs)
    except ValueError as exc:  # Gemma's template refuses tool turns: so does ours, with its message
        with pytest.raises(TemplateError, match=str(exc)[:40]):
            ChatTemplate(source).render(msgs)
        return
    assert ChatTemplate(source).render(msgs) == want


async def test_tools_calls_and_results_render_where_the_template_puts_them(engine: LlamaCppEngine) -> None:
    source = TemplateSource(HERMES, engine.info.template.bos_token, engine.info.template.eos_token)  # type: ignore[union-attr]
    for msgs in CONVERSATIONS:
        got = ChatTemplate(source).render(msgs, TOOLS)
        assert got == _reference(source, msgs, TOOLS)
        assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) in got


def test_the_reasoning_switch_is_a_template_variable() -> None:
    source = TemplateSource(QWEN3)
    hi = (ChatMessage("user", "Hi"),)
    assert ChatTemplate(source).render(hi, thinking=False) == _reference(source, hi, enable_thinking=False)
    assert ChatTemplate(source).render(hi, thinking=True) == _reference(source, hi, enable_thinking=True)


def test_a_template_error_is_a_template_error_whatever_raised_it() -> None:
    broken = ChatTemplate(TemplateSource("{{ messages[5].content }}"))
    with pytest.raises(TemplateError):
        broken.render((ChatMessage("user", "Hi"),))
    strict = ChatTemplate(TemplateSource("{{ raise_exception('roles must alternate') }}"))
    with pytest.raises(TemplateError, match="roles must alternate"):
        strict.render((ChatMessage("user", "Hi"),))
