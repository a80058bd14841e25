"""OpenAI legacy completions: a prompt in, the neutral output events -> the completion or its chunks."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace

from engines.base import GenerationRequest, TokenLogprob, Usage
from gateway.api.errors import invalid
from gateway.api.openai.common import check_stream_options, sampling, usage_out, usage_so_far
from gateway.api.openai.protocol import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    UsageOut,
)
from gateway.api.serving import Prepared, Service, check_prompt_chars
from gateway.conversation import Finished, TextDelta


class CompletionService(Service):
    async def prepare_completion(self, req: CompletionRequest, received: float) -> Prepared:
        spec = self.spec(req.model)
        if req.echo:
            raise invalid("echo is not supported", param="echo")
        if req.suffix:
            raise invalid("suffix (fill-in-the-middle) is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise invalid("best_of must equal n (ranking by log probability is not supported)", param="best_of")
        check_stream_options(req)
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if len(prompts) != 1:
            raise invalid("only one prompt per request is supported; send a string", param="prompt")
        check_prompt_chars(len(prompts[0]), self.manager.settings.max_prompt_chars, "prompt", "the prompt holds")
        sp = sampling(req, spec, req.max_tokens)
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
        return Completion(id=p.response_id, created=p.created, model=model, choices=choices, usage=usage_out(c.usages))

    async def stream(self, p: Prepared, model: str, include_usage: bool,
                     continuous_usage: bool = False) -> AsyncIterator[str]:
        usages: list[Usage] = []
        want_lp = p.requests[0].sampling.logprobs
        offsets = [0] * len(p.requests)

        def chunk(choices: list[CompletionChoice], usage: UsageOut | None = None) -> str:
            if usage is None and continuous_usage and choices:
                usage = usage_so_far(p, choices[0].index)
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
            yield chunk([], usage_out(usages))


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
