"""A poison request for worker tests (`--plugin tests.poison_standin`, GATEWAY_WORKER_PLUGINS): the
real llama.cpp engine of a worker crashes with a real SIGSEGV whenever it starts a request whose
text holds POISON (as a prompt that takes a broken kernel would), and serves every other request."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator

from engines.base import GenerationRequest, TokenEvent
from engines.llamacpp.engine import LlamaCppEngine

POISON = "POISON"
_generate = LlamaCppEngine.generate


async def generate(self: LlamaCppEngine, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
    text = request.prompt or ""
    if POISON in text:
        os.kill(os.getpid(), signal.SIGSEGV)
    async for ev in _generate(self, request):
        yield ev


LlamaCppEngine.generate = generate  # type: ignore[method-assign]
