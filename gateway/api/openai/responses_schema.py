"""The Responses API's request and response bodies (`POST /v1/responses` and the stored-response
routes), typed: unknown request fields are kept and named in `X-Ignored-Fields`, ranges are checked
as on the other OpenAI routes."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.api.openai.protocol import Temperature, TopP

__all__ = ["DeletedResponse", "InputItemList", "ResponseCreateRequest", "ResponseObject", "ResponseStreamEvent",
           "TextConfig", "TextFormat"]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponseCreateRequest(BaseModel):
    """`POST /v1/responses`. Unknown fields are a 400, as OpenAI's API does; every field agents send
    is known here, honoured or named in `X-Ignored-Fields`."""

    model_config = ConfigDict(extra="forbid")
    model: str
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    user: str | None = None
    safety_identifier: str | None = None
    background: bool | None = None
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    seed: int | None = None  # an extension (llama-server and vLLM accept it too)
    client_metadata: dict[str, Any] | None = None  # Codex CLI sends it on every turn


class ResponseObject(BaseModel):
    """The response object (documented loosely: its items follow OpenAI's Responses API)."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None


class ResponseStreamEvent(BaseModel):
    """One event of a response stream; the SSE `event:` line repeats its type."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"]
    deleted: bool


class InputItemList(BaseModel):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
