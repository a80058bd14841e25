"""The Responses API's routes: create (whole or streamed), and the stored responses."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gateway.api.adapter import drain, respond
from gateway.api.errors import APIError
from gateway.api.notes import Notes
from gateway.api.openai import responses as rs
from gateway.api.openai.adapters import RESPONSES
from gateway.api.openai.responses_schema import (
    DeletedResponse,
    InputItemList,
    ResponseCreateRequest,
    ResponseObject,
)
from gateway.api.routes import error_responses
from gateway.api.serving import Service
from gateway.api.sse import until_disconnect
from gateway.conversation import Turn
from gateway.store import ResponseStore

router = APIRouter()


def _store(request: Request) -> ResponseStore | None:
    store: ResponseStore | None = request.app.state.responses_store
    return store


_STREAM = {"schema": {
    "type": "object",
    "description": "Server-sent events, when the request sets `stream: true`: `event: <type>` and `data: <JSON>` "
                   "per event, numbered by `sequence_number` from 0; the last is response.completed, "
                   "response.incomplete or (a failure after the start) response.failed. No `[DONE]`.",
    "required": ["data"],
    "properties": {"event": {"type": "string"},
                   "data": {"type": "string", "contentMediaType": "application/json",
                            "contentSchema": {"$ref": "#/components/schemas/ResponseStreamEvent"}}},
}}


@router.post("/v1/responses", response_model=None, responses={
    200: {"model": ResponseObject, "description": "The response object (JSON), or its events (SSE) with `stream`",
          "content": {"text/event-stream": _STREAM}},
    **error_responses(400, 401, 403, 404, 413, 429, 500, 502, 503)})
async def create_response(body: ResponseCreateRequest, request: Request) -> Response:
    received = time.perf_counter()
    service: Service = request.app.state.chat
    store = _store(request)
    notes = Notes()
    earlier: tuple[Turn, ...] = ()
    if body.previous_response_id:
        found = await asyncio.to_thread(store.turns, body.previous_response_id) if store is not None else None
        if found is None:
            raise APIError(400, f"Previous response with id '{body.previous_response_id}' not found.",
                           param="previous_response_id", code="previous_response_not_found")
        earlier = found
    spec = service.spec(body.model)
    conv, history, listed = rs.conversation(body, earlier, notes)
    p = await until_disconnect(request, service.prepare_conversation(spec, conv, 1, "resp", received))
    request.state.observer = p.observer
    keep = store is not None and body.store is not False
    run = rs.Run(body, p, conv, history, listed, notes, store=keep, in_band=body.stream)
    if keep:
        assert store is not None

        async def save(final: dict[str, Any], output: Turn) -> None:
            await asyncio.to_thread(store.put, run.rid, final, listed, (*history, output))

        run.on_final = save
    notes.skipped_tools.update(p.skipped_tools)
    if body.reasoning and p.reasoning is None:  # the model does not think: nothing to set
        notes.ignored.discard("reasoning.summary")
        notes.ignored.add("reasoning")

    async def whole() -> Any:
        last = await drain(rs.generate(service, run))
        assert last is not None  # the generator always ends with the response's final event
        return last[1]["response"]

    return await respond(request, RESPONSES, stream=body.stream, frames=lambda: rs.generate(service, run),
                         whole=whole, headers=lambda: {**p.headers, **notes.headers()}, release=p.release)


@router.get("/v1/responses/{response_id}", response_model=ResponseObject,
            responses=error_responses(401, 403, 404))
async def get_response(response_id: str, request: Request) -> JSONResponse:
    store = _store(request)
    found = await asyncio.to_thread(store.response, response_id) if store is not None else None
    if found is None:
        raise rs.not_found(response_id)
    return JSONResponse(found)


@router.delete("/v1/responses/{response_id}", response_model=DeletedResponse,
               responses=error_responses(401, 403, 404))
async def delete_response(response_id: str, request: Request) -> JSONResponse:
    store = _store(request)
    if store is None or not await asyncio.to_thread(store.delete, response_id):
        raise rs.not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.get("/v1/responses/{response_id}/input_items", response_model=InputItemList,
            responses=error_responses(400, 401, 403, 404))
async def list_input_items(response_id: str, request: Request, limit: int = 20, order: str = "desc",
                           after: str | None = None) -> JSONResponse:
    if not 1 <= limit <= 100:
        raise APIError(400, "limit must be between 1 and 100", param="limit")
    if order not in ("asc", "desc"):
        raise APIError(400, "order must be asc or desc", param="order")
    store = _store(request)
    items = await asyncio.to_thread(store.input_items, response_id) if store is not None else None
    if items is None:
        raise rs.not_found(response_id)
    if order == "desc":
        items = items[::-1]
    if after is not None:
        ids = [i.get("id") for i in items]
        if after not in ids:
            raise APIError(400, f"no input item {after!r} in this response", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})
