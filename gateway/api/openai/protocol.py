"""OpenAI wire schemas: requests, responses, stream chunks.  The only place they are defined.

Requests reject unknown fields, as OpenAI's API does ("Unrecognized request argument"), so a
misspelt parameter is an error instead of a silently ignored setting.  A few llama.cpp/vLLM
extensions are accepted (`top_k`, `min_p`, `repeat_penalty`, `ignore_eos`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ImageUrl(_Request):
    url: str  # a data: URL (base64)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Request):
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCallIn(_Request):
    name: str
    arguments: str = ""  # JSON text


class ToolCallIn(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call this result answers
    # An earlier assistant turn's refusal and reasoning, as our own responses carry them: clients
    # append the response message to the history unchanged. Not shown to the model.
    refusal: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))


class StreamOptions(_Request):
    include_usage: bool = False
    # vLLM's extension: with include_usage, every chunk carries the usage so far (the tokens
    # generated up to it; a chunk may carry several tokens' text, or none of a token's).
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Request):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDef(_Request):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON schema of the arguments
    strict: bool | None = None  # accepted: arguments always follow the schema here (grammar)


class ToolDef(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(ge=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=0)]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
RepeatPenalty = Annotated[float, Field(gt=0.0, le=10.0)]
Stop = str | Annotated[list[str], Field(max_length=16)] | None


class _SamplingFields(_Request):
    model: str
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Annotated[int, Field(ge=1, le=16)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    presence_penalty: Penalty | None = None  # None: the model's default (0)
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    seed: int | None = None
    user: str | None = None
    # Extensions shared with llama-server and vLLM.
    top_k: TopK | None = None
    min_p: MinP | None = None
    repeat_penalty: RepeatPenalty | None = None
    ignore_eos: bool = False


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessageIn], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    # Reasoning models: "none" answers at once (the other efforts think as the model does);
    # `chat_template_kwargs.enable_thinking` as in vLLM and llama-server.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_SamplingFields):
    # A string, a batch of strings, token ids, or a batch of token-id lists (OpenAI's four forms).
    prompt: str | Annotated[list[str], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
    # 0 only with echo: the prompt is scored, nothing generated (log-likelihood evaluation).
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None


# --- responses ---------------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TopLogprobOut(_Response):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(_Response):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprobOut]


class ChoiceLogprobs(_Response):
    content: list[TokenLogprobOut] | None
    refusal: list[TokenLogprobOut] | None = None


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class CompletionTokensDetails(_Response):
    # Speculative decoding's draft tokens (OpenAI reports predicted outputs the same way).
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class UsageOut(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None
    failovers: int | None = None  # an extension: times the answer continued on another engine

    @model_serializer(mode="wrap")
    def _failovers_when_any(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        if not out.get("failovers"):
            out.pop("failovers", None)
        return out


class FunctionCallOut(_Response):
    name: str
    arguments: str  # JSON text of the arguments


class ToolCallOut(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None  # what a model that thinks wrote before its answer

    @model_serializer(mode="wrap")
    def _reasoning_when_any(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        if out.get("reasoning_content") is None:
            out.pop("reasoning_content", None)
        return out


class _Sparse(_Response):
    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class FunctionDelta(_Sparse):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Sparse):
    """A fragment of a streamed tool call: `index` always; `id`, `type`, `name` once; then arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta | None = None


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: UsageOut


class Delta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A delta carries only what changed: {"role": ...} first, then {"content": ...}.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChunkChoice(_Response):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChunkChoice]
    usage: UsageOut | None = None


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token (nothing before it)
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class Completion(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: UsageOut | None = None


class CheckFinding(_Response):
    name: str
    ok: bool | None  # None: does not apply to this model (reasoning, for a model that does not reason)
    detail: str


class CheckReport(_Response):
    model: str
    format: str
    checked_at: int
    seconds: float
    summary: str
    findings: list[CheckFinding]


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "llm-gateway"
    # Extensions: what the gateway knows about the model.
    context_length: int
    formats: list[str]
    available: bool
    loaded: bool
    endpoints: list[str]  # which API endpoints serve it: chat.completions, completions, embeddings
    images: bool = False  # it takes images (a vision projector: models.yaml mmproj)
    description: str = ""
    # The family format of its tool calls and reasoning (models.yaml's, or its template's once loaded).
    tool_format: str | None = None
    # The tags it reasons in (think, mistral, harmony, ...; none: it does not reason), once loaded.
    reasoning_format: str | None = None
    # What it really does here, from its last capability check (`gateway check`); None: not checked.
    checks: list[CheckFinding] | None = None



class EmbeddingRequest(_Request):
    model: str
    input: (
        Annotated[str, Field(max_length=10_000_000)]
        | Annotated[list[str], Field(min_length=1, max_length=2048)]
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1, max_length=2048)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None


class Embedding(_Response):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: little-endian float32


class EmbeddingUsage(_Response):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(_Response):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorBody


class HealthResponse(BaseModel):
    """`GET /health` and `GET /health/ready`: 200 (`ok`) when the default model can serve, loaded or
    loadable on demand (unloaded, never loaded yet: its next request loads it); 503 when it cannot:
    `error` (its load failed, or its files are missing), `loading` (the first load at start-up),
    `degraded` (its engine's worker is restarting after a crash; `Retry-After` says when to ask
    again) or `draining`. Other models, failed or not, do not change the verdict."""

    status: Literal["ok", "loading", "error", "draining", "degraded"]
    reason: str | None = None  # why, when the default model is not simply loaded and ready
    default_model: str
    # Every configured model: loaded ones with ready, engine, device, running, waiting and reasons;
    # the others with `status` loading, failed (and its `error`) or not_loaded.
    models: dict[str, dict[str, Any]]
    uptime_s: float
    parity: dict[str, Any] | None = None
    inflight: int | None = None  # while draining: API requests still running
