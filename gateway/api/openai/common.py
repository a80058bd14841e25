"""What the OpenAI adapters share: the sampler's settings a request asks for, usage and logprobs in OpenAI's
shapes, the reasoning effort, and the fast rendering of text chunks."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING

from gateway.api.errors import invalid
from gateway.api.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    CompletionTokensDetails,
    PromptTokensDetails,
    TokenLogprobOut,
    TopLogprobOut,
    UsageOut,
)
from gateway.conversation import Logprob, Sampling, Usage

if TYPE_CHECKING:
    from gateway.api.serving import Prepared

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


def effort_level(effort: str | None) -> str | None:
    """An OpenAI reasoning effort as a model with reasoning levels reads it: minimal is its low;
    none (no reasoning) is no level."""
    return "low" if effort == "minimal" else effort if effort in ("low", "medium", "high") else None


def asked(req: ChatCompletionRequest | CompletionRequest, max_tokens: int | None) -> Sampling:
    """What a chat or completions request asks of the sampler (OpenAI has no top_k; the extensions
    llama-server and vLLM take are read too)."""
    return Sampling(
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        repeat_penalty=req.repeat_penalty, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, seed=req.seed, max_tokens=max_tokens, stop=_stops(req.stop),
        logit_bias=_logit_bias(req.logit_bias), ignore_eos=req.ignore_eos,
    )


def _bytes(b: bytes) -> list[int]:
    return list(b)


def chat_logprobs(items: tuple[Logprob, ...] | list[Logprob]) -> list[TokenLogprobOut]:
    return [
        TokenLogprobOut(
            token=t.token,
            logprob=t.logprob,
            bytes=_bytes(t.bytes),
            top_logprobs=[TopLogprobOut(token=x.token, logprob=x.logprob, bytes=_bytes(x.bytes)) for x in t.top],
        )
        for t in items
    ]


def usage_so_far(p: Prepared, choice: int) -> UsageOut:
    """One choice's usage up to the chunk being sent (vLLM's continuous_usage_stats): the tokens it
    has generated; the prompt's once the engine has said (llama.cpp: with the first token)."""
    done = p.generated.get(choice, 0)
    return UsageOut(prompt_tokens=p.prompt_tokens, completion_tokens=done, total_tokens=p.prompt_tokens + done)


def usage_out(usages: list[Usage]) -> UsageOut:
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
        failovers=max((u.failovers for u in usages), default=0) or None,
    )


class TextChunk:
    """A stream chunk rendered once with a placeholder; each token's text is then spliced in."""

    SLOT = "@@gateway-text@@"

    def __init__(self, render: Callable[[str], str]) -> None:
        self.head, found, self.tail = render(self.SLOT).partition(f'"{self.SLOT}"')
        assert found, "the placeholder must appear once, as a JSON string"

    def __call__(self, text: str) -> str:
        return self.head + json.dumps(text, ensure_ascii=False) + self.tail


def check_stream_options(req: ChatCompletionRequest | CompletionRequest) -> None:
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options is only allowed when stream is true", param="stream_options")
