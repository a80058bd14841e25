"""Reasoning ("thinking") in chat templates: what a template does with it, and prompts with it off.

Models that think write `<think>...</think>` before their answer (DeepSeek-R1, Qwen3, QwQ, SmolLM3,
Phi-4-reasoning); Magistral and Ministral 3 write `[THINK]...[/THINK]` (special tokens of their
tokenizer). Their templates differ: some open the block in the generation prompt, so the
model starts inside it; some read `enable_thinking` (Qwen3's convention, also vLLM's and
llama-server's `chat_template_kwargs`), and with it false write an empty block so the model
answers at once. The template's traits are read once (gateway/chat/template.py `Traits`); the
reasoning is separated from the answer in gateway/api/reasoning.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
BRACKET_THINK = ("[THINK]", "[/THINK]")  # Magistral, Ministral 3
# The reasoning tags a template may know, in the order they are looked for.
THINK_TAGS: tuple[tuple[str, str], ...] = ((THINK_OPEN, THINK_CLOSE), BRACKET_THINK)
# models.yaml `reasoning_format`: the tags a model reasons in, where its template does not say
# (or says otherwise).
REASONING_FORMATS: dict[str, tuple[str, str]] = {"think": (THINK_OPEN, THINK_CLOSE), "mistral": BRACKET_THINK}

Render = Callable[[dict[str, Any]], str]  # the template's prompt text, given extra template variables


def render_thinking(render: Render, thinking: bool | None,
                    tags: tuple[str, str] = (THINK_OPEN, THINK_CLOSE)) -> str:
    """The prompt with thinking as asked: None, the template's default; True or False, passed as
    `enable_thinking`. With False, a template that did not close the block itself gets an empty
    one appended (in the template's `tags`), so the model answers at once whatever its template
    does. A family with a switch of its own (Granite 3.3's `thinking`) renders through its
    format instead (gateway/chat/formats/)."""
    if thinking is None:
        return render({})
    prompt = render({"enable_thinking": thinking})
    if thinking:
        return prompt
    open_tag, close_tag = tags
    tail = prompt.rstrip()
    if tail.endswith(close_tag):
        return prompt
    if open_tag != THINK_OPEN:  # special-token tags are written back to back, without newlines
        return prompt + ("" if tail.endswith(open_tag) else open_tag) + close_tag
    if tail.endswith(open_tag):
        return prompt + ("" if prompt.endswith("\n") else "\n") + close_tag + "\n\n"
    return prompt + open_tag + "\n\n" + close_tag + "\n\n"


Kind = Literal["reasoning", "text"]


class Splitter:
    """Splits streamed output text into reasoning and answer.

    The block opens at the start of the output (leading whitespace aside) or in the prompt
    (`opened`); everything up to the closing tag is reasoning, and the whitespace that follows it
    is dropped. A tag cut across two chunks is held back until it is whole or proves not to be
    one. A block never closed (max_tokens) is reasoning to the end, as vLLM and llama-server do."""

    def __init__(self, opened: bool, tags: tuple[str, str] = (THINK_OPEN, THINK_CLOSE)) -> None:
        self.open, self.close = tags
        self._state: Literal["start", "reasoning", "after", "text"] = "reasoning" if opened else "start"
        self._held = ""
        self._lead = opened  # strip the whitespace at the start of the reasoning
        self.touched = False  # the last feed was (partly) inside the block: its tokens are reasoning

    def feed(self, text: str) -> list[tuple[Kind, str]]:
        out: list[tuple[Kind, str]] = []
        s = self._held + text
        self._held = ""
        self.touched = self._state == "reasoning" or (self._state == "start" and bool(s.strip())
                                                       and self.open.startswith(s.strip()[:len(self.open)]))
        while s:
            if self._state == "start":
                body = s.lstrip()
                if not body:
                    self._held = s
                    return out
                if body.startswith(self.open):
                    s, self._state, self._lead = body[len(self.open):], "reasoning", True
                elif self.open.startswith(body):
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
                end = s.find(self.close)
                if end >= 0:
                    if end:
                        out.append(("reasoning", s[:end]))
                    s, self._state = s[end + len(self.close):], "after"
                    continue
                keep = _partial_tail(s, self.close)
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
