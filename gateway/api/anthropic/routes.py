"""Anthropic's routes: `POST /v1/messages` (whole or streamed) and `POST /v1/messages/count_tokens`.
Errors on these paths use Anthropic's envelope (gateway.api.errors)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from gateway.api.adapter import drain, respond
from gateway.api.anthropic import messages as am
from gateway.api.anthropic.adapter import ANTHROPIC
from gateway.api.notes import Notes
from gateway.api.serving import Service
from gateway.api.sse import until_disconnect

router = APIRouter(tags=["anthropic"])


class AnthropicErrorBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str
    message: str


class AnthropicError(BaseModel):
    """Anthropic's error envelope."""

    type: str = "error"
    error: AnthropicErrorBody


_WHAT = {400: "Invalid request (`invalid_request_error`)", 401: "Missing or wrong API key (`authentication_error`)",
         403: "Origin or Host not allowed (`permission_error`)", 404: "Unknown model (`not_found_error`)",
         413: "Request body over `--max-body` (`request_too_large`)",
         429: "The model's queue is full (`rate_limit_error`, `retry-after`)",
         500: "The engine failed, or an unexpected error (`api_error`)",
         502: "The engine's worker crashed while serving the request (`api_error`)",
         529: "Loading, draining or overloaded (`overloaded_error`, `retry-after`)"}
_ERRORS: dict[int | str, dict[str, Any]] = {s: {"model": AnthropicError, "description": w} for s, w in _WHAT.items()}

_STREAM = {"schema": {
    "type": "object",
    "description": "Server-sent events, when the request sets `stream: true`: `event: <type>` and `data: <JSON>`: "
                   "message_start, ping, then per content block content_block_start, content_block_delta "
                   "(text_delta or input_json_delta), content_block_stop; then message_delta (stop reason, usage) "
                   "and message_stop; a failure after the start is an `error` event.",
    "required": ["data"],
    "properties": {"event": {"type": "string"},
                   "data": {"type": "string", "contentMediaType": "application/json",
                            "contentSchema": {"$ref": "#/components/schemas/MessageStreamEvent"}}},
}}


@router.post("/v1/messages", response_model=None, responses={
    200: {"model": am.MessageObject, "description": "The message (JSON), or its events (SSE) with `stream`",
          "content": {"text/event-stream": _STREAM}},
    **{s: _ERRORS[s] for s in (400, 401, 403, 404, 413, 429, 500, 502, 529)}})
async def create_message(body: am.MessagesRequest, request: Request) -> Response:
    received = time.perf_counter()
    service: Service = request.app.state.chat
    notes = Notes()
    spec, conv = service.spec(body.model), am.conversation(body, notes)
    p = await until_disconnect(request, service.prepare_conversation(spec, conv, 1, "msg", received))
    request.state.observer = p.observer
    notes.skipped_tools.update(p.skipped_tools)
    am.note_thinking(conv, p.reasoning is not None, p.format.levels, notes)
    asm = am.Assembler(am.message_id(), body.model)

    async def whole() -> dict[str, Any]:
        await drain(am.generate(service, p, asm, in_band=False))
        return asm.message()

    return await respond(request, ANTHROPIC, stream=body.stream, frames=lambda: am.generate(service, p, asm, in_band=True),
                         whole=whole, headers=lambda: {**p.headers, **notes.headers()}, release=p.release)


@router.post("/v1/messages/count_tokens", response_model=am.TokenCount,
             responses={s: _ERRORS[s] for s in (400, 401, 403, 404, 413, 429, 500, 502, 529)})
async def count_tokens(body: am.CountTokensRequest, request: Request) -> JSONResponse:
    """The prompt's tokens as this model's engine renders it (its chat template and the tool
    prompt), counted by a one-token generation: the prefix it leaves in the KV cache speeds up the
    request that usually follows."""
    received = time.perf_counter()
    service: Service = request.app.state.chat
    notes = Notes()
    spec, conv = service.spec(body.model), am.conversation(body, notes)
    p = await until_disconnect(request, service.prepare_conversation(spec, conv, 1, "count", received))
    request.state.observer = p.observer
    am.note_thinking(conv, p.reasoning is not None, p.format.levels, notes)
    collected = await until_disconnect(request, service.collect(p))
    usage = collected.usages[0] if collected.usages else None
    return JSONResponse({"input_tokens": usage.prompt_tokens if usage else 0},
                        headers={**p.headers, **notes.headers()})
