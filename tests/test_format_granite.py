"""The Granite 3.x format against Granite 3.3's real template: the prompt it renders for a tool
conversation, its `thinking` switch, detection (Granite 4 speaks Hermes), outputs read back at
every split, and the constraint as the runtimes compile it."""

from __future__ import annotations

import json

import pytest

from engines.base import TemplateSource
from gateway.chat import formats
from gateway.chat.formats.granite import Granite
from gateway.chat.template import ChatTemplate
from gateway.conversation import Conversation, Turn
from tests.formats import TOOLS, calls_of, conversation, render, same_at_every_split, template

GRANITE33 = "ibm-granite-granite-3.3-2B-Instruct"
GRANITE4 = "ibm-granite-granite-4.0"
CALL_ID = "call_8f3a9c2b7d1e4f60a5b3c9d2"
FMT = Granite()


def test_detection() -> None:
    from tests.test_tools_native import HERMES

    assert formats.detect(template(GRANITE33)).name == "granite"
    assert formats.detect(template(GRANITE4)).name == "hermes"
    assert formats.detect(ChatTemplate(TemplateSource(HERMES, "", ""))).name == "hermes"
    assert formats.named("granite").name == "granite"


def test_renders_tools_the_call_as_the_model_writes_it_and_the_result() -> None:
    tpl = template(GRANITE33)
    text = render(formats.detect(tpl), tpl, conversation(call_id=CALL_ID))
    from gateway.api import tools

    listed = json.dumps(tools.template_tools(conversation()), indent=4)
    assert text.startswith("<|start_of_role|>system<|end_of_role|>You are a helpful assistant.<|end_of_text|>\n"
                           f"<|start_of_role|>available_tools<|end_of_role|>{listed}<|end_of_text|>\n")
    assert text.endswith(
        "<|start_of_role|>user<|end_of_role|>What is the weather in Paris?<|end_of_text|>\n"
        '<|start_of_role|>assistant<|end_of_role|><|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
        "<|end_of_text|>\n"
        '<|start_of_role|>tool<|end_of_role|>{"temp_c": 18}<|end_of_text|>\n'
        "<|start_of_role|>user<|end_of_role|>And the time?<|end_of_text|>\n"
        "<|start_of_role|>assistant<|end_of_role|>")


def test_the_call_as_written_reads_back() -> None:
    conv = conversation(call_id=CALL_ID)
    text = render(FMT, template(GRANITE33), conv)
    start = text.index("<|tool_call|>", text.index("What is the weather"))
    written = text[start:text.index("<|end_of_text|>", start)]
    got = same_at_every_split(lambda: FMT.parser(calls_of(conv, FMT)), written)
    assert got == {"content": "", "reasoning": "", "calls": [["get_weather", '{"city": "Paris"}']]}


def test_thinking_is_the_templates_own_switch() -> None:
    """On, the system prompt asks for <think> and <response>; off (or the default), none, and
    no empty block is added (the template has no such convention)."""
    tpl = template(GRANITE33)
    chat = Conversation((Turn.of("user", "Why is the sky blue?"),))
    on = FMT.render(tpl, FMT.turns(chat, None), None, True)
    assert "Write your thoughts between <think></think> and write your response between <response></response>" in on
    for thinking in (False, None):
        off = FMT.render(tpl, FMT.turns(chat, None), None, thinking)
        assert "<think>" not in off
        assert off.endswith("<|start_of_role|>user<|end_of_role|>Why is the sky blue?<|end_of_text|>\n"
                            "<|start_of_role|>assistant<|end_of_role|>")
    assert tpl.traits.reasons and not tpl.traits.toggle and tpl.traits.tags == ("<think>", "</think>")


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]',
     "", [["get_weather", '{"city": "Paris", "unit": "c"}']]),
    ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
     "", [["get_weather", '{"city": "Paris"}'], ["get_time", "{}"]]),
    ('I will check. <|tool_call|>[{"name": "search", "arguments": {"q": "<|tool_call|> ]}"}}]',
     "I will check. ", [["search", '{"q": "<|tool_call|> ]}"}']]),
    ("The sky is blue <|tool", "The sky is blue <|tool", []),
])
def test_outputs_at_every_split(text: str, content: str, calls: list[list[str]]) -> None:
    got = same_at_every_split(lambda: FMT.parser(calls_of(conversation(), FMT)), text)
    assert got == {"content": content, "reasoning": "", "calls": calls}


def test_unfinished_call_is_not_done() -> None:
    p = FMT.parser(calls_of(conversation(), FMT))
    p.feed('<|tool_call|>[{"name": "get_weather", "arguments": {"ci')
    assert not p.done and p.calls == [("get_weather", '{"ci')]
    p.feed('ty": "Paris"}}]')
    assert p.done and p.calls == [("get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize("with_tools", [True, False])
def test_reasoning_then_response(with_tools: bool) -> None:
    """Granite 3.3 with thinking on: <think>...</think><response>...</response>."""
    text = ("<think>The user asks why the sky is blue. Rayleigh scattering.</think>"
            "<response>Sunlight scatters off air molecules, blue the most.</response>")
    c = calls_of(conversation(), FMT) if with_tools else None
    got = same_at_every_split(lambda: FMT.reader(c, split=True, opened=False), text)  # type: ignore[arg-type,return-value]
    assert got == {"content": "Sunlight scatters off air molecules, blue the most.",
                   "reasoning": "The user asks why the sky is blue. Rayleigh scattering.", "calls": []}


def test_response_tags_only_go_when_reasoning_is_read() -> None:
    got = same_at_every_split(lambda: FMT.reader(None, split=True, opened=False),  # type: ignore[arg-type,return-value]
                              "<think>x</think><response>a <respo b</response>")
    assert got == {"content": "a <respo b", "reasoning": "x", "calls": []}
    assert FMT.reader(None, split=False, opened=False) is None


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_constraint(choice: str) -> None:
    import llama_cpp

    from engines.llamacpp.grammar import compile_constraint
    from engines.ortgenai import guidance

    c = FMT.constraint(calls_of(conversation(choice=choice), FMT), lazy=True)
    assert c is not None
    assert (c.prefix, c.separator, c.suffix) == ("<|tool_call|>[", ", ", "]")
    assert c.triggers == (("<|tool_call|>",) if choice == "auto" else ())
    schemas = [json.loads(i.schema or "") for i in c.items]
    assert [s["properties"]["name"] for s in schemas] == [{"const": t.name} for t in TOOLS]
    assert llama_cpp.LlamaGrammar.from_string(compile_constraint(c).decode(), verbose=False) is not None
    assert guidance(c)[0] == "lark_grammar"
    assert FMT.constraint(calls_of(conversation(), FMT), lazy=False) is None
