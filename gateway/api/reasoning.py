"""Reasoning output: which requests get it (the splitter that takes it out of the answer is in
gateway/chat/thinking.py, with the tags of the model's format).

A model that thinks writes `<think>...</think>` (or its family's tags) and then its answer; its template may already have
opened the block in the prompt (gateway/chat/template.py reads that once per template). Each protocol returns
the reasoning in its own form (OpenAI chat `reasoning_content`, Responses `reasoning` items,
Anthropic `thinking` blocks, Ollama `thinking`), from the neutral `ReasoningDelta` events.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.chat.template import Traits
from gateway.models.registry import ModelSpec


@dataclass(frozen=True)
class ReasoningPlan:
    """How one request treats reasoning: `thinking` goes to the engine (None: the template's
    default), `split` says whether the output is parsed for a reasoning block, `opened` whether
    the prompt already opened it."""

    thinking: bool | None
    split: bool
    opened: bool


def reasons(spec: ModelSpec, traits: Traits) -> bool:
    """Whether this model, with the template it is served with, thinks before it answers."""
    return spec.reasoning == "on" or (spec.reasoning == "auto" and traits.reasons)


def plan(spec: ModelSpec, traits: Traits, thinking: bool | None, constrained: bool) -> ReasoningPlan | None:
    """The plan for a request that asks for `thinking` (None: the model's default). A constrained
    answer (a JSON format or a tool-call grammar from its first token) leaves no room to think,
    so it is rendered with thinking off. None: the model does not reason."""
    if not reasons(spec, traits):
        return None
    if constrained or thinking is False:
        return ReasoningPlan(False, False, False)
    return ReasoningPlan(thinking, True, traits.opens)
