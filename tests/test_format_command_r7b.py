"""Command R7B's format: the real template renders the tools, a call and its result; the plan is
reasoning, the action's JSON list the calls, the response's text the answer (without its tags),
at every split; detection; the constraint."""

from __future__ import annotations

import json
from typing import Any

import llama_cpp
import pytest

from engines.base import TemplateSource
from engines.llamacpp.grammar import compile_constraint
from engines.ortgenai import guidance
from gateway.chat import formats
from gateway.chat.formats.base import Calls
from gateway.chat.formats.command_r7b import CommandR7B
from gateway.chat.template import ChatTemplate
from tests.formats import calls_of, conversation, render, same_at_every_split, template
from tests.test_tools_native import HERMES

FMT = CommandR7B()
TPL = "CohereForAI-c4ai-command-r7b-12-2024-tool_use"
PLAN = "<|START_THINKING|>I will look up the weather in Paris with get_weather.<|END_THINKING|>"


def calls(choice: str = "auto") -> Calls:
    return calls_of(conversation(choice=choice), FMT)


def action(*items: tuple[str, str]) -> str:
    body = ",\n    ".join(f'{{"tool_call_id": "{k}", "tool_name": "{n}", "parameters": {a}}}'
                          for k, (n, a) in enumerate(items))
    return f"<|START_ACTION|>[\n    {body}\n]<|END_ACTION|>"


def read(text: str, tools: bool = True, opened: bool = False) -> dict[str, Any]:
    c = calls() if tools else None
    return same_at_every_split(lambda: FMT.reader(c, split=True, opened=opened), text)  # type: ignore[arg-type,return-value]


def test_template_renders_tools_call_and_result() -> None:
    prompt = render(FMT, template(TPL, "<BOS_TOKEN>"), conversation())
    assert prompt.startswith("<BOS_TOKEN><|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|># System Preamble")
    assert ('    {"name": "get_weather", "description": "Current weather in a city", "parameters": '
            '{"type": "object", "properties": {"city": {"type": "string"}') in prompt
    assert "# Developer Preamble\n" in prompt and "You are a helpful assistant.<|END_OF_TURN_TOKEN|>" in prompt
    assert ('<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|><|END_THINKING|><|START_ACTION|>[\n'
            '    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}\n'
            ']<|END_ACTION|><|END_OF_TURN_TOKEN|>') in prompt
    assert ('<|START_TOOL_RESULT|>[\n    {\n        "tool_call_id": "0",\n        "results": {\n'
            '            "0": "{\\"temp_c\\": 18}"\n        },\n        "is_error": null\n    }\n]<|END_TOOL_RESULT|>') in prompt
    assert prompt.endswith("<|USER_TOKEN|>And the time?<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>")


def test_thinking_off_writes_an_empty_plan() -> None:
    tpl = template(TPL)
    assert render(FMT, tpl, conversation(), thinking=False).endswith("<|CHATBOT_TOKEN|><|START_THINKING|><|END_THINKING|>")
    assert render(FMT, tpl, conversation(), thinking=True).endswith("<|CHATBOT_TOKEN|>")


def test_detection() -> None:
    assert formats.detect(template(TPL)) is formats.named("command-r7b")
    assert not FMT.detects(HERMES)
    assert formats.detect(ChatTemplate(TemplateSource(HERMES, "", ""))).name == "hermes"


def test_plan_then_call() -> None:
    out = read(PLAN + action(("get_weather", '{"city": "Paris"}')))
    assert out == {"content": "", "reasoning": "I will look up the weather in Paris with get_weather.",
                   "calls": [["get_weather", '{"city": "Paris"}']]}


def test_parallel_calls() -> None:
    out = read(PLAN + action(("get_weather", '{"city": "Paris", "unit": "c"}'), ("get_time", "{}")))
    assert out["calls"] == [["get_weather", '{"city": "Paris", "unit": "c"}'], ["get_time", "{}"]]
    assert out["content"] == ""


def test_two_action_blocks_give_the_calls_of_both() -> None:
    """A model that writes a second action block (each a list of its own): both blocks' calls, in
    order and numbered on, whole and streamed at every split."""
    out = read(PLAN + action(("get_weather", '{"city": "Paris"}')) + "\n" + action(("get_time", "{}")))
    assert out["calls"] == [["get_weather", '{"city": "Paris"}'], ["get_time", "{}"]]
    assert out["content"] == ""


def test_call_without_plan() -> None:
    out = read(action(("get_weather", '{"city": "Paris"}')))
    assert out == {"content": "", "reasoning": "", "calls": [["get_weather", '{"city": "Paris"}']]}


@pytest.mark.parametrize("tools", [True, False])
def test_response_is_the_text_inside_its_tags(tools: bool) -> None:
    text = "<|START_THINKING|>The result says 18.<|END_THINKING|><|START_RESPONSE|>It is 18 °C in Paris.<|END_RESPONSE|>"
    out = read(text, tools)
    assert out == {"content": "It is 18 °C in Paris.", "reasoning": "The result says 18.", "calls": []}


def test_plain_response() -> None:
    assert read("<|START_RESPONSE|>Hello! <|END_RESPONSE|>")["content"] == "Hello! "
    assert read("No tags < at all |>")["content"] == "No tags < at all |>"


def test_plan_opened_by_the_prompt() -> None:
    out = read("Plan.<|END_THINKING|><|START_RESPONSE|>Done.<|END_RESPONSE|>", opened=True)
    assert (out["reasoning"], out["content"]) == ("Plan.", "Done.")


def test_unfinished_call() -> None:
    r = FMT.reader(calls(), split=True, opened=False)
    assert r is not None
    text = PLAN + action(("get_weather", '{"city": "Paris"}'))
    cut = text.rindex("Paris") + 2
    r.feed(text[:cut])
    assert not r.done and r.calls == [("get_weather", '{"city": "Pa')]
    r.feed(text[cut:])
    assert r.done and json.loads(r.calls[0][1]) == {"city": "Paris"}


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_constraint(choice: str) -> None:
    c = FMT.constraint(calls(choice), lazy=True)
    assert c is not None
    assert (c.prefix, c.separator, c.suffix) == ("<|START_ACTION|>[\n    ", ",\n    ", "\n]<|END_ACTION|>")
    assert c.triggers == (("<|START_ACTION|>",) if choice == "auto" else ())
    schema = json.loads(c.items[0].schema or "")
    assert schema["properties"]["tool_name"] == {"const": "get_weather"}
    assert schema["properties"]["parameters"]["required"] == ["city"]
    g = compile_constraint(c).decode()
    assert llama_cpp.LlamaGrammar.from_string(g, verbose=False) is not None
    kind, data = guidance(c)
    assert kind == "lark_grammar" and "START_ACTION" in data
