"""Reasoning output: which requests get it, and the splitter that takes it out of the answer.

A model that thinks writes `<think>...</think>` and then its answer; its template may already have
opened the block in the prompt (gateway/chat/template.py reads that once per template). Each protocol returns
the reasoning in its own form (OpenAI chat `reasoning_content`, Responses `reasoning` items,
Anthropic `thinking` blocks, Ollama `thinking`), from the neutral `ReasoningDelta` events.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gateway.chat.template import Traits
from gateway.chat.thinking import THINK_CLOSE, THINK_OPEN
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


Kind = Literal["reasoning", "text"]


class Splitter:
    """Splits streamed output text into reasoning and answer.

    The block opens at the start of the output (leading whitespace aside) or in the prompt
    (`opened`); everything up to the closing tag is reasoning, and the whitespace that follows it
    is dropped. A tag cut across two chunks is held back until it is whole or proves not to be
    one. A block never closed (max_tokens) is reasoning to the end, as vLLM and llama-server do."""

    def __init__(self, opened: bool) -> None:
        self._state: Literal["start", "reasoning", "after", "text"] = "reasoning" if opened else "start"
        self._held = ""
        self._lead = opened  # strip the whitespace at the start of the reasoning
        self.touched = False  # the last feed was (partly) inside the block: its tokens are reasoning

    def feed(self, text: str) -> list[tuple[Kind, str]]:
        out: list[tuple[Kind, str]] = []
        s = self._held + text
        self._held = ""
        self.touched = self._state == "reasoning" or (self._state == "start" and bool(s.strip())
                                                       and THINK_OPEN.startswith(s.strip()[:len(THINK_OPEN)]))
        while s:
            if self._state == "start":
                body = s.lstrip()
                if not body:
                    self._held = s
                    return out
                if body.startswith(THINK_OPEN):
                    s, self._state, self._lead = body[len(THINK_OPEN):], "reasoning", True
                elif THINK_OPEN.startswith(body):
                    self._held = s
                    return out
                else:
                    self._state = "text"
            elif self._state == "reasoning":
                if self._lead:
                    s = s.lstrip()
                    if not s:
                        return out
                    self._lead = False
                end = s.find(THINK_CLOSE)
                if end >= 0:
                    if end:
                        out.append(("reasoning", s[:end]))
                    s, self._state = s[end + len(THINK_CLOSE):], "after"
                    continue
                keep = _partial_tail(s, THINK_CLOSE)
                if len(s) > keep:
                    out.append(("reasoning", s[:len(s) - keep]))
                self._held = s[len(s) - keep:]
                return out
            elif self._state == "after":
                s = s.lstrip()
                if s:
                    self._state = "text"
            else:
                out.append(("text", s))
                return out
        return out

    def flush(self) -> list[tuple[Kind, str]]:
        """What is held back, at the end of the output."""
        held, self._held = self._held, ""
        if not held or self._state == "after":
            return []
        if self._state == "reasoning":
            return [("reasoning", held)] if held.strip() or not self._lead else []
        return [("text", held)]


def _partial_tail(s: str, tag: str) -> int:
    """The length of the longest end of `s` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(s)), 0, -1):
        if s.endswith(tag[:n]):
            return n
    return 0
