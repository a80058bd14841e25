"""What one protocol decides on its own, and the one response driver every protocol shares.

A protocol is an `Adapter`: the paths it owns, how it envelopes an error and names the request's
fields in it, and how it frames a streamed answer (SSE `data:` frames ending with `[DONE]`, named
SSE events, or NDJSON lines). Its routes parse a request into the neutral `Conversation`, let the
neutral service serve it, and encode the neutral events back; `respond` turns that encoding into an
HTTP response the same way for all of them: an error before the first frame is a status in the
protocol's envelope, one after it travels in-band, the request's slots are given back whatever
happens, and the work stops when the client leaves.

A new protocol is one module: an `Adapter`, a router, and `Protocols.add` at start-up.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from gateway.api.errors import APIError, to_api_error
from gateway.api.sse import until_disconnect

log = logging.getLogger(__name__)

Framing = Literal["sse", "events", "ndjson"]
# One frame of a stream, by framing: "sse" a JSON text (or any str), "events" (event name, data),
# "ndjson" a JSON-able object.
Frame = Any


@dataclass(frozen=True)
class Adapter:
    """One protocol's own decisions (see the module's doc)."""

    name: str
    framing: Framing
    owns: Callable[[str], bool]
    # (status, body) of an error whose fields are already named as this protocol names them.
    envelope: Callable[[APIError], tuple[int, dict[str, Any]]]
    # Neutral field names (OpenAI chat's) as this protocol calls them, and per-path exceptions.
    field_names: Mapping[str, str] = field(default_factory=dict)
    path_field_names: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # Read the request body as JSON whatever its Content-Type says (Ollama's server does).
    json_any_content_type: bool = False

    def answer(self, err: APIError, path: str = "") -> tuple[int, dict[str, Any]]:
        """The (status, body) a client of this protocol gets for `err`."""
        return self.envelope(err.named(self.path_field_names.get(path, self.field_names)))

    def in_band(self, err: APIError, path: str = "") -> Frame:
        """`err` as a frame of a stream that has already started."""
        body = self.answer(err, path)[1]
        if self.framing == "events":
            return "error", body
        return json.dumps(body) if self.framing == "sse" else body


class Protocols:
    """The protocols an app speaks: which one a path belongs to (the first that owns it; the
    default otherwise)."""

    def __init__(self, default: Adapter, *others: Adapter) -> None:
        self.default = default
        self.adapters = list(others)

    def add(self, adapter: Adapter) -> None:
        self.adapters.append(adapter)

    def for_path(self, path: str) -> Adapter:
        return next((a for a in self.adapters if a.owns(path)), self.default)

    def answer(self, err: APIError, path: str) -> tuple[int, dict[str, Any]]:
        return self.for_path(path).answer(err, path)


_STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def respond(request: Request, adapter: Adapter, *, stream: bool, frames: Callable[[], AsyncIterator[Frame]],
                  whole: Callable[[], Awaitable[Any]], headers: Mapping[str, str] | Callable[[], Mapping[str, str]],
                  release: Callable[[], None], finish: Callable[[], None] | None = None) -> Response:
    """The answer: `whole()` as one JSON body, or `frames()` streamed in the adapter's framing once
    the first frame is ready (so that errors found before it, such as a prompt over the context or a
    full queue, still get a status). `release` gives the request's slots back if it ends before the
    stream takes over; `finish` runs once the answer is complete (or the stream ended). `headers`
    may be a function: it is read once the body (or the first frame) is ready, so that what the
    work found out (a failover, say) is in them."""
    try:
        if not stream:
            body = await until_disconnect(request, whole())
            if finish is not None:
                finish()
            if isinstance(body, BaseModel):
                return Response(body.model_dump_json(), media_type="application/json", headers=_read(headers))
            return JSONResponse(body, headers=_read(headers))
        rest = frames()
        first = await until_disconnect(request, anext(rest))
    except BaseException:
        release()
        raise
    body_iter = _framed(adapter, request.url.path, first, rest, finish)
    if adapter.framing == "ndjson":
        return _NdjsonStream(rest, body_iter, media_type="application/x-ndjson", headers=_read(headers))
    return _EventStream(rest, body_iter, headers={**_STREAM_HEADERS, **_read(headers)}, sep="\n", ping=15)


async def _close(rest: AsyncIterator[Frame]) -> None:
    """The work behind a stream, ended: a response that failed before its body ran (its start
    refused by the server, say) gives the request's slots back here, not when the collector gets to
    it. Closing work that already ended does nothing."""
    aclose = getattr(rest, "aclose", None)
    if aclose is not None:
        await aclose()


class _ClosesWork:
    """A streamed response that ends the work behind it (`rest`) when it ends, however it ends."""

    def __init__(self, rest: AsyncIterator[Frame], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rest = rest

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)  # type: ignore[misc]
        finally:
            await _close(self._rest)


class _NdjsonStream(_ClosesWork, StreamingResponse):
    pass


class _EventStream(_ClosesWork, EventSourceResponse):
    pass


def _read(headers: Mapping[str, str] | Callable[[], Mapping[str, str]]) -> dict[str, str]:
    return dict(headers() if callable(headers) else headers)


async def drain(frames: AsyncIterator[Frame]) -> Frame | None:
    """Run `frames` to its end; the last frame."""
    last = None
    async for frame in frames:
        last = frame
    return last


async def _framed(adapter: Adapter, path: str, first: Frame, rest: AsyncIterator[Frame],
                  finish: Callable[[], None] | None) -> AsyncIterator[Any]:
    encode = _ENCODERS[adapter.framing]
    try:
        yield encode(first)
        async for frame in rest:
            yield encode(frame)
    except Exception as exc:  # noqa: BLE001 - after the first byte, errors travel in-band
        err = to_api_error(exc)
        log.warning("stream failed after start: %s", err.message)
        yield encode(adapter.in_band(err, path))
    finally:  # a client that left cancels this generator: closing `rest` aborts the generation
        await _close(rest)
        if finish is not None:
            finish()
    if adapter.framing == "sse":
        yield "[DONE]"


def _event(frame: tuple[str, Any]) -> ServerSentEvent:
    return ServerSentEvent(data=json.dumps(frame[1], ensure_ascii=False), event=frame[0])


def _line(frame: Any) -> bytes:
    return (json.dumps(frame) + "\n").encode()


_ENCODERS: dict[Framing, Callable[[Any], Any]] = {"sse": lambda frame: frame, "events": _event, "ndjson": _line}
