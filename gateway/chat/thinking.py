"""Reasoning ("thinking") in chat templates: what a template does with it, and prompts with it off.

Models that think write `<think>...</think>` before their answer (DeepSeek-R1, Qwen3, QwQ, SmolLM3,
Phi-4-reasoning). Their templates differ: some open the block in the generation prompt, so the
model starts inside it; some read `enable_thinking` (Qwen3's convention, also vLLM's and
llama-server's `chat_template_kwargs`), and with it false write an empty block so the model
answers at once. The template's traits are read once (gateway/chat/template.py `Traits`); the
reasoning is separated from the answer in gateway/api/reasoning.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

Render = Callable[[dict[str, Any]], str]  # the template's prompt text, given extra template variables


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
