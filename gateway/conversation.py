"""The conversation model: a request and its output, whatever protocol the client speaks.

Each protocol (OpenAI chat completions and Responses, later Anthropic Messages and Ollama) is a
thin adapter that translates its request into a `Conversation` and the neutral `OutputEvent`s back
into its own wire format. Tool planning, prompt rendering and the tool-call parsers work on these
types only (`gateway.api.tools`), so a new protocol is one module that translates in and out.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from gateway.chat.images import Image

Role = Literal["system", "user", "assistant", "tool"]
ToolKind = Literal["function", "custom"]  # custom: a freeform tool called with {"input": <text>}


@dataclass(frozen=True)
class Part:
    """A piece of a message's content: text, or an image (decoded and checked by the adapter,
    gateway/chat/images.py; `param` says where the client put it, in its protocol's words)."""

    type: Literal["text", "image"]
    text: str = ""
    image: Image | None = None
    param: str = ""
    url: str = ""  # an http(s) image not fetched yet (gateway/api/images.py fetches it, where allowed)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text for function tools, free text for custom tools
    kind: ToolKind = "function"


@dataclass(frozen=True)
class Turn:
    """One message. "developer" (OpenAI's newer name) arrives here as "system"."""

    role: Role
    parts: tuple[Part, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call this result answers

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.parts if p.type == "text")

    @staticmethod
    def of(role: Role, text: str, **kw: Any) -> Turn:
        return Turn(role, (Part("text", text),) if text else (), **kw)


@dataclass(frozen=True)
class ToolSpec:
    """A tool the model may call. "custom" tools take free text (Codex's apply_patch); their
    arguments are a JSON string in the constrained answer, returned as the text itself."""

    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None  # JSON schema of a function tool's arguments
    kind: ToolKind = "function"


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["auto", "none", "required", "named"] = "auto"
    name: str | None = None  # with "named"


@dataclass(frozen=True)
class Output:
    """The output constraint: plain text, any JSON object, or a JSON schema (enforced by grammar)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    schema: dict[str, Any] | None = None
    name: str = "response"
    strict: bool | None = None


@dataclass(frozen=True)
class Sampling:
    """What a request asks of the sampler, in no protocol's words. None (or empty): the model's
    default from models.yaml, else the gateway's (`gateway.api.sampling.resolve`)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    max_tokens: int | None = None  # None: until the model stops (the context bounds it)
    stop: tuple[str, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    ignore_eos: bool = False
    logprobs: bool = False  # each generated token's log-probability
    top_logprobs: int = 0  # and this many alternatives
    prompt_logprobs: int | None = None  # the prompt's own tokens scored (this many alternatives)


@dataclass(frozen=True)
class Conversation:
    """What any protocol's request asks for, once validated by its adapter."""

    turns: tuple[Turn, ...]
    tools: tuple[ToolSpec, ...] | None = None  # None: no tools given ("none given" differs from "empty")
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    output: Output | None = None
    thinking: bool | None = None  # reasoning models: None = the model's default, False = answer at once
    sampling: Sampling = field(default_factory=Sampling)
    # Where the adapter's own names for these fields are, for error messages ("tools", "tool_choice.name").
    params: dict[str, str] = field(default_factory=dict)
    effort: str | None = None  # how hard a model with reasoning levels thinks: "low" | "medium" | "high"

    def param(self, what: str) -> str:
        return self.params.get(what, what)

    @property
    def images(self) -> list[Part]:
        """The image parts of every turn, in order."""
        return [p for t in self.turns for p in t.parts if p.type == "image"]

    @property
    def uses_tool_history(self) -> bool:
        return any(t.role == "tool" or t.tool_calls for t in self.turns)


def with_preamble(conv: Conversation, system: str | None, messages: Sequence[tuple[Role, str]]) -> Conversation:
    """The model's own start of every chat (Ollama's SYSTEM and MESSAGE): its system prompt when the
    request brings none, then its preset messages, then the request's turns (after the request's
    leading system turns, which stay first where chat templates expect them)."""
    if not system and not messages:
        return conv
    turns = list(conv.turns)
    lead = 0
    while lead < len(turns) and turns[lead].role == "system":
        lead += 1
    brings_own = any(t.role == "system" for t in turns)
    head = [Turn.of("system", system)] if system and not brings_own else turns[:lead]
    return replace(conv, turns=(*head, *(Turn.of(r, c) for r, c in messages), *turns[lead:]))


# --- the output, as neutral events ---------------------------------------------------------------


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    """Text of the model's reasoning, before its answer (models that think)."""

    text: str


@dataclass(frozen=True)
class CallStarted:
    call: int  # the call's position in this answer
    id: str
    name: str
    kind: ToolKind = "function"


@dataclass(frozen=True)
class ArgumentsDelta:
    call: int
    text: str


@dataclass(frozen=True, slots=True)
class Usage:
    """What one choice cost, in tokens, once it finished."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt's, those served from a cache
    # Speculative decoding: draft tokens proposed, and how many of them were accepted.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    failovers: int = 0  # times the choice continued on another engine after its engine died


class Alternative(Protocol):
    """One of the likeliest tokens at a position, with its log-probability.

    A shape, not a class: the tokens an engine scores have it already and travel as they are, so
    a stream that asks for logprobs copies nothing per token."""

    @property
    def token(self) -> str: ...

    @property
    def logprob(self) -> float: ...

    @property
    def bytes(self) -> builtins.bytes: ...  # the token's own bytes (its text can be a replacement character)


class Logprob(Alternative, Protocol):
    """A generated (or, echoed, a prompt) token with its log-probability (NaN: a prompt's first
    token, which nothing comes before) and the likeliest alternatives at its position."""

    @property
    def top(self) -> tuple[Alternative, ...]: ...


@dataclass(frozen=True, slots=True)
class Scored:
    """The log-probabilities of the tokens behind the events that follow it (up to the next
    `Scored` or `Finished` of its choice), sent only when the request asked for them. One group of
    tokens can make several events (reasoning, then text), so the scores travel apart from them."""

    tokens: tuple[Logprob, ...]


@dataclass(frozen=True)
class Finished:
    reason: str  # stop | length | tool_calls | content_filter
    calls: tuple[ToolCall, ...] = ()  # every complete call of the answer
    whole: bool = True  # False: a constrained (tool) answer cut short before it closed
    reasoning_tokens: int = 0  # of the generated tokens, those of the reasoning (models that think)
    usage: Usage | None = None  # None: the engine did not count it
    stop_sequence: str | None = None  # the request's stop string that ended the answer


OutputEvent = TextDelta | ReasoningDelta | CallStarted | ArgumentsDelta | Scored | Finished
