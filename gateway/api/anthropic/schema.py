"""Anthropic's Messages API request bodies, typed: `POST /v1/messages` and
`POST /v1/messages/count_tokens`, their messages and content blocks (told apart by `type`), tools,
`tool_choice`, `thinking` and `output_config`.

Types and ranges are checked (a 400 naming the field, `messages[0].content[1].type`). A field these
models do not define is accepted and named in `X-Ignored-Fields`, at any depth (Claude Code and the
SDKs add fields as Anthropic adds them); what the SDKs send by default (`cache_control`,
`citations: null`, `metadata`) is defined and quiet.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from gateway.api.bodies import tagged, text_or_list, type_of
from gateway.api.openai.protocol import TopK, TopP


class _Open(BaseModel):
    """Fields it does not define are kept, to be named in X-Ignored-Fields."""

    model_config = ConfigDict(extra="allow")


class CacheControl(_Open):
    """Prompt caching's breakpoint: the engine's prefix cache keeps every prompt's prefix anyway."""

    type: str = "ephemeral"
    ttl: str | None = None


# --- content blocks ---------------------------------------------------------------------------------


class TextBlock(_Open):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None


class ImageBlock(_Open):
    type: Literal["image"]
    source: dict[str, Any]
    cache_control: CacheControl | None = None


class DocumentBlock(_Open):
    type: Literal["document"]
    source: dict[str, Any]
    title: str | None = None
    context: str | None = None
    citations: dict[str, Any] | None = None
    cache_control: CacheControl | None = None


_RESULT_TAGS = ("text", "image", "document")
ResultBlock = Annotated[TextBlock | ImageBlock | DocumentBlock, Field(discriminator="type"),
                        tagged("content block", _RESULT_TAGS)]


ResultContent = Annotated[Annotated[str, Tag("str")] | Annotated[list[ResultBlock], Tag("list")],
                          Discriminator(text_or_list, custom_error_type="invalid_type",
                                        custom_error_message="a tool result's content must be a string or a list of "
                                                             "content blocks")]


class ToolUseBlock(_Open):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)
    cache_control: CacheControl | None = None


class ToolResultBlock(_Open):
    type: Literal["tool_result"]
    tool_use_id: str
    content: ResultContent = ""
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(_Open):
    """Earlier reasoning sent back: accepted, not shown to the model (as chat templates drop it)."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""  # the gateway's own thinking blocks are not signed


class RedactedThinkingBlock(_Open):
    type: Literal["redacted_thinking"]
    data: str


ServerBlockType = Literal["server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
                          "code_execution_tool_result", "bash_code_execution_tool_result",
                          "text_editor_code_execution_tool_result", "tool_search_tool_result", "container_upload"]


class ServerToolBlock(BaseModel):
    """A server-side tool's call or result (web search, code execution, ...) sent back in the
    history: accepted as it is, not shown to the model."""

    model_config = ConfigDict(extra="ignore")
    type: ServerBlockType


_BLOCK_TAGS = ("text", "image", "document", "tool_use", "tool_result", "thinking", "redacted_thinking",
               *get_args(ServerBlockType))
Block = Annotated[TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
                  | RedactedThinkingBlock | ServerToolBlock, Field(discriminator="type"),
                  tagged("content block", _BLOCK_TAGS)]


Content = Annotated[Annotated[str, Tag("str")] | Annotated[list[Block], Tag("list")],
                    Discriminator(text_or_list, custom_error_type="invalid_type",
                                  custom_error_message="content must be a string or a list of content blocks")]
System = Annotated[Annotated[str, Tag("str")] | Annotated[list[TextBlock], Tag("list")],
                   Discriminator(text_or_list, custom_error_type="invalid_type",
                                 custom_error_message="system must be a string or a list of text blocks")]


class MessageParam(_Open):
    """A turn. `system` messages (Claude Code sends its reminders so) join the system prompt."""

    role: Literal["user", "assistant", "system"]
    content: Content


# --- tools ------------------------------------------------------------------------------------------


class CustomTool(_Open):
    """A tool the client runs: its calls are constrained to `input_schema` by grammar."""

    type: Literal["custom"] | None = None
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


class BuiltinTool(BaseModel):
    """An Anthropic-defined tool (`bash_…`, `text_editor_…`, `web_search_…`, `computer_…`): run by
    Anthropic or described by its type alone; skipped and named in X-Skipped-Tools."""

    model_config = ConfigDict(extra="ignore")
    type: str
    name: str | None = None


Tool = Annotated[Annotated[CustomTool, Tag("custom")] | Annotated[BuiltinTool, Tag("builtin")],
                 Discriminator(type_of("custom", ("custom",), "builtin")), tagged("tool", ("custom", "builtin"))]


class ToolChoiceAuto(_Open):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(_Open):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(_Open):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(_Open):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type"),
                       tagged("tool_choice", ("auto", "any", "tool", "none"))]


# --- thinking and output ----------------------------------------------------------------------------


class ThinkingEnabled(_Open):
    type: Literal["enabled"]
    budget_tokens: Annotated[int, Field(ge=1024)]  # Anthropic's minimum; not honoured: the model thinks as it does


class ThinkingAdaptive(_Open):
    type: Literal["adaptive"]


class ThinkingDisabled(_Open):
    type: Literal["disabled"]


Thinking = Annotated[ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type"),
                     tagged("thinking", ("enabled", "adaptive", "disabled"))]


class JsonOutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Open):
    format: JsonOutputFormat | None = None  # enforced by grammar
    effort: str | None = None  # not honoured: named in X-Ignored-Fields


# --- requests ---------------------------------------------------------------------------------------


class _Prompt(_Open):
    model: str
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: System | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(_Prompt):
    """`POST /v1/messages`."""

    max_tokens: int = Field(ge=1, description="required, as Anthropic requires it")
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None  # Anthropic's range
    top_p: TopP | None = None
    top_k: TopK | None = None
    metadata: dict[str, Any] | None = None  # accepted without effect, and quiet
    stream: bool = False


class CountTokensRequest(_Prompt):
    """`POST /v1/messages/count_tokens`: a Messages request without `max_tokens`."""
