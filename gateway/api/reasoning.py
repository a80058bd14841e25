"""Reasoning output: which requests get it (the splitter that takes it out of the answer is in
gateway/chat/thinking.py, with the tags of the model's format).

A model that thinks writes `<think>...</think>` (or its family's tags) and then its answer; its template may already have
opened the block in the prompt (gateway/chat/template.py reads that once per template). Each protocol returns
the reasoning in its own form (OpenAI chat `reasoning_content`, Responses `reasoning` items,
Anthropic `thinking` blocks, Ollama `thinking`), from the neutral `ReasoningDelta` events.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.chat.formats.base import Format
from gateway.chat.template import Traits
from gateway.chat.thinking import REASONING_FORMATS
from gateway.models.registry import ModelSpec

CHANNELS = ("harmony", "command-r7b")  # formats whose reasoning is a block of their own, not a pair of tags


@dataclass(frozen=True)
class ReasoningPlan:
    """How one request treats reasoning: `thinking` goes to the engine (None: the template's
    default), `split` says whether the output is parsed for a reasoning block, `opened` whether
    the prompt already opened it (`opened_by`: once rendered, the prompt says), `tags` those it is
    written in (None: the model format's)."""

    thinking: bool | None
    split: bool
    opened: bool
    tags: tuple[str, str] | None = None

    def opened_by(self, prompt: str) -> ReasoningPlan:
        """The plan once the prompt is rendered: with tags of models.yaml's, whether it ends with
        their opening (the template's own tags are known from the template)."""
        if self.tags is None or not self.split:
            return self
        return ReasoningPlan(self.thinking, self.split, prompt.rstrip().endswith(self.tags[0]), self.tags)


def reasons(spec: ModelSpec, traits: Traits) -> bool:
    """Whether this model, with the template it is served with, thinks before it answers."""
    if spec.reasoning == "off" or spec.reasoning_format == "none":
        return False
    return spec.reasoning == "on" or spec.reasoning_format in REASONING_FORMATS or traits.reasons


def format_name(spec: ModelSpec, traits: Traits, fmt: Format) -> str:
    """The reasoning format a model is served with (`/v1/models`): `none`, models.yaml's, or its
    family's: `think`, `mistral`, or the family's own channel (`harmony`, `command-r7b`)."""
    if fmt.name in CHANNELS:  # read by the family's own parser, whatever models.yaml says
        return fmt.name
    if not reasons(spec, traits):
        return "none"
    if spec.reasoning_format in REASONING_FORMATS:
        return spec.reasoning_format
    return {tags: name for name, tags in REASONING_FORMATS.items()}.get(fmt.think, fmt.name)


def plan(spec: ModelSpec, traits: Traits, thinking: bool | None, constrained: bool) -> ReasoningPlan | None:
    """The plan for a request that asks for `thinking` (None: the model's default). A constrained
    answer (a JSON format or a tool-call grammar from its first token) leaves no room to think,
    so it is rendered with thinking off. None: the model does not reason."""
    if not reasons(spec, traits):
        return None
    if constrained or thinking is False:
        return ReasoningPlan(False, False, False)
    tags = REASONING_FORMATS.get(spec.reasoning_format)
    if tags is not None and (tags != traits.tags or not traits.reasons):
        return ReasoningPlan(thinking, True, False, tags)
    return ReasoningPlan(thinking, True, traits.opens)
