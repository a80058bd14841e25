"""A scripted engine for gateway-logic tests; it goes through the same registry interface."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import numpy.typing as npt

from engines.base import (
    EngineConfig,
    EngineFailure,
    EngineHealth,
    EngineInfo,
    EngineOverloaded,
    GenerationRequest,
    ModelLoadError,
    TemplateSource,
    TokenEvent,
    Usage,
)

# A plain ChatML template (SmolLM2's shape): the fake's model renders chat like a small real one.
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


class FakeEngine:
    """Emits the words of `script`, one per token; `load_delay` simulates a slow load."""

    instances: list[FakeEngine] = []

    def __init__(self, config: EngineConfig, script: str = "hello from the fake engine", load_delay: float = 0.0,
                 fail_load: bool = False, capacity: int = 1000, fail_after: int | None = None,
                 bug_after: int | None = None, token_delay: float = 0.001, extra: dict[str, str] | None = None,
                 answer_at_once: str | None = None, template: str | None = CHATML) -> None:
        self.config = config
        self.info = EngineInfo(runtime="fake", backend=config.backend, device=config.device, parallel=config.parallel,
                               template=TemplateSource(template) if template else None, extra=dict(extra or {}))
        self.script = script.split()
        # What a template that thinks answers when a request turns thinking off.
        self.answer_at_once = answer_at_once.split() if answer_at_once is not None else None
        self.requests: list[GenerationRequest] = []
        self.load_delay = load_delay
        self.fail_load = fail_load
        self.capacity = capacity
        self.fail_after = fail_after
        self.bug_after = bug_after  # raise a plain exception (a bug, not an EngineError) at this token
        self.token_delay = token_delay  # seconds per token
        self.loaded = False
        self.closed = False
        self.running = 0
        FakeEngine.instances.append(self)

    async def load(self) -> None:
        await asyncio.sleep(self.load_delay)
        if self.fail_load:
            raise ModelLoadError("fake load failure")
        self.loaded = True

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        if self.running >= self.capacity:
            raise EngineOverloaded("fake engine is full")
        self.running += 1
        self.requests.append(request)
        try:
            # A prompt that closed the reasoning block asks for the answer at once.
            at_once = (request.prompt or "").endswith("</think>\n\n") and self.answer_at_once is not None
            script = self.answer_at_once if at_once and self.answer_at_once is not None else self.script
            limit = request.sampling.max_tokens or len(script)
            words = script[:limit]
            for i, w in enumerate(words):
                await asyncio.sleep(self.token_delay)
                # The functional check's own requests pass: the failure is for served requests.
                if self.fail_after is not None and i == self.fail_after and not request.request_id.startswith("check-"):
                    raise EngineFailure("fake engine crashed mid-stream")
                if self.bug_after is not None and i == self.bug_after:
                    raise ZeroDivisionError("a bug in the engine")
                last = i == len(words) - 1
                yield TokenEvent(
                    text=(" " if i else "") + w,
                    token_ids=(i,),
                    finish_reason=("length" if limit < len(script) else "stop") if last else None,
                    usage=Usage(prompt_tokens=3, completion_tokens=len(words)) if last else None,
                )
        finally:
            self.running -= 1

    async def logits(self, token_ids: list[int]) -> npt.NDArray[np.float32]:
        return np.zeros((len(token_ids), 8), dtype=np.float32)

    async def embed(self, inputs: list[list[int]]) -> npt.NDArray[np.float32]:
        out = np.zeros((len(inputs), 8), dtype=np.float32)
        for i, ids in enumerate(inputs):
            out[i, len(ids) % 8] = 1.0
        return out

    async def tokenize(self, text: str) -> list[int]:
        return list(range(len(text.split())))

    def health(self) -> EngineHealth:
        return EngineHealth(ready=self.loaded and not self.closed, running=self.running)

    async def close(self) -> None:
        self.closed = True
