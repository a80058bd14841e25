"""Reasoning ("thinking") in chat templates: what a template does with it, and prompts with it off.

Models that think write `<think>...</think>` before their answer (DeepSeek-R1, Qwen3, QwQ, SmolLM3,
Phi-4-reasoning). Their templates differ: some open the block in the generation prompt, so the
model starts inside it; some read `enable_thinking` (Qwen3's convention, also vLLM's and
llama-server's `chat_template_kwargs`), and with it false write an empty block so the model
answers at once. An engine reads this once at load by rendering a one-message conversation
(`template_traits`); the gateway separates the reasoning from the answer (gateway/api/reasoning.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

Render = Callable[[dict[str, Any]], str]  # the template's prompt text, given extra template variables
# The template's prompt text for these turns (with the generation prompt), given extra variables.
RenderTurns = Callable[[list[dict[str, Any]], dict[str, Any]], str]


def template_traits(render: RenderTurns, source: str) -> dict[str, str]:
    """EngineInfo.extra entries for a template: "reasoning": "think" when it knows the tags,
    "thinking_toggle": "1" when it reads `enable_thinking`, "reasoning_open": "1" when its
    generation prompt opens the block (read from a one-message conversation)."""
    if THINK_CLOSE not in source:
        return {}
    out = {"reasoning": "think"}
    if "enable_thinking" in source:
        out["thinking_toggle"] = "1"
    try:
        if render([{"role": "user", "content": "Hi"}], {}).rstrip().endswith(THINK_OPEN):
            out["reasoning_open"] = "1"
    except Exception:  # noqa: BLE001 - a template that cannot render a plain turn: nothing to learn
        pass
    return out


def render_thinking(render: Render, thinking: bool | None) -> str:
    """The prompt with thinking as asked: None, the template's default; True or False, passed as
    `enable_thinking`. With False, a template that did not close the block itself gets an empty
    one appended, so the model answers at once whatever its template does."""
    if thinking is None:
        return render({})
    prompt = render({"enable_thinking": thinking})
    if thinking:
        return prompt
    tail = prompt.rstrip()
    if tail.endswith(THINK_CLOSE):
        return prompt
    if tail.endswith(THINK_OPEN):
        return prompt + ("" if prompt.endswith("\n") else "\n") + THINK_CLOSE + "\n\n"
    return prompt + THINK_OPEN + "\n\n" + THINK_CLOSE + "\n\n"
