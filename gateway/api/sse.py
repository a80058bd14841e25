"""Stopping work when the client leaves (the framing of streams is in `gateway.api.adapter`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Protocol, TypeVar, runtime_checkable

from starlette.requests import Request

from gateway.api.errors import ClientDisconnected

log = logging.getLogger(__name__)

T = TypeVar("T")

# How often a waiting request checks whether its client is still there.
DISCONNECT_POLL_S = 0.2


@runtime_checkable
class Releasable(Protocol):
    """A result that holds something until it is used (a prepared request's slots)."""

    def release(self) -> None: ...


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first. Work that finished while the
    disconnect was being noticed is given back: a result holding slots (`Releasable`) releases
    them, or they would stay taken with no one to use them."""
    task = asyncio.ensure_future(work)
    returned = False
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                returned = True
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
        elif not returned and not task.cancelled() and task.exception() is None:
            result = task.result()
            if isinstance(result, Releasable):
                result.release()
