"""The Mistral formats against the real templates of the family: the prompt each renders for a
tool conversation (with an OpenAI client's call id), detection of the variant, outputs of the
models read back at every split, and the constraints as the runtimes compile them."""

from __future__ import annotations

import json
import re

import pytest

from engines.base import TemplateSource
from gateway.chat import formats
from gateway.chat.formats.base import Format
from gateway.chat.formats.mistral import Mistral, MistralV11, NamedArgsParser, mistral_id
from gateway.chat.template import ChatTemplate, TemplateError
from gateway.conversation import Conversation, ToolCall, ToolChoice, Turn
from tests.formats import TOOLS, calls_of, conversation, render, same_at_every_split, template

CALL_ID = "call_8f3a9c2b7d1e4f60a5b3c9d2"
NEMO = "mistralai-Mistral-Nemo-Instruct-2407"
SMALL32 = "Mistral-Small-3.2-24B-Instruct-2506"
DEVSTRAL = "unsloth-mistral-Devstral-Small-2507"
MINISTRAL = "mistralai-Ministral-3-14B-Reasoning-2512"
V3, V11 = Mistral(), MistralV11()


def answered(call_id: str = CALL_ID) -> Conversation:
    """A tool conversation that ends with the call's result."""
    call = ToolCall(call_id, "get_weather", '{"city": "Paris"}')
    turns = (Turn.of("system", "You are a helpful assistant."),
             Turn.of("user", "What is the weather in Paris?"),
             Turn.of("assistant", "", tool_calls=(call,)),
             Turn.of("tool", '{"temp_c": 18}', tool_call_id=call_id))
    return Conversation(turns, TOOLS, ToolChoice("auto"), True)


def tools_json() -> str:
    """The tools as the v11 templates list them (`tools|tojson`)."""
    from gateway.api import tools

    return json.dumps(tools.template_tools(answered()), ensure_ascii=False)


# --- call ids ------------------------------------------------------------------------------------


def test_call_ids_become_nine_alphanumerics_deterministically() -> None:
    mid = mistral_id(CALL_ID)
    assert re.fullmatch(r"[A-Za-z0-9]{9}", mid)
    assert mistral_id(CALL_ID) == mid
    assert mistral_id("call_8f3a9c2b7d1e4f60a5b3c9d3") != mid
    assert mistral_id("abc123XYZ") == "abc123XYZ"  # already a Mistral id: kept
    assert re.fullmatch(r"[A-Za-z0-9]{9}", mistral_id("abc-23XYZ"))


def test_turns_map_a_call_and_its_result_to_the_same_id() -> None:
    turns = V3.turns(answered(), calls_of(answered(), V3))
    (call,) = turns[2].tool_calls
    assert call.id == mistral_id(CALL_ID) == turns[3].tool_call_id


# --- the prompts ---------------------------------------------------------------------------------


def test_nemo_renders_tools_the_call_with_its_id_and_the_result() -> None:
    fmt = formats.detect(template(NEMO))
    assert fmt.name == "mistral"
    text = render(fmt, template(NEMO, bos="<s>", eos="</s>"), answered())
    mid = mistral_id(CALL_ID)
    assert text.startswith('<s>[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "get_weather", '
                           '"description": "Current weather in a city", "parameters": {')
    assert '[/AVAILABLE_TOOLS][INST]What is the weather in Paris?[/INST]' in text
    assert text.endswith(f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {{"city": "Paris"}}, "id": "{mid}"}}]</s>'
                         f'[TOOL_RESULTS]{{"content": {{"temp_c": 18}}, "call_id": "{mid}"}}[/TOOL_RESULTS]')
    assert CALL_ID not in text


@pytest.mark.parametrize("name", [NEMO, SMALL32, DEVSTRAL, MINISTRAL])
def test_a_user_turn_right_after_a_tool_result_renders_as_mistrals_tokenizer_writes_it(name: str) -> None:
    """Nemo's, Small 3.2's and Ministral 3's templates refuse a user turn straight after a tool
    result (their alternation check); Mistral's tokenizer writes it as `[/TOOL_RESULTS]` and the
    next instruction, as Devstral's template does. The gateway's prompt is that, with nothing of
    the placeholder answer it renders them with left in."""
    tpl = template(name, "<s>", "</s>")
    fmt = formats.detect(tpl)
    conv = conversation(CALL_ID)  # question, call, result, next question
    assert conv.turns[-2].role == "tool" and conv.turns[-1].role == "user"
    if name != DEVSTRAL:
        with pytest.raises(TemplateError, match="alternate"):
            tpl.render(fmt.turns(conv, calls_of(conv, fmt)), None)
    text = render(fmt, tpl, conv)
    assert "\x00" not in text and text.count("</s>") == 1  # the one after the call
    assert re.search(r"\[/TOOL_RESULTS\](\[AVAILABLE_TOOLS\].*?\[/AVAILABLE_TOOLS\])?\[INST\]"
                     r"(You are a helpful assistant\.\n\n)?And the time\?\[/INST\]$", text, re.S), text[-300:]


def test_nemo_refuses_the_clients_id_unmapped() -> None:
    """The template itself refuses an id that is not 9 characters: the mapping is what lets it render."""
    tpl = template(NEMO)
    with pytest.raises(TemplateError, match="length 9"):
        Format.render(V3, tpl, Format.turns(V3, answered(), None), None, None)


def test_small_32_renders_calls_with_call_id_and_results_with_tool_content() -> None:
    fmt = formats.detect(template(SMALL32))
    assert fmt.name == "mistral-v11"  # tokenizer v11+: [TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}
    text = render(fmt, template(SMALL32, bos="<s>", eos="</s>"), answered())
    mid = mistral_id(CALL_ID)
    assert text == (f"<s>[SYSTEM_PROMPT]You are a helpful assistant.[/SYSTEM_PROMPT][AVAILABLE_TOOLS]{tools_json()}"
                    f'[/AVAILABLE_TOOLS][INST]What is the weather in Paris?[/INST][TOOL_CALLS]get_weather[CALL_ID]{mid}'
                    f'[ARGS]{{"city": "Paris"}}</s>[TOOL_RESULTS]{mid}[TOOL_CONTENT]{{"temp_c": 18}}[/TOOL_RESULTS]')


@pytest.mark.parametrize("name", [DEVSTRAL, MINISTRAL])
def test_v11_templates_render_name_args_calls(name: str) -> None:
    fmt = formats.detect(template(name))
    assert fmt.name == "mistral-v11"
    text = render(fmt, template(name, bos="<s>", eos="</s>"), answered())
    assert text == ("<s>[SYSTEM_PROMPT]You are a helpful assistant.[/SYSTEM_PROMPT]"
                    f"[AVAILABLE_TOOLS]{tools_json()}[/AVAILABLE_TOOLS]"
                    '[INST]What is the weather in Paris?[/INST][TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}</s>'
                    '[TOOL_RESULTS]{"temp_c": 18}[/TOOL_RESULTS]')


def test_the_call_a_template_writes_reads_back_as_that_call() -> None:
    """What the template writes for a past call is what the model writes: the parser reads it."""
    for name, fmt in ((NEMO, V3), (SMALL32, V11), (DEVSTRAL, V11), (MINISTRAL, V11)):
        text = render(fmt, template(name, eos="</s>"), answered())
        written = text[text.index("[TOOL_CALLS]"):text.index("</s>", text.index("[TOOL_CALLS]"))]
        got = same_at_every_split(lambda f=fmt: f.parser(calls_of(answered(), f)), written)
        assert got == {"content": "", "reasoning": "", "calls": [["get_weather", '{"city": "Paris"}']]}, name


# --- detection -----------------------------------------------------------------------------------


def test_detection_picks_the_variant_and_leaves_hermes_alone() -> None:
    from tests.test_tools_native import HERMES

    assert [formats.detect(template(n)).name for n in (NEMO, SMALL32, DEVSTRAL, MINISTRAL)] == [
        "mistral", "mistral-v11", "mistral-v11", "mistral-v11"]
    assert formats.detect(ChatTemplate(TemplateSource(HERMES, "", ""))).name == "hermes"
    assert type(formats.named("mistral-v11")).__name__ == "MistralV11"
    assert {"mistral", "mistral-v11"} <= set(formats.names())


# --- reading the output --------------------------------------------------------------------------


def v11_parser() -> NamedArgsParser:
    p = V11.parser(calls_of(answered(), V11))
    assert isinstance(p, NamedArgsParser)
    return p


@pytest.mark.parametrize(("text", "content", "calls"), [
    # Mistral 7B v0.3 / Nemo model cards: one JSON array after [TOOL_CALLS]
    ('[TOOL_CALLS][{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": "celsius"}}]',
     "", [["get_current_weather", '{"location": "Paris, France", "format": "celsius"}']]),
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
     "", [["get_weather", '{"city": "Paris"}'], ["get_time", "{}"]]),
    # with the id the template writes for past calls, and brackets inside strings
    ('[TOOL_CALLS][{"name": "search", "arguments": {"q": "a] b} [c"}, "id": "abc123XYZ"}]',
     "", [["search", '{"q": "a] b} [c"}']]),
    ('Let me check [the] weather.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     "Let me check [the] weather.", [["get_weather", '{"city": "Paris"}']]),
    ("Paris is sunny today [TOOL", "Paris is sunny today [TOOL", []),
])
def test_v3_outputs_at_every_split(text: str, content: str, calls: list[list[str]]) -> None:
    got = same_at_every_split(lambda: V3.parser(calls_of(answered(), V3)), text)
    assert got == {"content": content, "reasoning": "", "calls": calls}


def test_v3_unfinished_call_is_not_done() -> None:
    p = V3.parser(calls_of(answered(), V3))
    p.feed('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Pa')
    assert not p.done and p.calls == [("get_weather", '{"city": "Pa')]
    p.feed('ris"}}')
    assert not p.done  # the array is still open: another call may follow
    p.feed("]")
    assert p.done and p.calls == [("get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [["get_weather", '{"city": "Paris"}']]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}[TOOL_CALLS]get_time[ARGS]{}',
     "", [["get_weather", '{"city": "Paris", "unit": "c"}'], ["get_time", "{}"]]),
    ('[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}', "", [["get_weather", '{"city": "Paris"}']]),
    ('I will look it up.[TOOL_CALLS]search[ARGS]{"q": "x}] [ARGS] \\"y"}',
     "I will look it up.", [["search", '{"q": "x}] [ARGS] \\"y"}']]),
    ("Use [brackets] and [TOOL", "Use [brackets] and [TOOL", []),
])
def test_v11_outputs_at_every_split(text: str, content: str, calls: list[list[str]]) -> None:
    got = same_at_every_split(v11_parser, text)
    assert got == {"content": content, "reasoning": "", "calls": calls}


def test_v11_unfinished_call_is_not_done() -> None:
    p = v11_parser()
    p.feed("[TOOL_CALLS]get_wea")
    assert not p.done and p.calls == []
    p.feed('ther[ARGS]{"city": "Par')
    assert not p.done and p.calls == [("get_weather", '{"city": "Par')]
    p.feed('is"}')
    assert p.done and p.calls == [("get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), [
    ('[THINK]The user wants the weather in Paris, so I call get_weather.[/THINK]'
     '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
     "The user wants the weather in Paris, so I call get_weather.", "", [["get_weather", '{"city": "Paris"}']]),
    ("[THINK]A greeting: answer briefly.[/THINK]Hello! How can I help you today?",
     "A greeting: answer briefly.", "Hello! How can I help you today?", []),
])
def test_ministral_reasoning_then_answer(text: str, reasoning: str, content: str, calls: list[list[str]]) -> None:
    fmt = formats.detect(template(MINISTRAL))
    c = calls_of(answered(), fmt)
    got = same_at_every_split(lambda: fmt.reader(c, split=True, opened=False), text)  # type: ignore[arg-type,return-value]
    assert got == {"content": content, "reasoning": reasoning, "calls": calls}


# --- reasoning in the template -------------------------------------------------------------------


def test_ministral_template_reasons_in_think_tokens() -> None:
    tpl = template(MINISTRAL)
    assert tpl.traits.reasons and tpl.traits.tags == ("[THINK]", "[/THINK]") and not tpl.traits.opens
    assert not template(DEVSTRAL).traits.reasons
    assert render(V11, tpl, answered(), thinking=None).endswith("[/TOOL_RESULTS]")
    assert render(V11, tpl, answered(), thinking=True).endswith("[/TOOL_RESULTS]")
    assert render(V11, tpl, answered(), thinking=False).endswith("[/TOOL_RESULTS][THINK][/THINK]")
    assert not template(NEMO).traits.reasons


def test_thinking_off_appends_the_empty_block_in_the_templates_tags() -> None:
    from gateway.chat.thinking import BRACKET_THINK, render_thinking

    assert render_thinking(lambda kw: "P", False) == "P<think>\n\n</think>\n\n"  # unchanged for <think>
    assert render_thinking(lambda kw: "P<think>\n", False) == "P<think>\n</think>\n\n"
    assert render_thinking(lambda kw: "P", False, BRACKET_THINK) == "P[THINK][/THINK]"
    assert render_thinking(lambda kw: "P[THINK]", False, BRACKET_THINK) == "P[THINK][/THINK]"
    assert render_thinking(lambda kw: "P[/THINK]", False, BRACKET_THINK) == "P[/THINK]"


# --- constraints ---------------------------------------------------------------------------------


def _compiles(c: object) -> None:
    import llama_cpp

    from engines.llamacpp.grammar import compile_constraint
    from engines.ortgenai import guidance

    g = compile_constraint(c)  # type: ignore[arg-type]
    assert llama_cpp.LlamaGrammar.from_string(g.decode(), verbose=False) is not None
    kind, data = guidance(c)  # type: ignore[arg-type]
    assert kind == "lark_grammar" and data.startswith("start:")


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_v3_constraint(choice: str) -> None:
    conv = conversation(call_id=CALL_ID, choice=choice)
    c = V3.constraint(calls_of(conv, V3), lazy=True)
    assert c is not None
    assert (c.prefix, c.separator, c.suffix) == ("[TOOL_CALLS][", ", ", "]")
    assert c.triggers == (("[TOOL_CALLS]",) if choice == "auto" else ())
    schemas = [json.loads(i.schema or "") for i in c.items]
    assert [s["properties"]["name"] for s in schemas] == [{"const": "get_weather"}, {"const": "get_time"}]
    assert schemas[0]["properties"]["arguments"] == TOOLS[0].parameters
    _compiles(c)


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_v11_constraint(choice: str) -> None:
    conv = conversation(call_id=CALL_ID, choice=choice)
    c = V11.constraint(calls_of(conv, V11), lazy=True)
    assert c is not None
    assert [i.begin for i in c.items] == ["[TOOL_CALLS]get_weather[ARGS]", "[TOOL_CALLS]get_time[ARGS]"]
    assert json.loads(c.items[0].schema or "") == TOOLS[0].parameters
    assert (c.prefix, c.suffix) == ("", "")
    assert c.triggers == (("[TOOL_CALLS]",) if choice == "auto" else ())
    _compiles(c)


def test_no_lazy_constraint_where_the_engine_cannot_start_late() -> None:
    assert V3.constraint(calls_of(conversation(), V3), lazy=False) is None
    assert V11.constraint(calls_of(conversation(), V11), lazy=False) is None
