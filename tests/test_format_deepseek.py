"""DeepSeek's formats (R1 and its distills, V3.1): the real templates render the tools' call and
result; calls between the special tokens are read back at every split, after the reasoning;
detection; the constraints."""

from __future__ import annotations

import json
from typing import Any

import llama_cpp
import pytest

from engines.base import TemplateSource
from engines.llamacpp.grammar import compile_constraint
from engines.ortgenai import guidance
from gateway.chat import formats
from gateway.chat.formats.base import Calls, Format
from gateway.chat.formats.deepseek import DeepSeekR1, DeepSeekV31
from gateway.chat.template import ChatTemplate
from tests.formats import calls_of, conversation, render, same_at_every_split, template
from tests.test_tools_native import HERMES

R1, V31 = DeepSeekR1(), DeepSeekV31()
R1_TEMPLATES = ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B")
V31_TEMPLATE = "deepseek-ai-DeepSeek-V3.1"
BOS = "<｜begin▁of▁sentence｜>"
BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def calls(fmt: Format, choice: str = "auto") -> Calls:
    return calls_of(conversation(choice=choice), fmt)


def r1_call(name: str, args: str) -> str:
    return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"


def v31_call(name: str, args: str) -> str:
    return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>"


def read(fmt: Format, text: str, split: bool = False, opened: bool = False) -> dict[str, Any]:
    c = calls(fmt)
    if not split:
        return same_at_every_split(lambda: fmt.parser(c), text)
    return same_at_every_split(lambda: fmt.reader(c, split=True, opened=opened), text)  # type: ignore[arg-type,return-value]


# --- the templates ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", R1_TEMPLATES)
def test_r1_templates_render_call_and_result(name: str) -> None:
    prompt = render(R1, template(name, BOS), conversation())
    assert prompt.startswith(BOS + "You are a helpful assistant.<｜User｜>What is the weather in Paris?")
    assert ("<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
            '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>') in prompt
    assert '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{"temp_c": 18}<｜tool▁output▁end｜>' in prompt
    assert prompt.endswith("<｜User｜>And the time?<｜Assistant｜><think>\n")
    assert "<｜Assistant｜><｜end▁of▁sentence｜>" not in prompt, "a call's turn has no empty text turn"
    off = render(R1, template(name, BOS), conversation(), thinking=False)
    assert off.endswith("<｜Assistant｜><think>\n</think>\n\n")


def test_r1_template_with_tojson_arguments() -> None:
    """llama.cpp's copies write the arguments with tojson: they get the arguments as an object."""
    text = template(R1_TEMPLATES[0]).source.text.replace("tool['function']['arguments']",
                                                        "tool['function']['arguments'] | tojson")
    prompt = render(R1, ChatTemplate(TemplateSource(text, BOS, "")), conversation())
    assert '```json\n{"city": "Paris"}\n```' in prompt


def test_v31_template_renders_call_result_and_thinking() -> None:
    tpl = template(V31_TEMPLATE, BOS)
    prompt = render(V31, tpl, conversation())
    assert ("<｜User｜>What is the weather in Paris?<｜Assistant｜><think></think><｜tool▁calls▁begin｜>"
            '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
            "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>") in prompt
    assert '<｜tool▁output▁begin｜>{"temp_c": 18}<｜tool▁output▁end｜>' in prompt
    assert prompt.endswith("<｜User｜>And the time?<｜Assistant｜><think></think>")
    assert render(V31, tpl, conversation(), thinking=True).endswith("<｜Assistant｜><think>")
    assert render(V31, tpl, conversation(), thinking=False).endswith("<｜Assistant｜><think></think>")


def test_v31_thinking_switch_without_enable_thinking() -> None:
    """The publisher's template reads only `thinking`: the gateway's switch still reaches it."""
    text = template(V31_TEMPLATE).source.text
    start = text.index("{%- if not thinking is defined -%}")
    end = text.index("{%- set ns = namespace")
    own = text[:start] + "{%- if not thinking is defined -%}{%- set thinking = false -%}{%- endif -%}\n" + text[end:]
    assert "enable_thinking" not in own
    tpl = ChatTemplate(TemplateSource(own, BOS, ""))
    assert render(V31, tpl, conversation(), thinking=True).endswith("<｜Assistant｜><think>")
    assert render(V31, tpl, conversation()).endswith("<｜Assistant｜><think></think>")


def test_detection() -> None:
    for name in R1_TEMPLATES:
        assert formats.detect(template(name)) is formats.named("deepseek-r1")
    assert formats.detect(template(V31_TEMPLATE)) is formats.named("deepseek-v3.1")
    assert not R1.detects(HERMES) and not V31.detects(HERMES)
    assert formats.detect(ChatTemplate(TemplateSource(HERMES, "", ""))).name == "hermes"


# --- reading the output ----------------------------------------------------------------------------


def test_r1_one_call() -> None:
    out = read(R1, BEGIN + r1_call("get_weather", '{"city": "Paris"}') + END)
    assert out == {"content": "", "reasoning": "", "calls": [["get_weather", '{"city": "Paris"}']]}


def test_r1_parallel_calls_and_text_before() -> None:
    text = ("I'll look both up.\n\n" + BEGIN + r1_call("get_weather", '{"city": "Paris", "unit": "c"}') + "\n"
            + r1_call("get_time", "{}") + END)
    out = read(R1, text)
    assert out["content"] == "I'll look both up.\n\n"
    assert out["calls"] == [["get_weather", '{"city": "Paris", "unit": "c"}'], ["get_time", "{}"]]


def test_r1_reasoning_then_call() -> None:
    text = ("The user wants the weather in Paris. I should call get_weather.\n</think>\n\n"
            + BEGIN + r1_call("get_weather", '{"city": "Paris"}') + END)
    out = read(R1, text, split=True, opened=True)
    assert out["reasoning"] == "The user wants the weather in Paris. I should call get_weather.\n"
    assert out["content"] == ""
    assert out["calls"] == [["get_weather", '{"city": "Paris"}']]


def test_r1_reasoning_then_answer() -> None:
    out = read(R1, "Simple question.</think>\n\nIt is 18 °C in Paris.", split=True, opened=True)
    assert out == {"content": "It is 18 °C in Paris.", "reasoning": "Simple question.", "calls": []}


def test_arguments_with_braces_in_strings() -> None:
    args = '{"city": "Pa}r\\"is{", "unit": "c"}'
    out = read(V31, BEGIN + v31_call("get_weather", args) + END)
    assert out["calls"] == [["get_weather", args]]
    assert json.loads(out["calls"][0][1])["city"] == 'Pa}r"is{'


def test_v31_calls() -> None:
    text = BEGIN + v31_call("get_weather", '{"city": "Paris"}') + v31_call("get_time", "{}") + END
    out = read(V31, text)
    assert out == {"content": "", "reasoning": "",
                   "calls": [["get_weather", '{"city": "Paris"}'], ["get_time", "{}"]]}


def test_v31_reasoning_then_call() -> None:
    text = "Need the weather tool.</think>" + BEGIN + v31_call("get_weather", '{"city": "Paris"}') + END
    out = read(V31, text, split=True, opened=True)
    assert out["reasoning"] == "Need the weather tool."
    assert out["calls"] == [["get_weather", '{"city": "Paris"}']]


@pytest.mark.parametrize("fmt,text", [
    (R1, BEGIN + r1_call("get_weather", '{"city": "Paris"}')[:-30]),
    (V31, BEGIN + "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Par"),
])
def test_unfinished_call(fmt: Format, text: str) -> None:
    p = fmt.parser(calls(fmt))
    p.feed(text)
    p.flush()
    assert not p.done
    assert p.calls and p.calls[0][0] == "get_weather"


def test_call_is_done_at_its_end() -> None:
    p = V31.parser(calls(V31))
    text = BEGIN + v31_call("get_weather", '{"city": "Paris"}')
    p.feed(text[:-3])
    assert not p.done
    p.feed(text[-3:])
    assert p.done and p.calls == [("get_weather", '{"city": "Paris"}')]


# --- the constraints -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [R1, V31])
@pytest.mark.parametrize("choice", ["auto", "required"])
def test_constraint(fmt: Format, choice: str) -> None:
    c = fmt.constraint(calls(fmt, choice), lazy=True)
    assert c is not None
    assert (c.prefix, c.suffix) == (BEGIN, END)
    assert c.triggers == ((BEGIN,) if choice == "auto" else ())
    sample = (r1_call if fmt is R1 else v31_call)("get_weather", "")
    assert [i.begin + i.end for i in c.items][0] == sample
    assert [json.loads(i.schema or "") for i in c.items][0]["required"] == ["city"]
    g = compile_constraint(c).decode()
    assert llama_cpp.LlamaGrammar.from_string(g, verbose=False) is not None
    kind, data = guidance(c)
    assert kind == "lark_grammar" and "get_weather" in data
