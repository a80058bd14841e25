"""Qwen3-Coder's format: its real template renders the tools, a call and its result; the model's
XML calls are read back into JSON arguments at every split of the text; detection; the grammar."""

from __future__ import annotations

import json
from typing import Any

import llama_cpp
import pytest

from engines.base import Constraint, InvalidGenerationRequest
from engines.llamacpp.grammar import compile_constraint
from engines.ortgenai import guidance
from gateway.chat import formats
from gateway.chat.formats.base import Calls, Tool, ToolChoice
from gateway.chat.formats.hermes import Hermes
from gateway.chat.formats.qwen3_coder import Qwen3Coder, XmlCallParser, json_value
from tests.formats import calls_of, conversation, render, same_at_every_split, template
from tests.test_tools_native import HERMES

FMT = Qwen3Coder()
TPL = "Qwen3-Coder"

ALARM = Tool("set_alarm", "Set an alarm", {
    "type": "object",
    "properties": {"hour": {"type": "integer"}, "loud": {"type": "boolean"},
                   "repeat": {"type": "object", "properties": {"days": {"type": "array", "items": {"type": "string"}}}},
                   "label": {"type": "string"}, "ratio": {"type": ["number", "null"]}},
    "required": ["hour"]})
WEATHER = Tool("get_weather", "Current weather in a city",
               {"type": "object", "properties": {"city": {"type": "string"},
                                                 "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city"]})
TIME = Tool("get_time", "The time now", {"type": "object", "properties": {}})


def calls(*tools: Tool, mode: str = "auto") -> Calls:
    return Calls(tools or (WEATHER, TIME, ALARM), ToolChoice(mode), True, 4)


def read(text: str, *tools: Tool) -> dict[str, Any]:
    c = calls(*tools)
    return same_at_every_split(lambda: FMT.parser(c), text)


def call(name: str, **params: str) -> str:
    """A call as the model card shows it."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


# --- the template ---------------------------------------------------------------------------------


def test_template_renders_tools_call_and_result() -> None:
    prompt = render(FMT, template(TPL), conversation())
    assert prompt.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n")
    assert "<tools>\n<function>\n<name>get_weather</name>\n<description>Current weather in a city</description>" in prompt
    assert "<parameter>\n<name>city</name>\n<type>string</type>\n</parameter>" in prompt
    assert "<required>[\"city\"]</required>" in prompt
    assert "<function>\n<name>get_time</name>" in prompt
    assert ("<|im_start|>assistant\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "</function>\n</tool_call><|im_end|>\n") in prompt
    assert "<|im_start|>user\n<tool_response>\n{\"temp_c\": 18}\n</tool_response>\n<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>user\nAnd the time?<|im_end|>\n<|im_start|>assistant\n")


def test_detection() -> None:
    tpl = template(TPL)
    assert formats.detect(tpl) is formats.named("qwen3-coder")
    assert Hermes().detects(tpl.source.text), "the template also has <tool_call>: order matters"
    assert not FMT.detects(HERMES)
    assert formats.detect(template_of_text(HERMES)).name == "hermes"


def template_of_text(text: str) -> Any:
    from engines.base import TemplateSource
    from gateway.chat.template import ChatTemplate

    return ChatTemplate(TemplateSource(text, "", ""))


# --- reading the output ----------------------------------------------------------------------------


def test_one_call() -> None:
    out = read(call("get_weather", city="Paris"))
    assert out == {"content": "", "reasoning": "", "calls": [["get_weather", '{"city": "Paris"}']]}


def test_parallel_calls() -> None:
    text = call("get_weather", city="Paris", unit="c") + "\n" + call("get_weather", city="Tokyo") + "\n" + call("get_time")
    out = read(text)
    assert out["content"] == ""
    assert out["calls"] == [["get_weather", '{"city": "Paris", "unit": "c"}'], ["get_weather", '{"city": "Tokyo"}'],
                            ["get_time", "{}"]]


def test_text_then_call() -> None:
    text = "I will check the weather in Paris for you.\n\n" + call("get_weather", city="Paris")
    out = read(text)
    assert out["content"] == "I will check the weather in Paris for you.\n\n"
    assert out["calls"] == [["get_weather", '{"city": "Paris"}']]


def test_plain_answer_keeps_tag_like_text() -> None:
    text = "Use <tool_ and <function without = signs; a < b."
    assert read(text) == {"content": text, "reasoning": "", "calls": []}


def test_string_values_are_text_escaped_as_json() -> None:
    code = 'def f(x):\n    return "a" + x  # \\ backslash\n\n'
    out = read(call("set_alarm", hour="7", label=code))
    args = json.loads(out["calls"][0][1])
    assert args == {"hour": 7, "label": code}, "only the newline before </parameter> is the tag's"


def test_non_string_values_become_json() -> None:
    text = call("set_alarm", hour="7", loud="true", repeat='{"days": ["mon", "tue"]}', ratio="0.5")
    out = read(text)
    assert json.loads(out["calls"][0][1]) == {"hour": 7, "loud": True, "repeat": {"days": ["mon", "tue"]}, "ratio": 0.5}
    assert out["calls"][0][1] == '{"hour": 7, "loud": true, "repeat": {"days": ["mon", "tue"]}, "ratio": 0.5}'


def test_non_json_value_becomes_a_string() -> None:
    out = read(call("set_alarm", hour="seven", loud="False", ratio="null"))
    assert json.loads(out["calls"][0][1]) == {"hour": "seven", "loud": False, "ratio": None}
    assert json_value(" NaN ") == '" NaN "', "not JSON: kept as text"


def test_call_without_tool_call_tags() -> None:
    out = read("<function=get_time>\n</function>")
    assert out["calls"] == [["get_time", "{}"]]


def test_unfinished_call() -> None:
    c = calls()
    p = FMT.parser(c)
    events = p.feed("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar")
    assert not p.done
    assert p.calls == [("get_weather", '{"city": "Par')]
    p.feed("is\n</parameter>\n</func")
    assert not p.done and p.calls == [("get_weather", '{"city": "Paris"')]
    p.feed("tion>")
    assert p.done and p.calls == [("get_weather", '{"city": "Paris"}')]
    assert events and p.flush() == []


def test_argument_fragments_join_to_the_arguments() -> None:
    from gateway.chat.formats.base import ArgumentsDelta

    text = call("set_alarm", hour="7", label="wake\nup") + call("get_weather", city="Rome")
    p = XmlCallParser({t.name: t.parameters for t in calls().tools})
    joined: dict[int, str] = {}
    for ch in text:
        for e in p.feed(ch):
            if isinstance(e, ArgumentsDelta):
                joined[e.index] = joined.get(e.index, "") + e.text
    assert [joined[0], joined[1]] == [a for _, a in p.calls]
    assert [json.loads(a) for a in joined.values()] == [{"hour": 7, "label": "wake\nup"}, {"city": "Rome"}]


def test_string_value_streams_before_its_end() -> None:
    p = FMT.parser(calls())
    p.feed(call("get_weather", city="Paris")[:-40])
    assert p.calls[0][1].startswith('{"city": "Par'), "a string value is streamed as it arrives"


# --- the constraint --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_constraint_compiles_and_llama_cpp_accepts_it(mode: str) -> None:
    c = FMT.constraint(calls(mode=mode), lazy=True)
    assert c is not None and c.kind == "tagged"
    assert [i.begin for i in c.items] == [f"<tool_call>\n<function={n}>\n" for n in ("get_weather", "get_time", "set_alarm")]
    assert {i.body for i in c.items} == {"xml"} and {i.end for i in c.items} == {"</function>\n</tool_call>"}
    assert c.triggers == (("<tool_call>",) if mode == "auto" else ())
    g = compile_constraint(c).decode()
    assert '"<parameter=city>\\n"' in g and '"c" | "f"' in g
    assert llama_cpp.LlamaGrammar.from_string(g, verbose=False) is not None


def test_xml_body_rules() -> None:
    c = FMT.constraint(calls(ALARM, mode="required"), lazy=True)
    assert c is not None
    g = compile_constraint(c).decode()
    body = next(line for line in g.splitlines() if line.startswith("tagged-body0 ::="))
    assert body.split("::=")[1].split() == ["tagged-body0-p0", "tagged-body0-p1?", "tagged-body0-p2?",
                                           "tagged-body0-p3?", "tagged-body0-p4?"], "required first, optional ones optional"
    assert 'tagged-body0-p3 ::= "<parameter=label>\\n" tagged-body0-text "\\n</parameter>\\n"' in g
    assert "tagged-body0-v0" in g and "tagged-body0-v2" in g, "non-string values use their JSON schemas"
    llama_cpp.LlamaGrammar.from_string(g, verbose=False)


def test_ortgenai_refuses_xml_bodies() -> None:
    c = FMT.constraint(calls_of(conversation(choice="required"), FMT), lazy=False)
    assert isinstance(c, Constraint)
    with pytest.raises(InvalidGenerationRequest):
        guidance(c)


def test_auto_needs_a_lazy_engine() -> None:
    assert FMT.constraint(calls(), lazy=False) is None
