"""The engine interface: plain request/event types, the Engine protocol and engine errors.

Engines never see HTTP, a protocol or a tool format.  The gateway turns a validated request into a
`GenerationRequest`; an engine turns that into a stream of `TokenEvent`s.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel


@dataclass(frozen=True)
class Tagged:
    """One kind of item of a "tagged" constraint: `begin`, a body, `end`. The body is JSON
    matching `schema` (its text; None = any JSON object), or with `body="xml"` the schema's
    properties as `<parameter=NAME>` blocks (a string's text as it is, other values as JSON, each
    followed by a newline and `</parameter>`): the XML tool calls of some families."""

    begin: str
    schema: str | None = None
    end: str = ""
    body: Literal["json", "xml"] = "json"


@dataclass(frozen=True)
class Constraint:
    """What the output must match, in terms any runtime can compile (its capabilities say which
    kinds it can: `Capabilities.constraints`).

    - "json": one JSON value matching `schema` (a JSON schema's text; None = any JSON object);
    - "grammar": `grammar`, a GBNF grammar (llama.cpp's format);
    - "tagged": `prefix`, then one to `max_items` items joined by `separator`, then `suffix`;
      each item is one of `items` (a model family's tool calls: one alternative per tool, or one
      for all of them, between the family's tags).
    With `triggers` the output is free text until it writes one of them; the constraint applies
    from there on (the trigger's text is the constrained text's start). `patterns` are triggers
    as regular expressions (ECMAScript; `^` is the output's start), for a call that may start only
    in some places: the constrained text starts at the first group that matched (`literal` escapes
    a text for them). `part` names the request
    part it comes from, in the gateway's neutral field names (the protocol adapter names the
    field as its client knows it), for errors about it.
    """

    kind: Literal["json", "grammar", "tagged"]
    schema: str | None = None
    grammar: str | None = None
    items: tuple[Tagged, ...] = ()
    prefix: str = ""
    suffix: str = ""
    separator: str = ""
    max_items: int = 1
    triggers: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()
    part: str = ""

    @property
    def lazy(self) -> bool:
        """Free text until a trigger."""
        return bool(self.triggers or self.patterns)


def literal(text: str) -> str:
    """`text` as a regular expression that matches it literally (for `Constraint.patterns`)."""
    return re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\1", text)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings, already validated by the caller."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    ignore_eos: bool = False
    constraint: Constraint | None = None
    # The prompt's own tokens with their log-probabilities (and this many alternatives), on the
    # first event (a completion that echoes its prompt). With it `max_tokens` may be 0: the prompt is only scored.
    prompt_logprobs: int | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """One generation: a prompt as text or as token ids, already rendered (a conversation is
    rendered by the gateway with the model's template: `templated`)."""

    request_id: str
    sampling: SamplingParams
    prompt: str | None = None
    # A prompt given as token ids: fed as they are.
    prompt_ids: tuple[int, ...] = ()
    # The prompt is a chat template's output: the special tokens' texts in it are those tokens, and
    # a BOS the template wrote is not doubled by the tokenizer's own.
    templated: bool = False
    # A key of what the request shares with the other turns of its conversation (a hash of its start,
    # up to the first user turn): requests with equal keys go to one worker of a group, where its KV
    # is. Engines ignore it; "" = the prompt's start.
    affinity: str = ""
    # Failover: tokens this request already generated on an engine that died. The engine continues
    # after them (prompt + these as the prefix, the sampler's penalty and grammar state advanced
    # over them), counts them as generated, and emits only what follows. Engines that can do this
    # say so with Capabilities.resume.
    resume_ids: tuple[int, ...] = ()
    # How they are fed: True, one per step as they were generated, so the KV cache (and so greedy
    # output) is what an uninterrupted run had; False, in one prefill batch (faster; llama.cpp's
    # batch-size-dependent rounding can then change a near-tie later on).
    resume_replay: bool = True
    # Special tokens whose text the output shows (a model family's tags that its vocabulary holds
    # as control tokens, e.g. `[TOOL_CALLS]`, `<|channel|>`): other control tokens stay unseen.
    shown: tuple[str, ...] = ()
    # Images (their encoded bytes: PNG, JPEG, WebP, GIF), one for each IMAGE_MARKER in the prompt, in
    # order; for engines whose Capabilities.images says they take them.
    images: tuple[bytes, ...] = ()


# Where an image goes in a rendered prompt (llama.cpp's multimodal library's default media marker).
IMAGE_MARKER = "<__media__>"


@dataclass(frozen=True)
class TopLogprob:
    token: str
    token_id: int
    logprob: float
    bytes: bytes


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    token_id: int
    logprob: float
    bytes: bytes
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    # Seconds spent waiting for a free sequence slot before prefill started.
    queue_seconds: float = 0.0
    # The prompt as token ids (the generated ids arrive in the events); shadow parity re-scores them.
    prompt_ids: tuple[int, ...] = ()
    # Speculative decoding: draft tokens proposed for this request, and how many were accepted.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    # Times the request continued on another (or the restarted) engine after its engine died.
    failovers: int = 0
    # Prompt tokens restored from the engine's host-memory prefix cache (part of cached_tokens);
    # prefix_lookup: "hit", "miss", or "" when the slot's own KV already held the prefix.
    restored_tokens: int = 0
    prefix_lookup: str = ""


@dataclass(frozen=True)
class TokenEvent:
    """One step of a generation.

    `text` is the text released by this step: it can be empty (a token that ends inside a UTF-8
    character, or text held back because it may start a stop string) and it can carry text of
    earlier tokens.  The last event has `finish_reason` ("stop" or "length") and `usage`.
    """

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    usage: Usage | None = None
    stop_sequence: str | None = None  # the request's stop string that ended it (finish_reason "stop")
    # On a generation's first event, where the engine knows it then (llama.cpp, ORT GenAI, CoreML): the prompt's
    # tokens, as usage will count them; 0 otherwise (usage on the last event is the truth).
    prompt_tokens: int = 0
    # On that first event too: how many of them came from a cache (the KV or the host prefix cache).
    cached_tokens: int = 0
    # On the first event, with SamplingParams.prompt_logprobs: each prompt token, the first one's
    # logprob NaN (nothing comes before it).
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class EngineHealth:
    ready: bool
    detail: str = ""
    running: int = 0
    waiting: int = 0
    busy_seconds: float = 0.0  # how long the current decode step has run (0 when idle): a watchdog's input
    prefix_cache: PrefixCacheStats | None = None  # engines with a host-memory prefix cache
    kv: KvStats | None = None  # engines that report their KV cache (llama.cpp)


@dataclass(frozen=True)
class KvStats:
    """An engine's KV cache: its cells, what its sequences hold, and what its scheduler did to
    fit requests into one cache the sequences share (kv_unified)."""

    cells: int = 0  # the cache's cells (tokens), every sequence's together
    used: int = 0  # cells the sequences hold, running and idle
    idle: int = 0  # cells idle sequences hold (finished requests' KV, kept for a next turn)
    # Requests paused because the shared cache was full; they resumed when there was room.
    preemptions: int = 0
    # Idle sequences' KV moved out of the shared cache (to the host prefix cache when worth the
    # copy) because it outgrew the running requests' own, which attend over it too, and had cost
    # their passes TRIM_PAYBACK times what moving it out and back costs.
    idle_evictions: int = 0
    # Prompts whose prefix came from another sequence's KV instead of a prefill; of those, prompts
    # that waited for a running request's prefill of it (requests started together, one prefix).
    prefix_copies: int = 0
    prefix_follows: int = 0
    # Prompts sent to the engine's second context for long prompts (GATEWAY_LONG_PROMPT_TOKENS),
    # prefilled and decoded beside the running requests instead of in chunks inside their steps.
    long_prompts_beside: int = 0

    @classmethod
    def combine(cls, stats: list[KvStats]) -> KvStats:
        """Several engines' caches as one: everything adds up."""
        return cls(**{f.name: sum(getattr(s, f.name) for s in stats) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class PrefixCacheStats:
    """A host-memory prefix cache's counters (since its process started) and size."""

    hits: int = 0
    misses: int = 0
    restored_tokens: int = 0
    saved: int = 0
    skipped_saves: int = 0  # states not saved because prefilling their new part is quicker than the copy
    checkpoints: int = 0  # states saved mid-prompt at a shared prefix's end (sliding-window models)
    evictions: int = 0
    entries: int = 0
    bytes: int = 0
    limit_bytes: int = 0
    pinned: bool = False  # entries live in the device's page-locked host memory (DMA copies)
    # The copy rates measured (moving averages, bytes/s; 0 = none yet): device to host memory on a
    # save, back on a restore. They decide whether a save or restore beats prefilling.
    save_bytes_per_s: float = 0.0
    restore_bytes_per_s: float = 0.0
    # Page-locked allocations (the arena, at load) and the seconds they took (0 in pageable memory).
    allocations: int = 0
    allocation_seconds: float = 0.0
    unpinned: int = 0  # states that found no free page-locked range and went to pageable memory

    @classmethod
    def combine(cls, caches: list[PrefixCacheStats]) -> PrefixCacheStats:
        """Several engines' caches as one: counts and sizes add up, rates average."""
        rates = {"save_bytes_per_s", "restore_bytes_per_s"}
        out: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            vals = [getattr(c, f.name) for c in caches]
            if f.name == "pinned":
                out[f.name] = bool(vals) and all(vals)
            elif f.name in rates:
                seen = [v for v in vals if v]
                out[f.name] = sum(seen) / len(seen) if seen else 0.0
            else:
                out[f.name] = sum(vals)
        return cls(**out)


@dataclass(frozen=True)
class EngineConfig:
    """How to instantiate one model on one runtime and device (built by the gateway's selector)."""

    model_path: str
    context_length: int = 2048  # tokens per sequence
    parallel: int = 4  # sequences decoded together
    n_batch: int = 512
    n_threads: int = 0  # 0 = all cores
    n_gpu_layers: int = 0  # layers on the device; 0 or -1 = all of them when a device is chosen
    main_gpu: int = 0
    max_queue: int = 64  # requests that may wait for a free sequence
    backend: str = "cpu"  # cpu, vulkan, cuda, metal, directml, coreml
    device: str = "cpu"  # human-readable device name
    device_key: str = ""  # the runtime's own device id (ggml "Vulkan0"/"CUDA0", ORT device id); "" = CPU
    chat_template: str | None = None  # Jinja; overrides the template shipped with the model
    pooling: str = "mean"  # embeddings: mean, cls or last
    normalize_embeddings: bool = True  # L2-normalise each embedding
    # The runtime's own options: an instance of its descriptor's `options` model
    # (engines/runtimes.py: llama.cpp's LlamaCppOptions, CoreML's CoreMLOptions), validated where
    # the config is made; None = that model's defaults. An engine reads its own typed model
    # (`LlamaCppOptions.of(config)`), and refuses another runtime's.
    options: BaseModel | None = None


@dataclass(frozen=True)
class TemplateSource:
    """A model's chat template as its files carry it (Jinja text), with the special-token texts
    it refers to. The engine reports it; the gateway renders it (gateway/chat/template.py)."""

    text: str
    bos_token: str = ""
    eos_token: str = ""


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do beyond generating from a prompt."""

    resume: bool = False  # continues a failed-over generation after GenerationRequest.resume_ids
    logits: bool = True  # Engine.logits (parity, prompt logprobs)
    embeddings: bool = False  # Engine.embed
    # Constraint kinds it compiles ("json", "grammar", "tagged"), and whether `triggers` work.
    constraints: frozenset[str] = frozenset()
    lazy_constraints: bool = False
    images: bool = False  # the model takes images beside its prompt (a vision projector is loaded)


@dataclass(frozen=True)
class EngineInfo:
    """What an engine is, for logs, headers and metrics labels, and what the gateway needs to
    know of it: its model's chat template and what it can do. `extra` is for people (health,
    `gateway devices`), never read by code."""

    runtime: str
    backend: str
    device: str
    version: str = ""
    context_length: int = 0
    parallel: int = 1
    template: TemplateSource | None = None
    capabilities: Capabilities = Capabilities()
    extra: dict[str, str] = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    """A loaded model on one runtime and device."""

    info: EngineInfo

    async def load(self) -> None:
        """Load weights and allocate the context.  Raises ModelLoadError."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Stream token events.  Closing the iterator early aborts the generation.

        Errors known before the first token (context too long, bad grammar, queue full) are
        raised on the first `__anext__`, before any event is produced.
        """
        ...

    async def logits(self, token_ids: list[int], images: tuple[bytes, ...] = ()) -> npt.NDArray[np.float32]:
        """Next-token logits at every position of `token_ids`: shape (len(token_ids), n_vocab). With
        `images` (a prompt with images, as an engine with `Capabilities.images` tokenized it: their
        stand-in ids in `token_ids`), the rows of an image's positions are NaN."""
        ...

    async def tokenize(self, text: str) -> list[int]:
        """Token ids of `text` as this engine's model sees it (with BOS where the model adds one)."""
        ...

    async def embed(self, inputs: list[list[int]]) -> npt.NDArray[np.float32]:
        """One pooled embedding per token sequence: shape (len(inputs), width).  Raises
        InvalidGenerationRequest for an empty or out-of-vocabulary sequence, ContextLengthExceeded
        for one longer than the context, and InvalidGenerationRequest where the runtime has none."""
        ...

    def health(self) -> EngineHealth: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class SupervisorReport:
    """What a supervisor says of the engine it runs, for /health (under `kind`) and the memory
    budget (`rss_bytes`: host memory its processes on this host hold, 0 where it cannot tell)."""

    kind: Literal["worker", "cluster"]
    detail: dict[str, Any]
    rss_bytes: int = 0


@runtime_checkable
class Supervised(Protocol):
    """What an engine run by a supervisor adds to `Engine`: a worker process (engines/worker), a
    group of workers (gateway/models/routing.py), a cluster deployment (gateway/cluster)."""

    def report(self) -> SupervisorReport: ...

    def trust(self) -> None:
        """Its functional check passed: from now on a crash restarts it instead of failing the check."""

    def retry_after(self) -> int:
        """Seconds until it serves again (0: it does), for Retry-After."""
        ...

    async def back(self) -> bool:
        """Returns True once it serves (at once while it does); False at once if it cannot tell."""
        ...


class EngineError(Exception):
    """Base of every error an engine raises."""


class ModelLoadError(EngineError):
    """The model could not be loaded on this runtime/device."""


class LoadInterrupted(ModelLoadError):
    """The load was stopped from outside (its process killed by a SIGKILL that neither the gateway
    nor the kernel's OOM killer sent): nothing was learnt about the engine, so no verdict on it is kept."""


class ModelTooLarge(ModelLoadError):
    """The model does not fit its device's memory budget even alone (the message has the numbers)."""


class NoRoom(ModelLoadError):
    """The model fits its budget, but the models holding that memory are busy and stayed busy."""


class ModelNotAvailable(EngineError):
    """The model's files are not present and cannot be obtained."""


class ContextLengthExceeded(EngineError):
    def __init__(self, prompt_tokens: int, context_length: int) -> None:
        super().__init__(
            f"This model's maximum context length is {context_length} tokens, "
            f"but the prompt has {prompt_tokens} tokens."
        )
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length


class InvalidGenerationRequest(EngineError):
    """The request is well-formed but this engine cannot serve it (e.g. a grammar it rejects)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineOverloaded(EngineError):
    """The engine's wait queue is full."""


class EngineClosed(EngineError):
    """The engine was closed (unloaded) while the request was waiting or running."""


class EngineFailure(EngineError):
    """The runtime failed while generating."""


class EngineCrashed(EngineFailure):
    """The process hosting the engine died or hung (a native crash, an OOM kill, a stuck step).
    `outside`: it was killed from outside (a SIGKILL that neither the gateway nor the kernel's OOM
    killer sent): nothing the requests did, so none of them is blamed for it. `blamed`: the request
    was in flight, not started, at POISON_CRASHES crashes in a row: it is taken for the cause and
    not sent again, by its engine or by a failover."""

    def __init__(self, message: str = "", outside: bool = False, blamed: bool = False) -> None:
        super().__init__(message)
        self.outside = outside
        self.blamed = blamed


# A request in flight at this many crashes in a row (none from outside) is not sent again: it may be
# what crashes the worker (a prompt that takes a broken kernel), and an only engine never gives up.
POISON_CRASHES = 2


def token_prompt(ids: tuple[int, ...], n_vocab: int) -> list[int]:
    """A prompt given as token ids, checked against the model's vocabulary."""
    bad = next((t for t in ids if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise InvalidGenerationRequest(f"token id {bad} is not in the model's vocabulary (0 to {n_vocab - 1})",
                                       param="prompt")
    return list(ids)


def new_token_budget(prompt: list[int], n_ctx: int, max_tokens: int | None) -> int:
    """How many tokens a request may generate in a context of `n_ctx`, after checking that its
    prompt is not empty and leaves room for at least one token."""
    if not prompt:
        raise InvalidGenerationRequest("the prompt is empty", param="prompt")
    if max_tokens is not None and max_tokens < 1:
        raise InvalidGenerationRequest("max_tokens must be at least 1 (0 only to score the prompt)", param="max_tokens")
    if len(prompt) >= n_ctx:
        raise ContextLengthExceeded(len(prompt), n_ctx)
    room = n_ctx - len(prompt)
    return min(max_tokens, room) if max_tokens is not None else room


def resumed_tokens(request: GenerationRequest, max_new: int) -> tuple[int, ...]:
    """The tokens a failover resumes from (GenerationRequest.resume_ids), checked to leave room for more."""
    resumed = request.resume_ids
    if len(resumed) >= max_new:
        raise InvalidGenerationRequest(f"{len(resumed)} tokens to resume from leave no room for more (limit {max_new})")
    return resumed
