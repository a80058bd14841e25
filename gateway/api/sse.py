"""Streaming to clients: SSE framing, error frames, `[DONE]`, and stopping work when they leave."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TypeVar

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.api.errors import ClientDisconnected, to_api_error

log = logging.getLogger(__name__)

T = TypeVar("T")

# How often a waiting request checks whether its client is still there.
DISCONNECT_POLL_S = 0.2


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except BaseException:  # noqa: BLE001 - the task's own cancellation
                pass


async def _frames(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        yield first
        async for data in rest:
            yield data
    except asyncio.CancelledError:
        raise  # the client disconnected: `rest` is closed below, which aborts generation
    except Exception as exc:  # noqa: BLE001 - after the first byte, errors travel in-band
        err = to_api_error(exc)
        log.warning("stream failed after start: %s", err.message)
        yield json.dumps(err.body())
    finally:
        aclose = getattr(rest, "aclose", None)
        if aclose is not None:
            await aclose()
    yield "[DONE]"


def sse_response(first: str, rest: AsyncIterator[str], headers: Mapping[str, str] | None = None) -> EventSourceResponse:
    """An SSE response whose first frame (already produced) goes out with the headers."""
    return EventSourceResponse(
        _frames(first, rest),
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        sep="\n",
        ping=15,
    )


async def _events(first: tuple[str, dict[str, object]], rest: AsyncIterator[tuple[str, dict[str, object]]]
                  ) -> AsyncIterator[ServerSentEvent]:
    try:
        yield ServerSentEvent(data=json.dumps(first[1], ensure_ascii=False), event=first[0])
        async for kind, data in rest:
            yield ServerSentEvent(data=json.dumps(data, ensure_ascii=False), event=kind)
    finally:
        aclose = getattr(rest, "aclose", None)
        if aclose is not None:
            await aclose()


async def answer_events(request: Request, events: AsyncIterator[tuple[str, dict[str, object]]], stream: bool,
                        headers: Mapping[str, str], release: Callable[[], None],
                        whole: Callable[[dict[str, object]], object]) -> Response:
    """A named-event answer (Responses, Anthropic): drained into one JSON body (`whole` of the last
    event's data), or streamed once its first event is ready, so errors before it get a status.
    `release` gives the request's slots back if it ends before the stream takes over."""
    try:
        if not stream:
            last: dict[str, object] = {}

            async def drain() -> None:
                async for _kind, data in events:
                    last.clear()
                    last.update(data)

            await until_disconnect(request, drain())
            return JSONResponse(whole(last), headers=dict(headers))
        first = await until_disconnect(request, anext(events))
    except BaseException:
        release()
        raise
    return event_stream_response(first, events, headers)


def event_stream_response(first: tuple[str, dict[str, object]], rest: AsyncIterator[tuple[str, dict[str, object]]],
                          headers: Mapping[str, str] | None = None) -> EventSourceResponse:
    """Named SSE events (`event: <type>` then `data: <json>`), as the Responses API streams them: no
    `[DONE]`; the stream's own last event (completed, incomplete or failed) ends it."""
    return EventSourceResponse(
        _events(first, rest),
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        sep="\n",
        ping=15,
    )
