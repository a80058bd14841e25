"""OpenAI legacy completions: prompts in (a string, token ids, or a batch of either), the neutral
output events -> the completion or its chunks, `n` choices per prompt in OpenAI's order."""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator
from dataclasses import replace

from gateway.api.errors import invalid
from gateway.api.openai.common import asked, check_stream_options, usage_out, usage_so_far
from gateway.api.openai.protocol import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    PromptTokensDetails,
    UsageOut,
)
from gateway.api.serving import Prepared, Service
from gateway.conversation import Finished, Logprob, Scored, TextDelta, Usage

# Choices one request may ask for (prompts x n), as engines queue what their slots cannot run at once.
MAX_CHOICES = 128


def prompts_of(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The request's prompts, each a string or token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(x, int) for x in prompt):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


class CompletionService(Service):
    async def prepare_completion(self, req: CompletionRequest, received: float) -> Prepared:
        spec = self.spec(req.model)
        if req.suffix:
            raise invalid("suffix (fill-in-the-middle) is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise invalid("best_of must equal n (ranking by log probability is not supported)", param="best_of")
        if req.max_tokens == 0 and not req.echo:
            raise invalid("max_tokens must be at least 1 (0 only with echo, to score the prompt)", param="max_tokens")
        check_stream_options(req)
        prompts = prompts_of(req.prompt)
        if len(prompts) * req.n > MAX_CHOICES:
            raise invalid(f"{len(prompts)} prompts x n={req.n} ask for more than {MAX_CHOICES} choices", param="prompt")
        texts = [x for x in prompts if isinstance(x, str)]
        wanted = asked(req, req.max_tokens)
        if req.logprobs is not None:
            wanted = replace(wanted, logprobs=True, top_logprobs=req.logprobs)
        if req.echo and (req.logprobs is not None or not texts):
            # The echoed prompt's tokens come from the engine (their text, and logprobs when asked).
            wanted = replace(wanted, prompt_logprobs=req.logprobs or 0)
        p = await self.prepare_prompts(spec, prompts, wanted, req.n, "cmpl", received)
        if req.echo:
            p.echo = [x if isinstance(x, str) else None for x in prompts for _ in range(req.n)]
        return p

    async def complete(self, p: Prepared, model: str) -> Completion:
        c = await self.collect(p)
        want_lp = p.wants_logprobs
        choices = []
        for i in range(len(p.requests)):
            echo, echoed = _echo(p, i)
            lp = None
            if want_lp:
                lp = _completion_logprobs(echoed + c.tokens[i], 0)
            choices.append(CompletionChoice(index=i, text=echo + c.texts[i], logprobs=lp, finish_reason=c.finish[i]))
        return Completion(id=p.response_id, created=p.created, model=model, choices=choices,
                          usage=_usage(p, c.usages))

    async def stream(self, p: Prepared, model: str, include_usage: bool,
                     continuous_usage: bool = False) -> AsyncIterator[str]:
        usages: list[Usage] = []
        want_lp = p.wants_logprobs
        offsets = [0] * len(p.requests)
        started: set[int] = set()
        scored: tuple[Logprob, ...] = ()  # the logprobs of the tokens behind the next event

        def chunk(choices: list[CompletionChoice], usage: UsageOut | None = None) -> str:
            if usage is None and continuous_usage and choices:
                usage = usage_so_far(p, choices[0].index)
            c = Completion(id=p.response_id, created=p.created, model=model, choices=choices, usage=usage)
            return c.model_dump_json(exclude=None if include_usage else {"usage"})

        async with contextlib.aclosing(self.conversation_events(p)) as events:
            async for i, e in events:
                if isinstance(e, Scored):
                    scored = e.tokens
                    continue
                head, items, scored = "", list(scored), ()
                if i not in started:  # the echoed prompt leads the choice's first chunk
                    started.add(i)
                    head, echoed = _echo(p, i)
                    items = echoed + items
                if isinstance(e, Finished):
                    if e.usage is not None:
                        usages.append(e.usage)
                    if head:
                        lp = _completion_logprobs(items, offsets[i]) if want_lp and items else None
                        yield chunk([CompletionChoice(index=i, text=head, logprobs=lp, finish_reason=None)])
                    yield chunk([CompletionChoice(index=i, text="", finish_reason=e.reason)])
                elif isinstance(e, TextDelta):  # (a prompt has no tools: text only, one per engine event)
                    lp = _completion_logprobs(items, offsets[i]) if want_lp and items else None
                    if lp is not None:
                        offsets[i] = lp.text_offset[-1] + len(lp.tokens[-1])
                    yield chunk([CompletionChoice(index=i, text=head + e.text, logprobs=lp, finish_reason=None)])
        if include_usage:
            yield chunk([], _usage(p, usages))


def _echo(p: Prepared, i: int) -> tuple[str, list[Logprob]]:
    """Choice `i`'s echoed prompt: its text, and its tokens with their logprobs when the engine
    scored it (the text of a token prompt is its tokens' text)."""
    if p.echo is None:
        return "", []
    scored = list(p.prompt_logprobs.get(i, ()))
    text = p.echo[i]
    if text is None:
        text = b"".join(t.bytes for t in scored).decode("utf-8", errors="replace")
    return text, scored if p.wants_logprobs else []


def _usage(p: Prepared, usages: list[Usage]) -> UsageOut:
    """n choices of one prompt count it once (usage_out); a batch of prompts counts each once."""
    out = usage_out(usages)
    if len(p.requests) > p.n:
        firsts = [p.usages[i] for i in range(0, len(p.requests), p.n) if i in p.usages]
        out.prompt_tokens = sum(u.prompt_tokens for u in firsts)
        out.total_tokens = out.prompt_tokens + out.completion_tokens
        out.prompt_tokens_details = PromptTokensDetails(cached_tokens=sum(u.cached_tokens for u in firsts))
    return out


def _completion_logprobs(items: list[Logprob], start: int) -> CompletionLogprobs:
    offsets = []
    pos = start
    for t in items:
        offsets.append(pos)
        pos += len(t.token)
    return CompletionLogprobs(
        tokens=[t.token for t in items],
        # An echoed prompt's first token has none (NaN from the engine: nothing comes before it).
        token_logprobs=[None if math.isnan(t.logprob) else t.logprob for t in items],
        top_logprobs=[None if math.isnan(t.logprob) else {x.token: x.logprob for x in t.top} for t in items],
        text_offset=offsets,
    )
