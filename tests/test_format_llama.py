"""Llama 3.x tool calls: the real Llama 3.2 template renders the tools, one call per assistant
turn and the results as `ipython` turns; the model's answers (JSON call objects, <|python_tag|>
built-in calls, text) are read the same at every split; the constraint compiles for llama.cpp and
ONNX Runtime GenAI."""

from __future__ import annotations

import json

import pytest

from engines import ortgenai
from engines.base import TemplateSource
from engines.llamacpp.grammar import compile_constraint
from gateway.api import tools
from gateway.chat import formats
from gateway.chat.formats.base import Format
from gateway.chat.formats.hermes import Hermes
from gateway.chat.formats.llama3 import CALL_AT_START, CALL_OPEN, PYTHON_TAG, Llama3, builtin_call
from gateway.chat.template import ChatTemplate, TemplateError, template_message
from gateway.conversation import Conversation, ToolCall, ToolChoice, ToolSpec, Turn
from tests.formats import TOOLS, calls_of, conversation, render, same_at_every_split, template
from tests.test_tools_native import HERMES

LLAMA = "meta-llama-Llama-3.2-3B-Instruct"
FMT = Llama3()
SEARCH = ToolSpec("brave_search", "Web search",
                  {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]})


def tpl() -> ChatTemplate:
    return template(LLAMA, bos="<|begin_of_text|>")


def test_detected_for_its_template_only() -> None:
    assert formats.detect(tpl()).name == "llama3"
    assert formats.detect(ChatTemplate(TemplateSource(HERMES))).name == "hermes"
    assert not FMT.detects(HERMES)
    assert not Hermes().detects(tpl().source.text)
    assert formats.named("llama3").name == "llama3"


def test_template_renders_tools_call_and_result() -> None:
    prompt = render(FMT, tpl(), conversation())
    # The tools in the first user turn, as JSON, with the card's instruction.
    assert "Environment: ipython\n" in prompt
    assert 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' \
        in prompt
    listed = json.dumps({"type": "function", "function": {"name": "get_weather",
                                                          "description": "Current weather in a city",
                                                          "parameters": TOOLS[0].parameters}}, indent=4)
    assert listed in prompt
    # The past call as the model writes it, the result in its ipython turn, as the tool wrote it.
    assert ('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}'
            '<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n{"temp_c": 18}<|eot_id|>') in prompt
    assert prompt.endswith("And the time?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def _two_calls() -> Conversation:
    calls = (ToolCall("c1", "get_weather", '{"city": "Paris"}'), ToolCall("c2", "get_time", "{}"))
    turns = (Turn.of("user", "Weather in Paris, and the time?"),
             Turn.of("assistant", "", tool_calls=calls),
             Turn.of("tool", "18C", tool_call_id="c1"),
             Turn.of("tool", "noon", tool_call_id="c2"))
    return Conversation(turns, TOOLS, ToolChoice("auto"), True)


def test_several_calls_become_one_turn_each_followed_by_its_result() -> None:
    conv = _two_calls()
    with pytest.raises(TemplateError):  # the template itself refuses two calls in one turn
        tpl().render(Format.turns(FMT, conv, None), tools.template_tools(conv))
    prompt = render(FMT, tpl(), conv)
    head = "<|start_header_id|>{}<|end_header_id|>\n\n{}<|eot_id|>"
    assert (head.format("assistant", '{"name": "get_weather", "parameters": {"city": "Paris"}}')
            + head.format("ipython", "18C")
            + head.format("assistant", '{"name": "get_time", "parameters": {}}')
            + head.format("ipython", "noon")) in prompt
    roles = [template_message(m)["role"] for m in FMT.turns(conv, None)]
    assert roles == ["user", "assistant", "tool", "assistant", "tool"]


def test_one_call_per_answer() -> None:
    assert calls_of(conversation(), FMT).max_calls == 1
    assert calls_of(conversation(), Hermes()).max_calls > 1


def read(text: str, tools_: tuple[ToolSpec, ...] = TOOLS) -> dict[str, object]:
    calls = calls_of(Conversation(conversation().turns, tools_, ToolChoice("auto"), True), FMT)
    return same_at_every_split(lambda: FMT.parser(calls), text)


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}',
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}',
    '{"type": "function", "name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}',
    '\n {"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}} \n',
])
def test_one_call(text: str) -> None:
    got = read(text)
    assert got["calls"] == [["get_weather", '{"city": "Paris", "unit": "c"}']]
    assert got["content"] == ""


def test_text_only() -> None:
    text = "The weather in Paris is 18°C {sunny}; see {\"n\": 1} or <|python"
    assert read(text) == {"content": text, "reasoning": "", "calls": []}
    assert read(' {"answer": 42}')["content"] == ' {"answer": 42}'


def test_a_call_object_inside_text_is_text_and_python_tag_is_a_call_anywhere() -> None:
    """A call is an answer that opens with its object (the template asks for nothing else): a
    JSON object the model quotes in prose stays prose, as the grammar's trigger is the answer's
    start (`CALL_AT_START`). <|python_tag|> opens a call wherever it comes."""
    text = 'Send it as {"name": "get_time", "parameters": {}} and it works.'
    assert read(text) == {"content": text, "reasoning": "", "calls": []}
    got = read('Let me check. <|python_tag|>{"name": "get_time", "parameters": {}}')
    assert got["content"] == "Let me check. "
    assert got["calls"] == [["get_time", "{}"]]


def test_python_tag_builtin_call() -> None:
    text = '<|python_tag|>brave_search.call(query="current weather in Menlo Park, California (today)")'
    got = read(text, (*TOOLS, SEARCH))
    assert got["calls"] == [["brave_search", json.dumps({"query": "current weather in Menlo Park, California (today)"})]]
    assert got["content"] == ""
    # Without such a tool in the request it is text.
    assert read(text)["calls"] == []
    assert builtin_call('wolfram_alpha.call(query="solve x^3 - 4x^2 + 6x - 24 = 0")') == \
        ("wolfram_alpha", '{"query": "solve x^3 - 4x^2 + 6x - 24 = 0"}')
    assert builtin_call('brave_search.call(query="open') is None


def test_unfinished_and_malformed_calls() -> None:
    calls = calls_of(conversation(), FMT)
    p = FMT.parser(calls)
    p.feed('{"name": "get_weather", "parameters": {"city": "Par')
    p.flush()
    assert p.calls == [("get_weather", '{"city": "Par')] and not p.done
    p = FMT.parser(calls)
    p.feed('{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert p.done
    got = read('{"name": "get_weather", "parameters": {"city": "Paris"}}}')
    assert got["calls"] == [["get_weather", '{"city": "Paris"}']] and got["content"] == "}"
    got = read(f"{PYTHON_TAG}print(1)")  # code for an interpreter the request has no tool for
    assert got == {"content": "print(1)", "reasoning": "", "calls": []}


def test_constraint_compiles() -> None:
    from llama_cpp import LlamaGrammar

    for choice, lazy in (("auto", True), ("required", False), ("auto", False)):
        conv = Conversation(conversation().turns, (*TOOLS, SEARCH), ToolChoice(choice), True)
        c = FMT.constraint(calls_of(conv, FMT), lazy)
        if choice == "auto" and not lazy:
            assert c is None
            continue
        assert c is not None and c.max_items == 1
        assert c.triggers == ((PYTHON_TAG,) if lazy else ())
        assert c.patterns == ((CALL_AT_START,) if lazy else ())
        grammar = compile_constraint(c).decode()
        assert '"<|python_tag|>brave_search.call(query="' in grammar
        LlamaGrammar.from_string(grammar, verbose=False)
        kind, data = ortgenai.guidance(c)
        assert kind == "lark_grammar" and '"get_weather"' in data
        # Each trigger starts one of the constraint's items (the constrained text starts with it).
        assert all(any((i.begin + '{"name"').startswith(t) for i in c.items) for t in c.triggers)
        assert all(any((i.begin + '{"name"').startswith(CALL_OPEN) for i in c.items) for _ in c.patterns)
