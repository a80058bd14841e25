"""OpenAI requests <-> engine requests: validation, driving the engine, building responses.

Routes call `ChatService` / `CompletionService`; engines only ever see `GenerationRequest`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from engines.base import (
    ChatMessage,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
    Usage,
)
from gateway.api import tools
from gateway.api.admission import Admission, Ticket
from gateway.api.errors import APIError, ServerShutdown, invalid, record
from gateway.api.guards import Drain
from gateway.api.openai import chat as openai_chat
from gateway.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChoiceLogprobs,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionTokensDetails,
    Delta,
    FunctionCallOut,
    FunctionDelta,
    PromptTokensDetails,
    TokenLogprobOut,
    ToolCallDelta,
    ToolCallOut,
    TopLogprobOut,
    UsageOut,
)
from gateway.conversation import (
    ArgumentsDelta,
    CallStarted,
    Conversation,
    Finished,
    OutputEvent,
    TextDelta,
    ToolCall,
)
from gateway.metrics import Metrics, RequestObserver
from gateway.models.pool import Loaded, ModelManager
from gateway.models.registry import ModelSpec, Registry


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    out = []
    for k, v in (bias or {}).items():
        try:
            out.append((int(k), float(v)))
        except ValueError:
            raise invalid(f"logit_bias keys must be token ids, got {k!r}", param="logit_bias") from None
    return tuple(out)


def _sampling(req: ChatCompletionRequest | CompletionRequest, spec: ModelSpec, max_tokens: int | None) -> SamplingParams:
    d = spec.defaults
    return SamplingParams(
        temperature=req.temperature if req.temperature is not None else (d.temperature if d.temperature is not None else 1.0),
        top_p=req.top_p if req.top_p is not None else (d.top_p if d.top_p is not None else 1.0),
        top_k=req.top_k if req.top_k is not None else (d.top_k if d.top_k is not None else DEFAULT_TOP_K),
        min_p=req.min_p if req.min_p is not None else (d.min_p or 0.0),
        repeat_penalty=req.repeat_penalty if req.repeat_penalty is not None else (d.repeat_penalty or 1.0),
        seed=req.seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        max_tokens=max_tokens if max_tokens is not None else d.max_tokens,
        stop=_stops(req.stop),
        logit_bias=_logit_bias(req.logit_bias),
        ignore_eos=req.ignore_eos,
    )


def _fan_out(base: GenerationRequest, n: int) -> list[GenerationRequest]:
    """n independent samples; a fixed seed gives each choice its own reproducible seed."""
    out = []
    for i in range(n):
        sp = base.sampling
        if sp.seed is not None and i:
            sp = replace(sp, seed=sp.seed + i)
        out.append(replace(base, request_id=f"{base.request_id}-{i}", sampling=sp))
    return out


def _bytes(b: bytes) -> list[int]:
    return list(b)


def _chat_logprobs(items: tuple[TokenLogprob, ...]) -> list[TokenLogprobOut]:
    return [
        TokenLogprobOut(
            token=t.token,
            logprob=t.logprob,
            bytes=_bytes(t.bytes),
            top_logprobs=[TopLogprobOut(token=x.token, logprob=x.logprob, bytes=_bytes(x.bytes)) for x in t.top],
        )
        for t in items
    ]


def _usage(usages: list[Usage]) -> UsageOut:
    # n choices share one prompt: OpenAI counts the prompt once and sums completions.
    prompt = usages[0].prompt_tokens if usages else 0
    completion = sum(u.completion_tokens for u in usages)
    cached = usages[0].cached_tokens if usages else 0
    drafted = sum(u.draft_tokens for u in usages)
    accepted = sum(u.accepted_draft_tokens for u in usages)
    return UsageOut(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        completion_tokens_details=CompletionTokensDetails(
            accepted_prediction_tokens=accepted, rejected_prediction_tokens=drafted - accepted
        ) if drafted else None,
    )


async def _merge(streams: list[AsyncIterator[TokenEvent]]) -> AsyncIterator[tuple[int, TokenEvent]]:
    """Interleave several engine streams as (choice index, event)."""
    if len(streams) == 1:
        async for ev in streams[0]:
            yield 0, ev
        return
    queue: asyncio.Queue[tuple[int, TokenEvent | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, s: AsyncIterator[TokenEvent]) -> None:
        try:
            async for ev in s:
                await queue.put((i, ev))
            await queue.put((i, None))
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(streams)
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class TextChunk:
    """A stream chunk rendered once with a placeholder; each token's text is then spliced in."""

    SLOT = "@@gateway-text@@"

    def __init__(self, render: Callable[[str], str]) -> None:
        self.head, found, self.tail = render(self.SLOT).partition(f'"{self.SLOT}"')
        assert found, "the placeholder must appear once, as a JSON string"

    def __call__(self, text: str) -> str:
        return self.head + json.dumps(text, ensure_ascii=False) + self.tail


# OpenAI has no top_k; like llama-server and Ollama we cut to the 40 likeliest tokens unless the
# request or models.yaml says otherwise (top_k: 0 turns it off). Besides being their default, it
# keeps top-p from sorting the whole vocabulary for every sequence at every step, which the
# profile showed was most of a decode step on a GPU at 16 streams.
DEFAULT_TOP_K = 40


def _header_value(text: str, limit: int = 1024) -> str:
    """HTTP header values are Latin-1 and one line; reasons are free text."""
    flat = " ".join(text.split())
    return flat.encode("ascii", "replace").decode()[:limit]


# Called once a request finished normally: (engine it ran on, prompt ids, choice 0's generated ids).
CompletionHook = Callable[[Loaded, tuple[int, ...], tuple[int, ...]], object]


@dataclass
class Prepared:
    """A validated request, bound to a loaded engine and holding its slots, ready to run."""

    loaded: Loaded
    requests: list[GenerationRequest]
    response_id: str
    observer: RequestObserver
    ticket: Ticket | None = None
    drain: Drain | None = None
    tool_plan: tools.ToolPlan | None = None  # the output is a constrained tool-call answer
    skipped_tools: tuple[str, ...] = ()  # tools left out: the model does not call tools (models.yaml)
    created: int = field(default_factory=lambda: int(time.time()))
    on_complete: CompletionHook | None = None

    @property
    def headers(self) -> dict[str, str]:
        c = self.loaded.candidate
        out = {"X-Engine": c.label, "X-Device": _header_value(c.device)}
        if self.loaded.fallback_reason:
            out["X-Fallback-Reason"] = _header_value(self.loaded.fallback_reason)
        if self.skipped_tools:
            out["X-Skipped-Tools"] = _header_value(", ".join(self.skipped_tools))
        return out

    def release(self) -> None:
        """Give the request's slots back (idempotent)."""
        if self.ticket is not None:
            self.ticket.release()

    async def events(self) -> AsyncGenerator[tuple[int, TokenEvent], None]:
        """The engine's events, timed by the request's observer, which records the outcome."""
        finish: str | None = None
        prompt_ids: tuple[int, ...] = ()
        output_ids: list[int] = []
        drain = self.drain
        try:
            async for i, ev in _merge([self.loaded.engine.generate(r) for r in self.requests]):
                if drain is not None and drain.expired:
                    raise ServerShutdown()
                self.observer.on_event(i, ev)
                if finish is None and ev.finish_reason is not None:
                    finish = ev.finish_reason
                if i == 0 and self.on_complete is not None:
                    output_ids.extend(ev.token_ids)
                    if ev.usage is not None:
                        prompt_ids = ev.usage.prompt_ids
                yield i, ev
        except (asyncio.CancelledError, GeneratorExit):
            self.observer.finish("cancelled", 499)
            raise
        except Exception as exc:
            # Once the drain time is up, whatever ended it, the shutdown did (it may have stopped the engine).
            ended: Exception = ServerShutdown() if drain is not None and drain.expired else exc
            raise record(self.observer, ended) from exc
        finally:
            self.release()
        self.observer.finish(finish or "stop")
        if self.on_complete is not None and prompt_ids and output_ids:
            self.on_complete(self.loaded, prompt_ids, tuple(output_ids))


@dataclass
class _Collected:
    """A whole (non-stream) answer, per choice, from the neutral output events."""

    texts: list[str]  # the answer's text (a tool answer's response, or text beside native calls)
    raw: list[str]  # what the model wrote (a tool answer cut short is returned as it is)
    tokens: list[list[TokenLogprob]]
    finish: list[str | None]
    calls: list[tuple[ToolCall, ...]]
    whole: list[bool]
    usages: list[Usage]


def model_spec(registry: Registry, model: str) -> ModelSpec:
    """The configured model a request names, or 404 in the envelope."""
    spec = registry.get(model)
    if spec is None:
        raise APIError(404, f"The model '{model}' does not exist", param="model", code="model_not_found")
    return spec


def check_prompt_chars(chars: int, limit: int, param: str, what: str) -> None:
    """The prompt-size limit, applied before tokenizing (400 `prompt_too_long`)."""
    if chars > limit:
        raise invalid(f"{what} {chars} characters, more than the limit of {limit}", param=param, code="prompt_too_long")


class _Service:
    def __init__(self, manager: ModelManager, metrics: Metrics, admission: Admission, drain: Drain,
                 on_complete: CompletionHook | None = None) -> None:
        self.manager = manager
        self.metrics = metrics
        self.admission = admission
        self.drain = drain
        self.on_complete = on_complete

    @staticmethod
    def check_stream_options(req: ChatCompletionRequest | CompletionRequest) -> None:
        if req.stream_options is not None and not req.stream:
            raise invalid("stream_options is only allowed when stream is true", param="stream_options")

    def spec(self, model: str) -> ModelSpec:
        spec = model_spec(self.manager.registry, model)
        if spec.embedding_only:
            raise invalid(f"the model '{model}' serves embeddings only (POST /v1/embeddings)", param="model",
                          code="model_not_supported")
        return spec

    async def prepare(self, spec: ModelSpec, base: GenerationRequest, n: int, prefix: str, received: float) -> Prepared:
        loaded = await self.manager.get(spec)
        c = loaded.candidate
        observer = self.metrics.observe(spec.id, f"{c.runtime}/{c.backend}", c.device, received)
        try:
            ticket = await self.admission.admit(spec.id, loaded.engine.info.parallel, n)
        except Exception as exc:
            raise record(observer, exc) from exc
        observer.admission_wait = ticket.waited_s
        self.metrics.admission_wait.labels(spec.id).observe(ticket.waited_s)
        rid = f"{prefix}-{uuid.uuid4().hex[:24]}"
        base = replace(base, request_id=rid)
        return Prepared(loaded, _fan_out(base, n), rid, observer, ticket, self.drain, on_complete=self.on_complete)

    async def conversation_events(self, p: Prepared) -> AsyncIterator[tuple[int, OutputEvent, TokenEvent]]:
        """The output as neutral events per choice (with the engine event that carried each: its
        logprobs and usage).

        A tool answer is parsed into calls, and each call is released once it is complete (its
        arguments still arrive as fragments that concatenate to the final text): so a call cut short
        by max_tokens never reaches the client, and the calls completed before it are kept (finish
        "tool_calls"). The answer ends at the first call that repeats an earlier one exactly (small
        models repeat a call until max_tokens): the repeat is dropped, and the rest of the generation
        is read without being shown so that the usage stays exact."""
        parsers: dict[int, tools.StreamParser | tools.HermesParser] = {}
        held: dict[int, list[OutputEvent]] = {}  # the call in progress, per choice
        released: dict[int, int] = {}  # calls given out, per choice
        ended: set[int] = set()  # choices whose answer ended at a repeat
        ids: dict[tuple[int, int], str] = {}
        kinds = {t.name: t.kind for t in p.tool_plan.tools} if p.tool_plan is not None else {}

        def finished(i: int, reason: str | None, whole: bool) -> Finished:
            parser = parsers[i]
            calls = tuple(ToolCall(ids[(i, k)], n, a or "{}", kinds.get(n, "function"))
                          for k, (n, a) in enumerate(parser.calls[:released.get(i, 0)]))
            return Finished("tool_calls" if calls else (reason or "stop"), calls, whole)

        def release(i: int) -> list[OutputEvent] | None:
            """The held call is complete: its events, or None when it repeats an earlier call."""
            parser, n = parsers[i], released.get(i, 0)
            if _first_repeat(parser.calls[:n + 1]) is not None:
                ended.add(i)
                return None
            released[i] = n + 1
            out, held[i] = held.get(i, []), []
            return out

        async with contextlib.aclosing(p.events()) as events:
            async for i, ev in events:
                if p.tool_plan is None:
                    if ev.text or ev.logprobs:
                        yield i, TextDelta(ev.text), ev
                    if ev.finish_reason is not None:
                        yield i, Finished(ev.finish_reason), ev
                    continue
                parser = parsers.get(i)
                if parser is None:
                    parser = parsers[i] = p.tool_plan.parser()
                if i in ended:
                    if ev.finish_reason is not None:
                        yield i, finished(i, ev.finish_reason, True), ev
                    continue
                for e in parser.feed(ev.text):
                    if i in ended:
                        break
                    if isinstance(e, tools.CallStarted):
                        if held.get(i):
                            out = release(i)
                            if out is None:
                                break
                            for x in out:
                                yield i, x, ev
                        ids[(i, e.index)] = _call_id()
                        held[i] = [CallStarted(e.index, ids[(i, e.index)], e.name, kinds.get(e.name, "function"))]
                    elif isinstance(e, tools.ArgumentsDelta):
                        held.setdefault(i, []).append(ArgumentsDelta(e.index, e.text))
                    else:
                        yield i, TextDelta(e.text), ev
                if i not in ended and parser.done and held.get(i):
                    out = release(i)
                    for x in out or ():
                        yield i, x, ev
                if ev.finish_reason is not None and i not in ended:
                    for e in parser.flush():  # a partial tag held back is text after all
                        if isinstance(e, tools.ContentDelta):
                            yield i, TextDelta(e.text), ev
                    yield i, finished(i, ev.finish_reason, parser.done), ev
                elif ev.finish_reason is not None:
                    yield i, finished(i, ev.finish_reason, True), ev

    async def collect(self, p: Prepared) -> _Collected:
        n = len(p.requests)
        out = _Collected([""] * n, [""] * n, [[] for _ in range(n)], [None] * n, [()] * n, [True] * n, [])
        last: dict[int, TokenEvent] = {}
        async with contextlib.aclosing(self.conversation_events(p)) as events:
            async for i, e, ev in events:
                if last.get(i) is not ev:  # one engine event can carry several output events
                    last[i] = ev
                    out.raw[i] += ev.text
                    out.tokens[i] += ev.logprobs
                if isinstance(e, TextDelta):
                    out.texts[i] += e.text
                elif isinstance(e, Finished):
                    out.finish[i], out.calls[i], out.whole[i] = e.reason, e.calls, e.whole
                    if ev.usage is not None:
                        out.usages.append(ev.usage)
        return out


class ChatService(_Service):
    async def prepare_chat(self, req: ChatCompletionRequest, received: float) -> Prepared:
        spec = self.spec(req.model)
        conv = openai_chat.conversation(req)
        if req.top_logprobs and not req.logprobs:
            raise invalid("top_logprobs requires logprobs to be true", param="top_logprobs")
        self.check_stream_options(req)
        if req.max_tokens is not None and req.max_completion_tokens is not None and req.max_tokens != req.max_completion_tokens:
            raise invalid("max_tokens and max_completion_tokens disagree; send one", param="max_tokens")
        limits = self.manager.settings
        if len(req.messages) > limits.max_messages:
            raise invalid(f"{len(req.messages)} messages exceed the limit of {limits.max_messages}",
                          param="messages", code="too_many_messages")
        check_prompt_chars(sum(len(m.text()) for m in req.messages), limits.max_prompt_chars, "messages",
                           "the messages hold")
        for i, m in enumerate(req.messages):
            if m.role == "assistant" and m.content is None and not m.tool_calls:
                raise invalid("assistant messages need content or tool_calls", param=f"messages[{i}].content")
            if m.role == "tool" and not m.tool_call_id:
                raise invalid("tool messages need tool_call_id", param=f"messages[{i}].tool_call_id")
            if m.tool_calls and m.role != "assistant":
                raise invalid("only assistant messages carry tool_calls", param=f"messages[{i}].tool_calls")
        sp = _sampling(req, spec, req.max_completion_tokens or req.max_tokens)
        sp = replace(sp, logprobs=req.logprobs, top_logprobs=req.top_logprobs or 0)
        return await self.prepare_conversation(spec, conv, sp, req.n, "chatcmpl", received)

    async def prepare_conversation(self, spec: ModelSpec, conv: Conversation, sp: SamplingParams, n: int,
                                   prefix: str, received: float) -> Prepared:
        """Any protocol's request, as the conversation model: the tool plan, the prompt, the output
        constraint; then a loaded engine and slots."""
        skipped: tuple[str, ...] = ()
        if conv.tools and not spec.tools and (conv.tool_choice is None or conv.tool_choice.mode != "none"):
            if conv.tool_choice is not None and conv.tool_choice.mode in ("required", "named"):
                raise invalid(f"model {spec.id!r} does not call tools (models.yaml sets tools: false), so "
                              f"tool_choice {conv.tool_choice.mode!r} cannot be met", param=conv.param("tool_choice"))
            skipped = tuple(t.name for t in conv.tools)
            conv = replace(conv, tools=None, tool_choice=None)
        native = ""
        if conv.tools and (conv.tool_choice is None or conv.tool_choice.mode != "none"):
            # The serving template decides the tool format: its own (rendered by the template) or ours.
            native = (await self.manager.get(spec)).engine.info.extra.get("tool_format", "")
        try:
            tool_plan = tools.plan(conv, native)
        except tools.ToolRequestError as exc:
            raise invalid(str(exc), param=exc.param) from None
        tools_json = None
        if tool_plan is not None and tool_plan.native:
            messages = tools.render_native(conv)
            tools_json = tools.tools_json(conv)
        elif native and conv.uses_tool_history:
            messages = tools.render_native(conv)
        elif tool_plan is not None or conv.uses_tool_history:
            messages = tools.render(conv, tool_plan)
        else:
            messages = [ChatMessage(role=t.role, content=t.text) for t in conv.turns]
        fmt = conv.output
        if tool_plan is not None:
            # The response branch of the schema carries the output format's schema.
            sp = replace(sp, structured="json_schema", json_schema=json.dumps(tool_plan.schema), tools=True,
                         tool_format=tool_plan.native or None, tool_mode=tool_plan.choice.mode,
                         max_tool_calls=tool_plan.max_calls)
        elif fmt is not None and fmt.type != "text":
            schema = None
            if fmt.type == "json_schema":
                if fmt.schema is None:
                    raise invalid("a json_schema format needs its schema", param=conv.param("output.schema"))
                schema = json.dumps(fmt.schema)
            sp = replace(sp, structured=fmt.type, json_schema=schema)
        base = GenerationRequest(request_id="", sampling=sp, messages=tuple(messages), tools_json=tools_json)
        p = await self.prepare(spec, base, n, prefix, received)
        p.tool_plan = tool_plan
        p.skipped_tools = skipped
        return p

    async def complete(self, p: Prepared, model: str) -> ChatCompletion:
        """A whole answer: its text, or its calls (the complete ones, up to the first repeat)."""
        c = await self.collect(p)
        want_lp = p.requests[0].sampling.logprobs
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
            choices.append(ChatChoice(index=i, message=message, finish_reason=c.finish[i],
                                      logprobs=ChoiceLogprobs(content=_chat_logprobs(tuple(c.tokens[i]))) if want_lp else None))
        return ChatCompletion(id=p.response_id, created=p.created, model=model, choices=choices, usage=_usage(c.usages))

    async def stream(self, p: Prepared, model: str, include_usage: bool) -> AsyncIterator[str]:
        """Chunks of the answer: text as content; a tool call's id, type and name once, then its
        arguments in fragments (their concatenation is exactly the final arguments text)."""
        started: set[int] = set()
        usages: list[Usage] = []
        want_lp = p.requests[0].sampling.logprobs
        last: dict[int, TokenEvent] = {}

        def chunk(choices: list[ChunkChoice], usage: UsageOut | None = None) -> str:
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
            async for i, e, ev in events:
                first = i not in started
                started.add(i)
                if isinstance(e, Finished):
                    if ev.usage is not None:
                        usages.append(ev.usage)
                    if first:
                        yield chunk([ChunkChoice(index=i, delta=Delta(role="assistant"))])
                    yield chunk([ChunkChoice(index=i, delta=Delta(), finish_reason=e.reason)])
                    continue
                lp = None
                if want_lp and ev.logprobs and last.get(i) is not ev:  # an engine event's logprobs once
                    lp = ChoiceLogprobs(content=_chat_logprobs(ev.logprobs))
                last[i] = ev
                if isinstance(e, TextDelta):
                    if not first and lp is None:
                        if e.text:
                            yield text_chunk(i, e.text)
                        continue
                    delta = Delta(role="assistant" if first else None, content=e.text)
                elif isinstance(e, CallStarted):
                    delta = Delta(role="assistant" if first else None, tool_calls=[ToolCallDelta(
                        index=e.call, id=e.id, type="function", function=FunctionDelta(name=e.name, arguments=""))])
                else:
                    delta = Delta(role="assistant" if first else None,
                                  tool_calls=[ToolCallDelta(index=e.call, function=FunctionDelta(arguments=e.text))])
                yield chunk([ChunkChoice(index=i, delta=delta, logprobs=lp)])
        if include_usage:
            yield chunk([], _usage(usages))


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _first_repeat(calls: list[tuple[str, str]]) -> int | None:
    """The position of the first call identical (name and arguments, ignoring spacing) to an earlier one."""
    seen: set[tuple[str, str]] = set()
    for k, (name, args) in enumerate(calls):
        try:
            key = (name, json.dumps(json.loads(args or "{}"), sort_keys=True))
        except ValueError:
            key = (name, args)
        if key in seen:
            return k
        seen.add(key)
    return None


class CompletionService(_Service):
    async def prepare_completion(self, req: CompletionRequest, received: float) -> Prepared:
        spec = self.spec(req.model)
        if req.echo:
            raise invalid("echo is not supported", param="echo")
        if req.suffix:
            raise invalid("suffix (fill-in-the-middle) is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise invalid("best_of must equal n (ranking by log probability is not supported)", param="best_of")
        self.check_stream_options(req)
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if len(prompts) != 1:
            raise invalid("only one prompt per request is supported; send a string", param="prompt")
        check_prompt_chars(len(prompts[0]), self.manager.settings.max_prompt_chars, "prompt", "the prompt holds")
        sp = _sampling(req, spec, req.max_tokens)
        if req.logprobs is not None:
            sp = replace(sp, logprobs=True, top_logprobs=req.logprobs)
        base = GenerationRequest(request_id="", sampling=sp, prompt=prompts[0])
        return await self.prepare(spec, base, req.n, "cmpl", received)

    async def complete(self, p: Prepared, model: str) -> Completion:
        c = await self.collect(p)
        want_lp = p.requests[0].sampling.logprobs
        choices = [
            CompletionChoice(
                index=i,
                text=c.texts[i],
                logprobs=_completion_logprobs(c.tokens[i], 0) if want_lp else None,
                finish_reason=c.finish[i],
            )
            for i in range(len(p.requests))
        ]
        return Completion(id=p.response_id, created=p.created, model=model, choices=choices, usage=_usage(c.usages))

    async def stream(self, p: Prepared, model: str, include_usage: bool) -> AsyncIterator[str]:
        usages: list[Usage] = []
        want_lp = p.requests[0].sampling.logprobs
        offsets = [0] * len(p.requests)

        def chunk(choices: list[CompletionChoice], usage: UsageOut | None = None) -> str:
            c = Completion(id=p.response_id, created=p.created, model=model, choices=choices, usage=usage)
            return c.model_dump_json(exclude=None if include_usage else {"usage"})

        async with contextlib.aclosing(self.conversation_events(p)) as events:
            async for i, e, ev in events:
                if isinstance(e, Finished):
                    if ev.usage is not None:
                        usages.append(ev.usage)
                    yield chunk([CompletionChoice(index=i, text="", finish_reason=e.reason)])
                elif isinstance(e, TextDelta):  # (a prompt has no tools: text only, one per engine event)
                    lp = _completion_logprobs(list(ev.logprobs), offsets[i]) if want_lp and ev.logprobs else None
                    if lp is not None:
                        offsets[i] = lp.text_offset[-1] + len(lp.tokens[-1])
                    yield chunk([CompletionChoice(index=i, text=e.text, logprobs=lp, finish_reason=None)])
        if include_usage:
            yield chunk([], _usage(usages))


def _completion_logprobs(items: list[TokenLogprob], start: int) -> CompletionLogprobs:
    offsets = []
    pos = start
    for t in items:
        offsets.append(pos)
        pos += len(t.token)
    return CompletionLogprobs(
        tokens=[t.token for t in items],
        token_logprobs=[t.logprob for t in items],
        top_logprobs=[{x.token: x.logprob for x in t.top} for t in items],
        text_offset=offsets,
    )
