"""`/v1/embeddings`: OpenAI embedding requests <-> the engine's `embed`."""

from __future__ import annotations

import base64
import time

import numpy as np

from gateway.api.errors import invalid, record
from gateway.api.openai.protocol import Embedding, EmbeddingList, EmbeddingRequest, EmbeddingUsage
from gateway.api.serving import check_prompt_chars, model_spec
from gateway.metrics import Metrics
from gateway.models.pool import ModelManager


def _inputs(req: EmbeddingRequest) -> list[str] | list[list[int]]:
    """The request's inputs as texts or as token-id lists (OpenAI's four shapes)."""
    x = req.input
    if isinstance(x, str):
        return [x]
    if all(isinstance(v, int) for v in x):
        return [list(x)]  # type: ignore[return-value]
    return list(x)  # type: ignore[return-value]


def encode(vector: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":  # what the OpenAI SDK asks for by default: little-endian float32
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.astype(np.float32).tolist()  # type: ignore[no-any-return]


class EmbeddingService:
    def __init__(self, manager: ModelManager, metrics: Metrics) -> None:
        self.manager = manager
        self.metrics = metrics

    async def embed(self, req: EmbeddingRequest, received: float) -> EmbeddingList:
        spec = model_spec(self.manager.registry, req.model)
        raw = _inputs(req)
        for i, item in enumerate(raw):
            if (isinstance(item, str) and not item) or (isinstance(item, list) and not item):
                raise invalid(f"input[{i}] is empty", param="input")
        check_prompt_chars(sum(len(t) for t in raw if isinstance(t, str)), self.manager.settings.max_prompt_chars,
                           "input", "the input holds")
        loaded = await self.manager.get(spec)
        engine = loaded.engine
        c = loaded.candidate
        observer = self.metrics.observe(spec.id, f"{c.runtime}/{c.backend}", c.device, received)
        try:
            ids = [await engine.tokenize(t) if isinstance(t, str) else t for t in raw]
            vectors = await engine.embed(ids)
            width = vectors.shape[1]
            if req.dimensions is not None and req.dimensions != width:
                raise invalid(f"dimensions must equal this model's embedding width ({width}); "
                              "shortening embeddings is not supported", param="dimensions")
        except Exception as exc:
            err = record(observer, exc)
            if err.code == "context_length_exceeded":
                err.param = "input"
            raise err from exc
        tokens = sum(len(x) for x in ids)
        self.metrics.prompt_tokens.labels(*observer.labels).inc(tokens)
        observer.finish("embedded")
        self.metrics.e2e.labels(*observer.labels).observe(time.perf_counter() - received)
        return EmbeddingList(
            data=[Embedding(index=i, embedding=encode(v, req.encoding_format)) for i, v in enumerate(vectors)],
            model=req.model,
            usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
        )
