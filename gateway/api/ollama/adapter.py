"""Ollama's own decisions: errors as `{"error": "..."}`, its field names (sampling lives in
`options`), NDJSON streams, and request bodies read as JSON whatever their Content-Type says."""

from __future__ import annotations

from typing import Any

from gateway.api.adapter import Adapter
from gateway.api.errors import APIError

PATHS = frozenset({"/api/chat", "/api/generate", "/api/embed", "/api/embeddings", "/api/tags", "/api/show",
                   "/api/ps", "/api/version", "/api/pull", "/api/delete", "/api/create", "/api/copy"})


def owns(path: str) -> bool:
    return path in PATHS or path.startswith("/api/blobs/")


def _envelope(err: APIError) -> tuple[int, dict[str, Any]]:
    return err.status, {"error": err.message}


_NAMES = {"response_format": "format", "response_format.json_schema": "format", "max_tokens": "options.num_predict",
          "presence_penalty": "options.presence_penalty", "frequency_penalty": "options.frequency_penalty",
          "min_p": "options.min_p", "logit_bias": "options.logit_bias"}

OLLAMA = Adapter("ollama", "ndjson", owns=owns, envelope=_envelope, field_names=_NAMES,
                 path_field_names={"/api/generate": {**_NAMES, "messages": "prompt"}}, json_any_content_type=True)
