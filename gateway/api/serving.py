"""The protocol-neutral core of serving a request: the conversation model -> the tool plan, the
prompt and the output constraint -> a loaded engine with slots (`Prepared`), and its output as
neutral events (`Service.conversation_events`, `Service.collect`).

Each protocol is an adapter over `Service` (gateway/api/openai/, anthropic/, ollama/); engines only
ever see `GenerationRequest`, and adapters only the neutral types of gateway.conversation: the
engine's output is converted to them in this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from engines.base import Constraint, Engine, GenerationRequest, SamplingParams, TokenEvent
from engines.base import Usage as EngineUsage
from gateway.api import reasoning, sampling, tools
from gateway.api.admission import Admission, Ticket
from gateway.api.errors import APIError, ServerShutdown, invalid, record
from gateway.api.failover import FailoverPolicy, resumable
from gateway.api.guards import Drain
from gateway.api.images import check_images, fetch_images, placed, refuse_images
from gateway.api.notes import header_value
from gateway.chat import formats
from gateway.chat.formats import base as parts
from gateway.chat.formats.base import Format, Reader
from gateway.chat.template import ChatMessage, ChatTemplate, TemplateError, Traits, template_of
from gateway.conversation import (
    ArgumentsDelta,
    CallStarted,
    Conversation,
    Finished,
    Logprob,
    Output,
    OutputEvent,
    ReasoningDelta,
    Sampling,
    Scored,
    TextDelta,
    ToolCall,
    Usage,
    with_preamble,
)
from gateway.metrics import Metrics, RequestObserver
from gateway.models.pool import Loaded, ModelManager
from gateway.models.registry import ModelSpec, Registry


def _fan_out(base: GenerationRequest, n: int) -> list[GenerationRequest]:
    """n independent samples; a fixed seed gives each choice its own reproducible seed."""
    out = []
    for i in range(n):
        sp = base.sampling
        if sp.seed is not None and i:
            sp = replace(sp, seed=sp.seed + i)
        out.append(replace(base, request_id=f"{base.request_id}-{i}", sampling=sp))
    return out


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


# --- the engine's output -> the neutral types the adapters read (made here only) -------------------
# The engine's scored tokens already have the neutral `Logprob` shape: they pass as they are.


def usage_of(u: EngineUsage) -> Usage:
    """A choice's usage, as the protocols report it."""
    return Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.draft_tokens, u.accepted_draft_tokens,
                 u.failovers)


# Called once a request finished normally: (engine it ran on, prompt ids, choice 0's generated ids,
# the prompt's images).
CompletionHook = Callable[[Loaded, tuple[int, ...], tuple[int, ...], tuple[bytes, ...]], object]


@dataclass(frozen=True)
class Rendered:
    """A conversation as the engine gets it, and how its output is read back."""

    request: GenerationRequest
    tool_plan: tools.ToolPlan | None  # the output is a constrained tool-call answer
    skipped_tools: tuple[str, ...]  # tools left out: the model does not call tools (models.yaml)
    reasoning: reasoning.ReasoningPlan | None  # None: the model does not reason
    format: Format  # the model family's format of calls and reasoning


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
    reasoning: reasoning.ReasoningPlan | None = None  # None: the model does not reason
    format: Format = formats.GENERIC  # the model family's format of calls and reasoning
    created: int = field(default_factory=lambda: int(time.time()))
    on_complete: CompletionHook | None = None
    # How each choice's engine stream is opened (with failover); None: the engine's own generate.
    stream: Callable[[GenerationRequest], AsyncIterator[TokenEvent]] | None = None
    failovers: int = 0  # the most times a choice continued on another engine (X-Failover)
    # Counted as the events pass (per-chunk usage, stream_options.continuous_usage_stats):
    generated: dict[int, int] = field(default_factory=dict)  # tokens so far, per choice
    prompt_tokens: int = 0  # the prompt's tokens, once an engine said (its first or last event)
    cached_tokens: int = 0  # of those, served from a cache (once an engine said)
    # Each choice's prompt tokens with their logprobs (SamplingParams.prompt_logprobs), as its engine scored them.
    prompt_logprobs: dict[int, tuple[Logprob, ...]] = field(default_factory=dict)
    usages: dict[int, Usage] = field(default_factory=dict)  # each choice's, once it finished
    n: int = 1  # choices per prompt (requests[k * n: (k + 1) * n] share a prompt)
    echo: list[str | None] | None = None  # completions' echo: each choice's prompt text (None: its tokens' text)

    @property
    def headers(self) -> dict[str, str]:
        c = self.loaded.candidate
        out = {"X-Engine": c.label, "X-Device": header_value(c.device)}
        if self.loaded.fallback_reason:
            out["X-Fallback-Reason"] = header_value(self.loaded.fallback_reason)
        if self.skipped_tools:
            out["X-Skipped-Tools"] = header_value(", ".join(self.skipped_tools))
        if self.failovers:
            out["X-Failover"] = str(self.failovers)
        return out

    @property
    def wants_logprobs(self) -> bool:
        """Whether the request asked for each generated token's log-probability (its choices alike)."""
        return self.requests[0].sampling.logprobs

    @property
    def temperature(self) -> float:
        """The temperature it samples at: the request's, else the model's default, else the gateway's."""
        return self.requests[0].sampling.temperature

    @property
    def top_p(self) -> float:
        """Its top_p, chosen as the temperature is."""
        return self.requests[0].sampling.top_p

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
            open_stream = self.stream or self.loaded.engine.generate
            async for i, ev in _merge([open_stream(r) for r in self.requests]):
                if drain is not None and drain.expired:
                    raise ServerShutdown()
                if ev.usage is not None and ev.usage.failovers > self.failovers:
                    self.failovers = ev.usage.failovers
                self.observer.on_event(i, ev)
                self.generated[i] = self.generated.get(i, 0) + len(ev.token_ids)
                if ev.usage is not None:
                    self.usages[i] = usage_of(ev.usage)
                    self.prompt_tokens, self.cached_tokens = ev.usage.prompt_tokens, ev.usage.cached_tokens
                elif ev.prompt_tokens and not self.prompt_tokens:
                    self.prompt_tokens, self.cached_tokens = ev.prompt_tokens, ev.cached_tokens
                if ev.prompt_logprobs and i not in self.prompt_logprobs:
                    self.prompt_logprobs[i] = ev.prompt_logprobs
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
            self.on_complete(self.loaded, prompt_ids, tuple(output_ids), self.requests[0].images)


@dataclass
class _Collected:
    """A whole (non-stream) answer, per choice, from the neutral output events."""

    texts: list[str]  # the answer's text (a tool answer's response, or text beside native calls)
    reasoning: list[str]  # what a model that thinks wrote before its answer
    raw: list[str]  # what the model wrote (a tool answer cut short is returned as it is)
    tokens: list[list[Logprob]]
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


def check_limits(conv: Conversation, max_messages: int, max_prompt_chars: int) -> None:
    """The request limits, for every protocol's conversation (named as the protocol names the field)."""
    where = conv.param("messages")
    if len(conv.turns) > max_messages:
        raise invalid(f"{len(conv.turns)} messages exceed the limit of {max_messages}", param=where,
                      code="too_many_messages")
    check_prompt_chars(sum(len(t.text) + sum(len(c.arguments) for c in t.tool_calls) for t in conv.turns),
                       max_prompt_chars, where, f"'{where}' has")


class Service:
    def __init__(self, manager: ModelManager, metrics: Metrics, admission: Admission, drain: Drain,
                 on_complete: CompletionHook | None = None) -> None:
        self.manager = manager
        self.metrics = metrics
        self.admission = admission
        self.drain = drain
        self.on_complete = on_complete

    def spec(self, model: str) -> ModelSpec:
        spec = model_spec(self.manager.registry, model)
        if spec.embedding_only:
            raise invalid(f"the model '{model}' serves embeddings only, not generation", param="model",
                          code="model_not_supported")
        return spec

    async def prepare(self, spec: ModelSpec, base: GenerationRequest | list[GenerationRequest], n: int, prefix: str,
                      received: float) -> Prepared:
        """Slots for `n` choices of each request in `base` (one, or a batch of prompts), in that order."""
        bases = base if isinstance(base, list) else [base]
        raw = sum(len(b.prompt or "") for b in bases if not b.templated)
        check_prompt_chars(raw, self.manager.settings.max_prompt_chars, "prompt", "the prompt holds")
        loaded = await self.manager.get(spec)
        c = loaded.candidate
        observer = self.metrics.observe(spec.id, f"{c.runtime}/{c.backend}", c.device, received)
        try:
            ticket = await self.admission.admit(spec.id, loaded.engine.info.parallel, n * len(bases))
        except Exception as exc:
            raise record(observer, exc) from exc
        observer.admission_wait = ticket.waited_s
        self.metrics.admission_wait.labels(spec.id).observe(ticket.waited_s)
        rid = f"{prefix}-{uuid.uuid4().hex[:24]}"
        requests = [replace(r, request_id=f"{rid}-{k}") for k, r in enumerate(x for b in bases for x in _fan_out(b, n))]
        p = Prepared(loaded, requests, rid, observer, ticket, self.drain, on_complete=self.on_complete, n=n)
        settings = self.manager.settings
        if settings.failover_budget > 0:
            policy = FailoverPolicy(settings.failover_budget, settings.failover_wait, settings.failover_replay == "exact")

            async def current() -> Engine:
                return (await self.manager.get(spec)).engine

            def stream(r: GenerationRequest) -> AsyncIterator[TokenEvent]:
                return resumable(r, loaded.engine, current, policy, spec.id, self.metrics,
                                 lambda s: ticket.paused(r.request_id, s))

            p.stream = stream
        return p

    async def prepare_prompts(self, spec: ModelSpec, prompts: Sequence[str | Sequence[int]], asked: Sampling, n: int,
                              prefix: str, received: float, output: Output | None = None) -> Prepared:
        """Raw prompts (text, or token ids), no chat template: `n` choices of each, in that order."""
        sp = _constrained(sampling.resolve(asked, spec), output)
        bases = [GenerationRequest(request_id="", sampling=sp, prompt=x) if isinstance(x, str) else
                 GenerationRequest(request_id="", sampling=sp, prompt_ids=tuple(x)) for x in prompts]
        return await self.prepare(spec, bases, n, prefix, received)

    async def prepare_conversation(self, spec: ModelSpec, conv: Conversation, n: int, prefix: str,
                                   received: float) -> Prepared:
        """Any protocol's request, as the conversation model: rendered (`render`), then a loaded
        engine and slots."""
        r = await self.render(spec, conv)
        p = await self.prepare(spec, r.request, n, prefix, received)
        p.tool_plan = r.tool_plan
        p.skipped_tools = r.skipped_tools
        p.reasoning = r.reasoning
        p.format = r.format
        return p

    async def render(self, spec: ModelSpec, conv: Conversation) -> Rendered:
        """The sampler's settings, the tool plan, the output constraint and the prompt, rendered by
        the model's own template as the engine serving it reports it."""
        settings = self.manager.settings
        check_limits(conv, settings.max_messages, settings.max_prompt_chars)
        check_images(conv, settings.max_image_bytes)
        sp = sampling.resolve(conv.sampling, spec)
        conv = with_preamble(conv, spec.system, [(m.role, m.content) for m in spec.messages])
        skipped: tuple[str, ...] = ()
        if conv.tools and not spec.tools and (conv.tool_choice is None or conv.tool_choice.mode != "none"):
            if conv.tool_choice is not None and conv.tool_choice.mode in ("required", "named"):
                raise invalid(f"model {spec.id!r} does not call tools (models.yaml sets tools: false), so "
                              f"tool_choice {conv.tool_choice.mode!r} cannot be met", param=conv.param("tool_choice"))
            skipped = tuple(t.name for t in conv.tools)
            conv = replace(conv, tools=None, tool_choice=None)
        loaded = await self.manager.get(spec)
        info, template = loaded.engine.info, template_of(loaded.engine.info)
        refuse_images(conv, spec.id, info.capabilities)
        conv = await fetch_images(conv, settings.image_fetch, settings.max_image_bytes, settings.image_fetch_timeout)
        conv, images = placed(conv)
        fmt = await formats.prepared(spec.tool_format, template, loaded.config, self.manager.registry.cache_dir)
        try:
            tool_plan = tools.plan(conv, fmt)
        except tools.ToolRequestError as exc:
            raise invalid(str(exc), param=exc.param) from None
        template_tools = None
        if tool_plan is not None:
            messages = tool_plan.format.turns(conv, tool_plan.calls)
            if tool_plan.format.native:
                template_tools = tools.template_tools(conv)
        elif conv.uses_tool_history:
            # Past calls in the family's own shape (or rewritten, for a template without tools).
            messages = fmt.turns(conv, None)
        else:
            messages = [ChatMessage(role=t.role, content=t.text) for t in conv.turns]
        out = conv.output
        if tool_plan is not None:
            sp = replace(sp, constraint=tool_plan.constraint(info.capabilities.lazy_constraints))
        elif out is not None and out.type != "text":
            sp = _constrained(sp, out, conv.param("output.schema"))
        elif spec.grammar:
            sp = replace(sp, constraint=Constraint("grammar", grammar=spec.grammar, part="grammar"))
        # A JSON answer from the first token leaves no room to think (a native tool format starts
        # lazily; a models.yaml grammar is written for the whole output, thinking included).
        constrained = sp.constraint is not None and sp.constraint.part != "grammar" and not (
            tool_plan is not None and tool_plan.native and tool_plan.choice.mode == "auto")
        rplan = reasoning.plan(spec, template.traits if template is not None else Traits(), conv.thinking, constrained)
        thinking = rplan.thinking if rplan is not None else None
        text = await render_prompt(fmt, template, messages, template_tools, thinking, conv.effort)
        shown = fmt.shown
        if rplan is not None and rplan.tags is not None:
            shown, rplan = (*shown, *rplan.tags), rplan.opened_by(text)
        base = GenerationRequest(request_id="", sampling=sp, prompt=text, templated=True, affinity=_head(messages),
                                 shown=shown, images=images)
        return Rendered(base, tool_plan, skipped, rplan, fmt)

    async def conversation_events(self, p: Prepared) -> AsyncGenerator[tuple[int, OutputEvent], None]:
        """The output as neutral events, with the index of the choice each belongs to; `_Answers`
        says how they are made."""
        answers = _Answers(p)
        async with contextlib.aclosing(p.events()) as events:
            async for i, ev in events:
                for e in answers.events(i, ev):
                    yield i, e

    async def collect(self, p: Prepared) -> _Collected:
        """The whole answer of each choice, from the same neutral events a stream sends."""
        n = len(p.requests)
        out = _Collected([""] * n, [""] * n, [""] * n, [[] for _ in range(n)], [None] * n, [()] * n, [True] * n, [])
        answers = _Answers(p)
        async with contextlib.aclosing(p.events()) as events:
            async for i, ev in events:
                for e in answers.events(i, ev):
                    if isinstance(e, TextDelta):
                        out.texts[i] += e.text
                    elif isinstance(e, ReasoningDelta):
                        out.reasoning[i] += e.text
                    elif isinstance(e, Scored):
                        out.tokens[i] += e.tokens
                    elif isinstance(e, Finished):
                        out.finish[i], out.calls[i], out.whole[i] = e.reason, e.calls, e.whole
                        if e.usage is not None:
                            out.usages.append(e.usage)
        out.raw = [answers.raw(i) for i in range(n)]
        return out


class _Answers:
    """Engine events -> the neutral events of each choice: what adapters read of the engine's
    output (logprobs, usage, the stop sequence) is converted here, once per engine event.

    Reasoning is split from the answer (models that think). A tool answer is parsed into calls, and
    each call is released once it is complete (its arguments still arrive as fragments that
    concatenate to the final text): so a call cut short by max_tokens never reaches the client, and
    the calls completed before it are kept (finish "tool_calls"). The answer ends at the first call
    that repeats an earlier one exactly (small models repeat a call until max_tokens): the repeat is
    dropped, and the rest of the generation is read without being shown so that the usage stays
    exact."""

    def __init__(self, p: Prepared) -> None:
        self.usages = p.usages  # each choice's, converted as its last event passed
        self.plan = p.tool_plan
        self.rplan = p.reasoning
        self.format = p.tool_plan.format if p.tool_plan is not None else p.format
        self.readers: dict[int, Reader] = {}
        self.held: dict[int, list[OutputEvent]] = {}  # the call in progress, per choice
        self.released: dict[int, int] = {}  # calls given out, per choice
        self.ended: set[int] = set()  # choices whose answer ended at a repeat
        self.ids: dict[tuple[int, int], str] = {}
        self.kinds = {t.name: t.kind for t in p.tool_plan.tools} if p.tool_plan is not None else {}
        self.thought_tokens: dict[int, int] = {}
        self._split = self.rplan is not None and self.rplan.split
        self._opened = self.rplan is not None and self.rplan.opened
        self._tags = self.rplan.tags if self.rplan is not None else None
        # None: the text is the answer as it is (no tools, no reasoning to split off).
        self._reads = self.format.reader(None, self._split, self._opened) is not None or self.plan is not None

    def _reader(self, i: int) -> Reader:
        r = self.readers.get(i)
        if r is None:
            r = self.format.reader(self.plan.calls if self.plan is not None else None, self._split, self._opened,
                                   self._tags)
            assert r is not None
            self.readers[i] = r
        return r

    def events(self, i: int, ev: TokenEvent) -> list[OutputEvent]:
        """The events one engine event makes; its tokens' logprobs lead them, when it has any."""
        if not self._reads:
            out: list[OutputEvent] = []
            if ev.text or ev.logprobs:
                out.append(TextDelta(ev.text))
            if ev.finish_reason is not None:
                out.append(self._finished(i, ev, ev.finish_reason))
        elif self.plan is not None:
            out = self._tool_answer(i, ev)
        else:
            out = self._read(i, ev)
        if ev.logprobs and out:
            out.insert(0, Scored(ev.logprobs))
        return out

    def _parts(self, i: int, ev: TokenEvent) -> list[parts.Event]:
        """The reader's events for the engine event's text (the reader flushed at the end)."""
        r = self._reader(i)
        parts = r.feed(ev.text)
        if r.touched:
            self.thought_tokens[i] = self.thought_tokens.get(i, 0) + len(ev.token_ids)
        if ev.finish_reason is not None:
            parts += r.flush()
        return parts

    def _read(self, i: int, ev: TokenEvent) -> list[OutputEvent]:
        """An answer without tools: reasoning and text."""
        out: list[OutputEvent] = [ReasoningDelta(e.text) if isinstance(e, parts.ReasoningDelta) else TextDelta(e.text)
                                  for e in self._parts(i, ev) if isinstance(e, (parts.ReasoningDelta, parts.ContentDelta))]
        if ev.logprobs and not out:
            out.append(TextDelta(""))
        if ev.finish_reason is not None:
            out.append(self._finished(i, ev, ev.finish_reason))
        return out

    def raw(self, i: int) -> str:
        """A tool answer's text as the model wrote it, its reasoning aside (a call cut short is
        answered with it)."""
        r = self.readers.get(i)
        return r.answer if r is not None else ""

    def _finished(self, i: int, ev: TokenEvent, reason: str, calls: tuple[ToolCall, ...] = (),
                  whole: bool = True) -> Finished:
        """The choice's end, with what the engine said of it on its last event."""
        return Finished(reason, calls, whole, self.thought_tokens.get(i, 0),
                        self.usages.get(i) if ev.usage is not None else None, ev.stop_sequence)

    def _tool_finished(self, i: int, ev: TokenEvent, whole: bool) -> Finished:
        calls = tuple(ToolCall(self.ids[(i, k)], n, a or "{}", self.kinds.get(n, "function"))
                      for k, (n, a) in enumerate(self._reader(i).calls[:self.released.get(i, 0)]))
        return self._finished(i, ev, "tool_calls" if calls else (ev.finish_reason or "stop"), calls, whole)

    def _release(self, i: int) -> list[OutputEvent] | None:
        """The held call is complete: its events, or None when it repeats an earlier call."""
        calls, n = self._reader(i).calls, self.released.get(i, 0)
        if parts.first_repeat(calls[:n + 1]) is not None:
            self.ended.add(i)
            return None
        self.released[i] = n + 1
        out, self.held[i] = self.held.get(i, []), []
        return out

    def _tool_answer(self, i: int, ev: TokenEvent) -> list[OutputEvent]:
        reader = self._reader(i)
        out: list[OutputEvent] = []
        if i in self.ended:
            return [self._tool_finished(i, ev, True)] if ev.finish_reason is not None else []
        for e in self._parts(i, ev):
            if isinstance(e, parts.CallStarted):
                if self.held.get(i):
                    done = self._release(i)
                    if done is None:
                        break
                    out += done
                self.ids[(i, e.index)] = _call_id()
                self.held[i] = [CallStarted(e.index, self.ids[(i, e.index)], e.name, self.kinds.get(e.name, "function"))]
            elif isinstance(e, parts.ArgumentsDelta):
                self.held.setdefault(i, []).append(ArgumentsDelta(e.index, e.text))
            elif isinstance(e, parts.ReasoningDelta):
                out.append(ReasoningDelta(e.text))
            else:
                out.append(TextDelta(e.text))
        if i not in self.ended and reader.done and self.held.get(i):
            out += self._release(i) or []
        if ev.finish_reason is None:
            return out
        return out + [self._tool_finished(i, ev, True if i in self.ended else reader.done)]


def _constrained(sp: SamplingParams, fmt: Output | None, param: str = "format") -> SamplingParams:
    """The sampler held to an output format (a JSON object, or a JSON schema)."""
    if fmt is None or fmt.type == "text":
        return sp
    if fmt.type == "json_object":
        return replace(sp, constraint=Constraint("json", part="response_format"))
    if fmt.schema is None:
        raise invalid("a json_schema format needs its schema", param=param)
    return replace(sp, constraint=Constraint("json", schema=json.dumps(fmt.schema), part="response_format.json_schema"))


def _head(messages: list[ChatMessage]) -> str:
    """A conversation's start, to its first user turn, hashed: what its later turns share."""
    head: list[str] = []
    for m in messages:
        head.append(f"{m.role}\x00{m.content}")
        if m.role == "user":
            break
    return hashlib.blake2b("\x01".join(head).encode(), digest_size=16).hexdigest()


# Conversations longer than this (characters) are rendered off the event loop: a long render there
# would hold back every running stream's next token at once.
LONG_RENDER_CHARS = 16_384


async def render_prompt(fmt: Format, template: ChatTemplate | None, messages: list[ChatMessage],
                        template_tools: list[dict[str, Any]] | None, thinking: bool | None,
                        effort: str | None = None) -> str:
    """The conversation as the model's template (through its family's format) writes it."""
    if template is None:
        raise invalid("this model has no chat template, so it answers raw prompts only, not chat messages",
                      param="messages", code="invalid_value")

    def render() -> str:
        try:
            return fmt.render(template, messages, template_tools, thinking, effort)
        except TemplateError as exc:
            raise invalid(f"the model's chat template rejected the messages: {exc}", param="messages",
                          code="invalid_value") from exc

    if sum(len(m.content) for m in messages) > LONG_RENDER_CHARS:
        return await asyncio.to_thread(render)
    return render()


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"

