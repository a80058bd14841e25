"""Helpers for the model families' format tests: real templates kept as test data, a tool
conversation, and a parser fed at every split of a text."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engines.base import TemplateSource
from gateway.api import tools
from gateway.chat.formats.base import (
    ArgumentsDelta,
    Calls,
    CallStarted,
    ContentDelta,
    Event,
    Format,
    Parser,
    Reader,
    ReasoningDelta,
)
from gateway.chat.template import ChatTemplate
from gateway.conversation import Conversation, ToolCall, ToolChoice, ToolSpec, Turn

TEMPLATES = Path(__file__).parent / "templates"  # real models' chat templates; licenses in its README.md

WEATHER = ToolSpec("get_weather", "Current weather in a city",
                   {"type": "object", "properties": {"city": {"type": "string"},
                                                     "unit": {"type": "string", "enum": ["c", "f"]}},
                    "required": ["city"]})
TIME = ToolSpec("get_time", "The time now", {"type": "object", "properties": {}})
TOOLS = (WEATHER, TIME)


def template(name: str, bos: str = "", eos: str = "") -> ChatTemplate:
    """A real model's template from tests/templates/ (`name` without .jinja)."""
    return ChatTemplate(TemplateSource((TEMPLATES / f"{name}.jinja").read_text(), bos, eos))


def conversation(call_id: str = "call_1", choice: str = "auto", parallel: bool = True) -> Conversation:
    """A tool conversation: a question, a call, its result, and the next question."""
    call = ToolCall(call_id, "get_weather", '{"city": "Paris"}')
    turns = (Turn.of("system", "You are a helpful assistant."),
             Turn.of("user", "What is the weather in Paris?"),
             Turn.of("assistant", "", tool_calls=(call,)),
             Turn.of("tool", '{"temp_c": 18}', tool_call_id=call_id),
             Turn.of("user", "And the time?"))
    return Conversation(turns, TOOLS, ToolChoice(choice), parallel)


def calls_of(conv: Conversation, fmt: Format) -> Calls:
    p = tools.plan(conv, fmt)
    assert p is not None
    return p.calls


def render(fmt: Format, tpl: ChatTemplate, conv: Conversation, thinking: bool | None = None,
           effort: str | None = None) -> str:
    """The prompt as the gateway renders it for `fmt` (the template's own rendering of the tools)."""
    c = calls_of(conv, fmt)
    return fmt.render(tpl, fmt.turns(conv, c), tools.template_tools(conv), thinking, effort)


def summary(events: list[Event]) -> dict[str, Any]:
    """What a stream of events says, whatever its grouping: the text, the reasoning and the calls."""
    out: dict[str, Any] = {"content": "", "reasoning": "", "calls": []}
    for e in events:
        if isinstance(e, ContentDelta):
            out["content"] += e.text
        elif isinstance(e, ReasoningDelta):
            out["reasoning"] += e.text
        elif isinstance(e, CallStarted):
            assert e.index == len(out["calls"]), "calls start in order"
            out["calls"].append([e.name, ""])
        elif isinstance(e, ArgumentsDelta):
            assert e.index == len(out["calls"]) - 1, "arguments follow their call's start"
            out["calls"][e.index][1] += e.text
    return out


def fed(make: Callable[[], Parser | Reader], chunks: list[str]) -> dict[str, Any]:
    p = make()
    events: list[Event] = []
    for c in chunks:
        events += p.feed(c)
    events += p.flush()
    return summary(events)


def splits(text: str, rng: random.Random, n: int = 40) -> list[list[str]]:
    """The text whole, character by character, cut at every single point, and `n` random cuts."""
    out = [[text], list(text)]
    out += [[text[:k], text[k:]] for k in range(1, len(text))]
    for _ in range(n):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        out.append([text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)])
    return out


def same_at_every_split(make: Callable[[], Parser | Reader], text: str, seed: int = 0) -> dict[str, Any]:
    """The summary of `text` fed whole; asserted equal for every split of it."""
    whole = fed(make, [text])
    for chunks in splits(text, random.Random(seed)):
        assert fed(make, chunks) == whole, chunks
    return whole
