"""OpenAI chat completions: the request -> the conversation model, and the neutral output events ->\nthe completion or its chunks."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from functools import partial

from gateway.api.errors import invalid
from gateway.api.images import image_part
from gateway.api.openai.common import (
    TextChunk,
    asked,
    chat_logprobs,
    check_stream_options,
    effort_level,
    usage_out,
    usage_so_far,
)
from gateway.api.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessageIn,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    FunctionCallOut,
    FunctionDelta,
    TextPart,
    ToolCallDelta,
    ToolCallOut,
    UsageOut,
)
from gateway.api.serving import Prepared, Service
from gateway.chat import images
from gateway.conversation import (
    CallStarted,
    Conversation,
    Finished,
    Logprob,
    Output,
    Part,
    ReasoningDelta,
    Scored,
    TextDelta,
    ToolCall,
    ToolChoice,
    ToolSpec,
    Turn,
    Usage,
)


def _parts(m: ChatMessageIn, i: int) -> tuple[Part, ...]:
    """A message's content in order: its text, and its images decoded and checked."""
    if not isinstance(m.content, list):
        return (Part("text", m.content),) if m.content else ()
    return tuple(Part("text", p.text) if isinstance(p, TextPart) else
                 image_part(partial(images.from_url, p.image_url.url), f"messages[{i}].content[{j}].image_url.url")
                 for j, p in enumerate(m.content))


def conversation(req: ChatCompletionRequest) -> Conversation:
    turns = tuple(
        Turn("system" if m.role == "developer" else m.role, _parts(m, i),
             tool_calls=tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or ()),
             tool_call_id=m.tool_call_id)
        for i, m in enumerate(req.messages)
    )
    tools = None
    if req.tools is not None:
        tools = tuple(ToolSpec(t.function.name, t.function.description or "", t.function.parameters) for t in req.tools)
    choice = None
    if isinstance(req.tool_choice, str):
        choice = ToolChoice(req.tool_choice)
    elif req.tool_choice is not None:
        choice = ToolChoice("named", req.tool_choice.function.name)
    output = None
    fmt = req.response_format
    if fmt is not None:
        js = fmt.json_schema
        output = Output(fmt.type, js.schema_ if js is not None else None, js.name if js is not None else "response",
                        js.strict if js is not None else None)
    sampling = replace(asked(req, req.max_completion_tokens or req.max_tokens), logprobs=req.logprobs,
                       top_logprobs=req.top_logprobs or 0)
    return Conversation(turns, tools, choice, req.parallel_tool_calls is not False, output, thinking(req), sampling,
                        params={"tool_choice.name": "tool_choice.function.name", "output.schema": "response_format.json_schema"},
                        effort=effort_level(req.reasoning_effort))


def thinking(req: ChatCompletionRequest) -> bool | None:
    """What the request asks of a model that thinks: None, its default."""
    kwargs = req.chat_template_kwargs or {}
    other = sorted(set(kwargs) - {"enable_thinking"})
    if other:
        raise invalid(f"chat_template_kwargs: only enable_thinking is supported, not {', '.join(other)}",
                      param="chat_template_kwargs")
    enable = kwargs.get("enable_thinking")
    if enable is not None and not isinstance(enable, bool):
        raise invalid("chat_template_kwargs.enable_thinking must be a boolean", param="chat_template_kwargs")
    if req.reasoning_effort == "none":
        if enable:
            raise invalid("reasoning_effort 'none' and enable_thinking true disagree", param="reasoning_effort")
        return False
    return enable


def checked_conversation(req: ChatCompletionRequest) -> Conversation:
    """The request as the conversation model, after the checks the schema cannot make."""
    conv = conversation(req)
    if req.top_logprobs and not req.logprobs:
        raise invalid("top_logprobs requires logprobs to be true", param="top_logprobs")
    check_stream_options(req)
    if req.max_tokens is not None and req.max_completion_tokens is not None and req.max_tokens != req.max_completion_tokens:
        raise invalid("max_tokens and max_completion_tokens disagree; send one", param="max_tokens")
    for i, m in enumerate(req.messages):
        if m.role == "assistant" and m.content is None and not m.tool_calls:
            raise invalid("assistant messages need content or tool_calls", param=f"messages[{i}].content")
        if m.role == "tool" and not m.tool_call_id:
            raise invalid("tool messages need tool_call_id", param=f"messages[{i}].tool_call_id")
        if m.tool_calls and m.role != "assistant":
            raise invalid("only assistant messages carry tool_calls", param=f"messages[{i}].tool_calls")
    return conv


class ChatService(Service):
    async def prepare_chat(self, req: ChatCompletionRequest, received: float) -> Prepared:
        spec = self.spec(req.model)
        return await self.prepare_conversation(spec, checked_conversation(req), req.n, "chatcmpl", received)

    async def apply_template(self, req: ChatCompletionRequest) -> str:
        """The prompt a chat request renders to (llama-server's /apply-template): what the engine gets."""
        spec = self.spec(req.model)
        rendered = await self.render(spec, checked_conversation(req))
        return rendered.request.prompt or ""

    async def complete(self, p: Prepared, model: str) -> ChatCompletion:
        """A whole answer: its text, or its calls (the complete ones, up to the first repeat)."""
        c = await self.collect(p)
        want_lp = p.wants_logprobs
        native = p.tool_plan is not None and p.tool_plan.native
        choices = []
        for i in range(len(p.requests)):
            out = [ToolCallOut(id=t.id, function=FunctionCallOut(name=t.name, arguments=t.arguments))
                   for t in c.calls[i]]
            if out:
                said = c.texts[i].strip() if native else c.texts[i]
                message = AssistantMessage(content=said or None, tool_calls=out)
            else:  # the text; a tool answer's response, or (cut short by max_tokens) what the model wrote
                message = AssistantMessage(content=c.texts[i] if c.whole[i] else c.raw[i])
            if p.reasoning is not None and p.reasoning.split:
                message.reasoning_content = c.reasoning[i] or None
            choices.append(ChatChoice(index=i, message=message, finish_reason=c.finish[i],
                                      logprobs=ChoiceLogprobs(content=chat_logprobs(c.tokens[i])) if want_lp else None))
        return ChatCompletion(id=p.response_id, created=p.created, model=model, choices=choices, usage=usage_out(c.usages))

    async def stream(self, p: Prepared, model: str, include_usage: bool,
                     continuous_usage: bool = False) -> AsyncIterator[str]:
        """Chunks of the answer: text as content; a tool call's id, type and name once, then its
        arguments in fragments (their concatenation is exactly the final arguments text).
        `continuous_usage`: each choice's chunk carries its usage so far."""
        started: set[int] = set()
        usages: list[Usage] = []
        want_lp = p.wants_logprobs
        scored: tuple[Logprob, ...] = ()  # the logprobs of the tokens behind the next delta

        def chunk(choices: list[ChunkChoice], usage: UsageOut | None = None) -> str:
            if usage is None and continuous_usage and choices:
                usage = usage_so_far(p, choices[0].index)
            c = ChatCompletionChunk(id=p.response_id, created=p.created, model=model, choices=choices, usage=usage)
            return c.model_dump_json(exclude=None if include_usage else {"usage"})

        # Most chunks are "one more piece of text": render those from a template made once per
        # choice by the same pydantic models, instead of building three models per token.
        templates: dict[int, TextChunk] = {}

        def text_chunk(i: int, text: str) -> str:
            t = templates.get(i)
            if t is None:
                t = templates[i] = TextChunk(lambda s: chunk([ChunkChoice(index=i, delta=Delta(content=s))]))
            return t(text)

        async with contextlib.aclosing(self.conversation_events(p)) as events:
            async for i, e in events:
                if i not in started:
                    # OpenAI's first chunk of a choice names the role alone; the text follows.
                    started.add(i)
                    yield chunk([ChunkChoice(index=i, delta=Delta(role="assistant", content=""))])
                if isinstance(e, Scored):
                    scored = e.tokens
                    continue
                if isinstance(e, Finished):
                    scored = ()  # a last step with no delta of its own: its logprobs are not streamed
                    if e.usage is not None:
                        usages.append(e.usage)
                    yield chunk([ChunkChoice(index=i, delta=Delta(), finish_reason=e.reason)])
                    continue
                # A step's logprobs go with the first delta its tokens made.
                lp = ChoiceLogprobs(content=chat_logprobs(scored)) if want_lp and scored else None
                scored = ()
                if isinstance(e, TextDelta):
                    if lp is None and not continuous_usage:
                        if e.text:
                            yield text_chunk(i, e.text)
                        continue
                    delta = Delta(content=e.text)
                elif isinstance(e, ReasoningDelta):
                    delta = Delta(reasoning_content=e.text)
                elif isinstance(e, CallStarted):
                    delta = Delta(tool_calls=[ToolCallDelta(
                        index=e.call, id=e.id, type="function", function=FunctionDelta(name=e.name, arguments=""))])
                else:
                    delta = Delta(tool_calls=[ToolCallDelta(index=e.call, function=FunctionDelta(arguments=e.text))])
                yield chunk([ChunkChoice(index=i, delta=delta, logprobs=lp)])
        if include_usage:
            yield chunk([], usage_out(usages))
