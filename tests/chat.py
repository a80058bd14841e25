"""Chat requests for engine tests, rendered as the gateway renders them (gateway/chat/template.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engines.base import Engine, GenerationRequest, SamplingParams
from gateway.chat.template import ChatMessage, compiled


def chat_prompt(engine: Engine, messages: Sequence[ChatMessage], tools: list[dict[str, Any]] | None = None,
                thinking: bool | None = None) -> str:
    assert engine.info.template is not None, "the model has no chat template"
    return compiled(engine.info.template).render(messages, tools, thinking)


def chat_request(engine: Engine, messages: Sequence[ChatMessage], sampling: SamplingParams | None = None,
                 request_id: str = "t", tools: list[dict[str, Any]] | None = None,
                 thinking: bool | None = None) -> GenerationRequest:
    return GenerationRequest(request_id, sampling or SamplingParams(), prompt=chat_prompt(engine, messages, tools, thinking),
                             templated=True)
