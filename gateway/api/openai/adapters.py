"""The OpenAI protocols' own decisions: its error envelope (`{"error": {message, type, param,
code}}`), SSE `data:` frames ending with `[DONE]` for chat and completions, and named events for
the Responses API, whose request fields have names of their own."""

from __future__ import annotations

from typing import Any

from gateway.api.adapter import Adapter
from gateway.api.errors import APIError


def _envelope(err: APIError) -> tuple[int, dict[str, Any]]:
    return err.status, err.body()


def _is_responses(path: str) -> bool:
    return path == "/v1/responses" or path.startswith("/v1/responses/")


# Chat and text completions, embeddings, models: the neutral names are chat's own.
OPENAI = Adapter("openai", "sse", owns=lambda path: path.startswith("/v1/"), envelope=_envelope)

RESPONSES = Adapter("responses", "events", owns=_is_responses, envelope=_envelope, field_names={
    "messages": "input", "response_format": "text.format", "response_format.json_schema": "text.format.schema",
    "max_tokens": "max_output_tokens"})
