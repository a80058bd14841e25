"""What the stateful KV-cache program runtimes (CoreML, ExecuTorch) share: a Hugging Face
tokenizer beside the program, the model folder's EOS ids, sampling from a logits row in numpy,
and the engine around a `_predict` that feeds tokens into a request's cache.

A runtime subclasses `StatefulEngine` with how it loads its program, makes a request's state and
predicts; generation runs the shared per-token loop (engines/steps.py) over those predictions.
"""

from __future__ import annotations

import asyncio
import json
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from engines.base import (
    ContextLengthExceeded,
    EngineConfig,
    EngineHealth,
    EngineInfo,
    GenerationRequest,
    InvalidGenerationRequest,
    ModelLoadError,
    SamplingParams,
    TokenEvent,
    token_prompt,
)
from engines.bridge import EventChannel, Job, WorkerPool, call_job, pool_health
from engines.steps import StepPlan, run_steps, step_plan, stream_steps


def sample(logits: npt.NDArray[np.float32], sp: SamplingParams, rng: np.random.Generator) -> int:
    """Pick the next token: greedy at temperature 0, else top-k / top-p / min-p sampling."""
    x = logits.astype(np.float64)
    for token, bias in sp.logit_bias:
        x[token] += bias
    if sp.temperature <= 0.0:
        return int(np.argmax(x))
    x = x / sp.temperature
    order = np.argsort(-x)
    if sp.top_k > 0:
        order = order[: sp.top_k]
    p = np.exp(x[order] - x[order[0]])
    p /= p.sum()
    keep = len(p)
    if sp.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), sp.top_p) + 1)
    if sp.min_p > 0.0:
        keep = min(keep, int((p >= sp.min_p * p[0]).sum()))
    p = p[:keep] / p[:keep].sum()
    return int(order[rng.choice(keep, p=p)])


def eos_ids(d: Path) -> list[int]:
    """The end-of-sequence ids a model folder's generation_config.json and config.json name."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        p = d / name
        if p.is_file():
            value = json.loads(p.read_text()).get("eos_token_id")
            ids += value if isinstance(value, list) else [value] if isinstance(value, int) else []
    return ids


def load_tokenizer(d: Path, runtime: str, extra: str) -> Any:
    """The folder's tokenizer.json, or ModelLoadError naming the extra that installs `tokenizers`."""
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise ModelLoadError(f"the {runtime} engine needs tokenizers: pip install -e '.[{extra}]'") from exc
    return Tokenizer.from_file(str(d / "tokenizer.json"))


class StatefulEngine(ABC):
    """An engine over a program that keeps a request's KV cache in a state it is fed into."""

    options: EngineConfig
    info: EngineInfo
    _tokenizer: Any
    _pool: WorkerPool | None
    _eos: frozenset[int]
    _n_ctx: int

    # --- what a runtime supplies -----------------------------------------------------------

    @abstractmethod
    def _load_blocking(self) -> None:
        """Load the program, tokenizer and EOS ids, and start the pool."""

    @abstractmethod
    def _release(self) -> None:
        """Drop the program (the pool's threads have stopped)."""

    @abstractmethod
    def _new_state(self) -> Any:
        """A request's model state (its KV cache)."""

    @abstractmethod
    def _predict(self, ids: list[int], end: int, state: Any) -> npt.NDArray[np.float32]:
        """Feed `ids` (positions end-len(ids) .. end-1); logits for each, shape (len(ids), vocab)."""

    def _prefill(self, prompt: list[int], state: Any) -> npt.NDArray[np.float32]:
        """Logits of the prompt's tokens (at least its last) fed into a new `state`."""
        return self._predict(prompt, len(prompt), state)

    # --- lifecycle -------------------------------------------------------------------------

    async def load(self) -> None:
        await asyncio.to_thread(self._load_blocking)

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await asyncio.to_thread(pool.close)
        self._release()

    def health(self) -> EngineHealth:
        return pool_health(self._pool)

    # --- text ------------------------------------------------------------------------------

    async def tokenize(self, text: str) -> list[int]:
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def piece(self, token: int) -> bytes:
        return str(self._tokenizer.decode([token], skip_special_tokens=False)).encode("utf-8")

    def prompt_tokens(self, request: GenerationRequest) -> list[int]:
        """The request's prompt as token ids (text tokenized without added special tokens: a chat
        template writes its own)."""
        if request.prompt_ids:
            return token_prompt(request.prompt_ids, self._tokenizer.get_vocab_size())
        return self.encode(request.prompt or "")

    # --- generation ------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        pool = self._pool
        if pool is None:
            raise ModelLoadError("model is not loaded")
        c = request.sampling.constraint
        if c is not None:
            raise InvalidGenerationRequest(f"constrained output is not supported by the {self.info.runtime} runtime",
                                           param=c.part or None)
        plan = step_plan(request, self.prompt_tokens(request), self._n_ctx)
        async for item in stream_steps(pool, plan, self.logits, self.piece, self._generate_blocking):
            yield item

    def _generate_blocking(self, job: Job[None], channel: EventChannel, plan: StepPlan) -> None:
        run_steps(job, channel.emit, plan, _StateSteps(self, plan.sampling), self._eos, self.piece)

    async def embed(self, inputs: list[list[int]]) -> npt.NDArray[np.float32]:
        raise InvalidGenerationRequest(
            f"embeddings are not supported by the {self.info.runtime} runtime; serve this model with llama.cpp", param="model"
        )

    async def logits(self, token_ids: list[int], images: tuple[bytes, ...] = ()) -> npt.NDArray[np.float32]:
        pool = self._pool
        if pool is None:
            raise ModelLoadError("model is not loaded")
        if images:
            raise InvalidGenerationRequest("this engine takes no images")
        if not token_ids:
            raise InvalidGenerationRequest("no tokens to score")
        if len(token_ids) > self._n_ctx:
            raise ContextLengthExceeded(len(token_ids), self._n_ctx)
        return await call_job(pool, lambda: self._predict(list(token_ids), len(token_ids), self._new_state()))


class _StateSteps:
    """A request's state as the per-token loop drives it: each step feeds the token chosen last
    and samples the next from its logits row here, in numpy."""

    def __init__(self, engine: StatefulEngine, sp: SamplingParams) -> None:
        self._engine = engine
        self._state = engine._new_state()
        self._sp = sp
        self._rng = np.random.default_rng(sp.seed)
        self._masked = list(engine._eos) if sp.ignore_eos else None  # EOS never chosen
        self._end = 0  # the positions fed
        self._row: npt.NDArray[np.float32] | None = None
        self._chosen: int | None = None  # chosen and not yet fed
        self._ids: list[int] = []  # every token decoded so far
        self._sent = ""

    def feed(self, tokens: Sequence[int]) -> None:
        ids = list(tokens)
        self._end += len(ids)
        if self._end == len(ids):
            rows = self._engine._prefill(ids, self._state)
        else:
            rows = self._engine._predict(ids, self._end, self._state)
        self._row = rows[-1]

    def next(self, logits: bool) -> tuple[int, npt.NDArray[np.float32] | None]:
        if self._chosen is not None:
            self.feed((self._chosen,))
        row = self._row
        assert row is not None, "the prompt is fed first"
        if self._masked is not None:
            row[self._masked] = -np.inf
        self._chosen = sample(row, self._sp, self._rng)
        return self._chosen, row

    def text(self, tokens: Sequence[int]) -> str:
        # Decode everything so far: byte-level tokens may end inside a character.
        self._ids.extend(tokens)
        full = str(self._engine._tokenizer.decode(self._ids, skip_special_tokens=False))
        if full.endswith("\ufffd"):
            return ""
        out, self._sent = full[len(self._sent):], full
        return out
