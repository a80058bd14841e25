"""Anthropic's own decisions: its error envelope and types (an overloaded server is its 529), its
field names, and named SSE events."""

from __future__ import annotations

from typing import Any

from gateway.api.adapter import Adapter
from gateway.api.errors import APIError

# Anthropic's error types by status; it answers "overloaded" with its own 529.
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}


def envelope(err: APIError) -> tuple[int, dict[str, Any]]:
    status = 529 if err.status == 503 else err.status
    kind = _TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
    message = f"{err.param}: {err.message}" if err.param and err.param not in err.message else err.message
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def owns(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


ANTHROPIC = Adapter("anthropic", "events", owns=owns, envelope=envelope, field_names={
    "response_format": "output_config.format", "response_format.json_schema": "output_config.format.schema",
    "prompt": "messages"})
