"""Stopping work when the client leaves (the framing of streams is in `gateway.api.adapter`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

from gateway.api.errors import ClientDisconnected

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
