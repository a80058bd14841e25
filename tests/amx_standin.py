"""A stand-in for ggml's AMX crash, on any CPU (`--plugin tests.amx_standin`, GATEWAY_WORKER_PLUGINS).

The real fault (llama.cpp issue 20824) kills the process with SIGSEGV in the AMX matrix kernel on
the first prompt batch longer than a few tokens, while a one-token "Hello" runs fine. This plugin
makes the real llama.cpp engine of a worker do the same — a real SIGSEGV of the worker process —
when every condition of $AMX_STANDIN (comma-separated) holds for a request:

- `tokens>N`   the prompt is longer than N tokens (default 64);
- `repack`     the weights were repacked (the engine runs with repack on);
- `variant=X`  the loaded CPU variant is X; `variant=top`: the one auto picks on this CPU;
- `backend=X`  the engine's backend is X (cpu, vulkan);
- `serving`    the request is not one of the functional check's (it crashes only after the check).
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator

from engines.base import GenerationRequest, TokenEvent
from engines.llamacpp.engine import LlamaCppEngine

_generate = LlamaCppEngine.generate


def _conditions() -> list[str]:
    return [c.strip() for c in os.environ.get("AMX_STANDIN", "").split(",") if c.strip()]


async def _crashes(engine: LlamaCppEngine, request: GenerationRequest) -> bool:
    conds = _conditions()
    if not conds:
        return False
    limit = next((int(c.split(">", 1)[1]) for c in conds if c.startswith("tokens>")), 64)
    text = request.prompt or ""
    if len(await engine.tokenize(text)) <= limit:
        return False
    extra = engine.info.extra
    for c in conds:
        if c == "repack" and not engine.llama_options.repack:
            return False
        if c.startswith("variant="):
            want = c.split("=", 1)[1]
            if want == "top":
                from engines.llamacpp.ggml_backends import choose, variants

                want = choose(variants()).name
            if extra.get("cpu_variant") != want:
                return False
        if c.startswith("backend=") and engine.options.backend != c.split("=", 1)[1]:
            return False
        if c == "serving" and request.request_id.startswith(("check-", "functional-check", "speed-check")):
            return False
    return True


async def generate(self: LlamaCppEngine, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
    if await _crashes(self, request):
        os.kill(os.getpid(), signal.SIGSEGV)
    async for ev in _generate(self, request):
        yield ev


LlamaCppEngine.generate = generate  # type: ignore[method-assign]
