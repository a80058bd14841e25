"""Functionary v3.2 tool calls: the real template renders the tools as a TypeScript namespace and
past calls as `>>>NAME\\n{json}`; the model's answers (`all` text, calls in a row, text then calls)
are read the same at every split; the constraint compiles for llama.cpp and ONNX Runtime GenAI."""

from __future__ import annotations

import pytest

from engines import ortgenai
from engines.base import TemplateSource
from engines.llamacpp.grammar import compile_constraint
from gateway.chat import formats
from gateway.chat.formats.functionary import Functionary
from gateway.chat.formats.hermes import Hermes
from gateway.chat.formats.llama3 import Llama3
from gateway.chat.template import ChatTemplate
from gateway.conversation import Conversation, ToolCall, ToolChoice, Turn
from tests.formats import TOOLS, calls_of, conversation, render, same_at_every_split, template
from tests.test_tools_native import HERMES

NAME = "meetkai-functionary-medium-v3.2"
FMT = Functionary()


def tpl() -> ChatTemplate:
    return template(NAME, bos="<|begin_of_text|>")


def test_detected_for_its_template_only() -> None:
    assert formats.detect(tpl()).name == "functionary-v3.2"
    assert formats.detect(ChatTemplate(TemplateSource(HERMES))).name == "hermes"
    assert not FMT.detects(HERMES)
    assert not Hermes().detects(tpl().source.text)
    assert not FMT.detects(template("meta-llama-Llama-3.2-3B-Instruct").source.text)
    assert Llama3().detects(tpl().source.text) is False


def test_template_renders_tools_call_and_result() -> None:
    prompt = render(FMT, tpl(), conversation())
    assert "Respond in this format:\n>>>${recipient}\n${content}\nAvailable functions:\n" in prompt
    assert ("namespace functions {\n\n// Current weather in a city\ntype get_weather = (_: {\ncity: string,\n"
            'unit?: "c" | "f",\n}) => any;\n\n// The time now\ntype get_time = () => any;\n\n} // namespace functions'
            ) in prompt
    assert ('<|start_header_id|>assistant<|end_header_id|>\n\n>>>get_weather\n{"city": "Paris"}<|eot_id|>'
            '<|start_header_id|>tool<|end_header_id|>\n\n{"temp_c": 18}<|eot_id|>') in prompt
    # The generation prompt opens the answer's first recipient.
    assert prompt.endswith("And the time?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n>>>")


def test_text_and_several_calls_in_one_turn() -> None:
    calls = (ToolCall("c1", "get_weather", '{"city": "Paris"}'), ToolCall("c2", "get_time", "{}"))
    turns = (Turn.of("user", "Weather in Paris, and the time?"),
             Turn.of("assistant", "Checking.", tool_calls=calls),
             Turn.of("tool", "18C", tool_call_id="c1"),
             Turn.of("tool", "noon", tool_call_id="c2"))
    prompt = render(FMT, tpl(), Conversation(turns, TOOLS, ToolChoice("auto"), True))
    assert ('<|start_header_id|>assistant<|end_header_id|>\n\n>>>all\nChecking.>>>get_weather\n{"city": "Paris"}'
            '>>>get_time\n{}<|eot_id|>') in prompt
    assert calls_of(conversation(), FMT).max_calls > 1


def read(text: str) -> dict[str, object]:
    calls = calls_of(conversation(), FMT)
    return same_at_every_split(lambda: FMT.parser(calls), text)


def test_text_only() -> None:
    assert read("all\nHello! I can tell you the weather > or the time >> too.") == \
        {"content": "Hello! I can tell you the weather > or the time >> too.", "reasoning": "", "calls": []}
    assert read(">>>all\nHi")["content"] == "Hi"
    assert read("Hi there")["content"] == "Hi there"  # no recipient: text


def test_one_call() -> None:
    got = read('get_weather\n{"city": "Paris", "unit": "c"}')
    assert got == {"content": "", "reasoning": "", "calls": [["get_weather", '{"city": "Paris", "unit": "c"}']]}


def test_calls_in_a_row_and_text_before() -> None:
    got = read('get_weather\n{"city": "Paris"}>>>get_time\n{}')
    assert got["calls"] == [["get_weather", '{"city": "Paris"}'], ["get_time", "{}"]]
    got = read('all\nLet me check.>>>get_weather\n{"city": "a>>>b"}\n>>>get_time\n{}')
    assert got["content"] == "Let me check."
    assert got["calls"] == [["get_weather", '{"city": "a>>>b"}'], ["get_time", "{}"]]


def test_unfinished_call() -> None:
    p = FMT.parser(calls_of(conversation(), FMT))
    p.feed('get_weather\n{"city": "Pa')
    p.flush()
    assert p.calls == [("get_weather", '{"city": "Pa')] and not p.done
    p = FMT.parser(calls_of(conversation(), FMT))
    p.feed('get_weather\n{"city": "Paris"}')
    assert p.done


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_constraint_compiles(choice: str) -> None:
    from llama_cpp import LlamaGrammar

    conv = Conversation(conversation().turns, TOOLS, ToolChoice(choice), True)
    c = FMT.constraint(calls_of(conv, FMT), lazy=True)
    assert c is not None
    assert [i.begin for i in c.items] == ["get_weather\n", "get_time\n"] and c.separator == ">>>"
    # Under auto the call starts at its recipient: after the prompt's `>>>` or one the model wrote.
    assert c.triggers == ()
    assert c.patterns == (("(?:^|>>>)(get_weather\n)", "(?:^|>>>)(get_time\n)") if choice == "auto" else ())
    grammar = compile_constraint(c).decode()
    LlamaGrammar.from_string(grammar, verbose=False)
    kind, data = ortgenai.guidance(c)
    assert kind == "lark_grammar" and '"get_time\\n"' in data
    assert FMT.constraint(calls_of(conversation(), FMT), lazy=False) is None
