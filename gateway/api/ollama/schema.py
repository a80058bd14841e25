"""Ollama's request bodies, typed: `/api/chat`, `/api/generate`, `/api/embed`, `/api/embeddings`,
`/api/show`, `/api/create`, `/api/copy`, their messages, tools and `options`.

Types are checked, and the sampler's options have the ranges OpenAI's routes give them (a 400
naming the field: `options.top_p`, `messages[1].tool_calls[0].function.name`). A field these
models do not define is accepted and named in `X-Ignored-Fields`, at any depth (Ollama's own
server ignores unknown fields and options, and clients written for it send some:
`tool_call_id`, `logprobs`); so are Ollama's options the gateway has no sampler for.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.api.openai.protocol import MinP, Penalty, RepeatPenalty, Stop, Temperature, TopK, TopP


class _Open(BaseModel):
    """Fields it does not define are kept, to be named in X-Ignored-Fields."""

    model_config = ConfigDict(extra="allow")


class OllamaOptions(_Open):
    """Ollama's `options` (and `/api/create`'s `parameters`). The sampler reads the first group; the
    second is Ollama's runner and samplers the gateway does not have (named when given): `num_ctx`
    is the model's (models.yaml `context_length`), except in `/api/create`."""

    num_predict: int | None = Field(default=None, description="the most tokens to generate; -1 or -2: no limit")
    temperature: Temperature | None = None
    top_k: TopK | None = None
    top_p: TopP | None = None
    min_p: MinP | None = None
    seed: int | None = None
    stop: Stop = None
    repeat_penalty: RepeatPenalty | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None

    num_ctx: int | None = None
    num_keep: int | None = None
    typical_p: float | None = None
    repeat_last_n: int | None = None
    tfs_z: float | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    penalize_newline: bool | None = None
    numa: bool | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    num_thread: int | None = None


SAMPLER_OPTIONS = ("num_predict", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "repeat_penalty",
                   "presence_penalty", "frequency_penalty")


class OllamaToolCallFunction(_Open):
    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)  # an object; JSON text is taken too
    index: int | None = None  # as the gateway's own answers carry it


class OllamaToolCall(_Open):
    function: OllamaToolCallFunction
    id: str | None = None  # as the gateway's own answers carry it


class OllamaMessage(_Open):
    """A chat message. `images` are refused until the gateway serves a vision model (an empty list
    is no image)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    images: list[str] | None = None
    thinking: str | None = None  # earlier reasoning sent back: not shown to the model
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None  # a tool message: the tool whose call it answers
    name: str | None = None  # the same, as some clients send it


class OllamaFunction(_Open):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # the arguments' JSON schema


class OllamaTool(_Open):
    type: str = "function"  # Ollama's tools are functions
    function: OllamaFunction


class _Request(_Open):
    model: str
    format: Literal["", "json"] | dict[str, Any] | None = None  # "json", or a JSON schema the answer must match
    options: OllamaOptions | None = None
    stream: bool = True  # Ollama streams unless told not to
    keep_alive: str | int | float | None = None
    think: bool | str | None = None  # true, false, or a level: "high", "medium", "low"


class ChatRequest(_Request):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[OllamaTool] | None = None


class GenerateRequest(_Request):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    raw: bool = False
    images: list[str] | None = None
    context: list[int] | None = None


class EmbedRequest(_Open):
    model: str
    input: str | list[str]
    truncate: bool = True
    options: OllamaOptions | None = None
    keep_alive: str | int | float | None = None
    dimensions: int | None = None


class LegacyEmbeddingRequest(_Open):
    model: str
    prompt: str
    options: OllamaOptions | None = None
    keep_alive: str | int | float | None = None


class ModelRequest(_Open):
    model: str = ""
    name: str = ""  # older clients send `name`

    @property
    def id(self) -> str:
        return self.model or self.name


class CreateRequest(_Open):
    """`POST /api/create` (Ollama 0.5.5 and later: fields, not a Modelfile)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    model: str = ""
    name: str = ""  # older clients send `name`
    from_: str | None = Field(default=None, alias="from")
    files: dict[str, str] | None = None
    adapters: dict[str, str] | None = None
    template: str | None = None
    license: str | list[str] | None = None
    system: str | None = None
    parameters: OllamaOptions | None = None
    messages: list[OllamaMessage] | None = None
    quantize: str | None = None
    modelfile: str | None = None  # the API before 0.5.5
    stream: bool = True


class CopyRequest(_Open):
    source: str
    destination: str
