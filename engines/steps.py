"""The per-token loop of the runtimes that step one token at a time (ORT GenAI, CoreML, ExecuTorch).

The loop owns every rule such a generation follows, so that they hold alike on each runtime:
cancellation, log-probabilities, end of sequence and `ignore_eos`, stop strings, the token budget,
the first event's prompt size, the usage, and a failover's resumed tokens (fed to the model and
to the text state, never emitted again).  A runtime supplies a `TokenSteps`: how its model takes
tokens in, how it chooses the next one, and how its tokenizer turns tokens into text.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from engines.base import (
    EngineClosed,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
    Usage,
    new_token_budget,
    resumed_tokens,
)
from engines.bridge import EventChannel, Job, WorkerPool, stream_job
from engines.text import StopMatcher, token_logprob, with_scored_prompt

Emit = Callable[[TokenEvent | BaseException], None]


class TokenSteps(Protocol):
    """One request's model, as the loop drives it."""

    def feed(self, tokens: Sequence[int]) -> None:
        """Run the model on `tokens`, after those it has seen (the prompt, or resumed tokens)."""

    def next(self, logits: bool) -> tuple[int, npt.NDArray[np.float32] | None]:
        """Choose the next token (after the last one chosen), with the raw logits row it was chosen
        from; the row may be None unless `logits` asks for it."""

    def text(self, tokens: Sequence[int]) -> str:
        """The text `tokens` add after the tokens before them, as far as it is complete (a token may
        end inside a character)."""


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one generation is to do: its prompt, sampling, token budget and resumed tokens."""

    prompt: list[int]
    sampling: SamplingParams
    max_new: int  # the most tokens to generate, resumed ones included
    resumed: tuple[int, ...] = ()  # a failover's tokens already sent
    replay: bool = True  # feed resumed tokens one per step (as they were generated), else in one go


def step_plan(request: GenerationRequest, prompt: list[int], n_ctx: int) -> StepPlan:
    """The plan of `request` in a context of `n_ctx`; raises what the request asks beyond it."""
    sp = request.sampling
    # max_tokens 0 (only the prompt scored) never runs the generation.
    max_new = new_token_budget(prompt, n_ctx, sp.max_tokens if sp.prompt_logprobs is None else sp.max_tokens or 1)
    return StepPlan(prompt, sp, max_new, resumed_tokens(request, max_new), request.resume_replay)


def stream_steps(
    pool: WorkerPool, plan: StepPlan, logits: Callable[[list[int]], Awaitable[npt.NDArray[np.float32]]],
    piece: Callable[[int], bytes], run: Callable[[Job[None], EventChannel, StepPlan], None],
) -> AsyncIterator[TokenEvent]:
    """The events of `run(job, channel, plan)` on a thread of `pool`, the first carrying the prompt's
    log-probabilities when asked for."""
    return with_scored_prompt(plan.prompt, plan.sampling, logits, piece,
                              lambda: stream_job(pool, lambda job, channel: run(job, channel, plan)))


def run_steps(
    job: Job[None], emit: Emit, plan: StepPlan, steps: TokenSteps, eos: frozenset[int], piece: Callable[[int], bytes],
) -> None:
    """Generate `plan` on `steps`, emitting one event per token until the last (with its finish
    reason and usage), or EngineClosed when the engine closes under it."""
    stopper = StopMatcher(plan.sampling.stop)
    if not _feed_prompt(job, plan, steps):
        return
    if plan.resumed:  # the text state after the tokens already sent, without emitting
        stopper.push(steps.text(plan.resumed))
    sp = plan.sampling
    n = len(plan.resumed)
    first = n + 1
    while True:
        if job.cancelled:
            if job.closing:
                emit(EngineClosed("the model was unloaded"))
            return
        token, row = steps.next(sp.logprobs)
        n += 1
        logprobs: tuple[TokenLogprob, ...] = ()
        if sp.logprobs and row is not None:
            logprobs = (token_logprob(row, token, sp.top_logprobs, piece),)
        finish: str | None = None
        text = ""
        if token in eos and not sp.ignore_eos:
            finish = "stop"
        else:
            text = stopper.push(steps.text((token,)))
            if stopper.stopped:
                finish = "stop"
            elif n >= plan.max_new:
                finish = "length"
        if finish is None:
            emit(TokenEvent(text=text, token_ids=(token,), logprobs=logprobs,
                            prompt_tokens=len(plan.prompt) if n == first else 0))
            continue
        usage = Usage(prompt_tokens=len(plan.prompt), completion_tokens=n, queue_seconds=job.queue_seconds)
        emit(TokenEvent(text=text + stopper.flush(), token_ids=(token,), logprobs=logprobs,
                        finish_reason=finish, usage=usage, stop_sequence=stopper.matched))
        return


def _feed_prompt(job: Job[None], plan: StepPlan, steps: TokenSteps) -> bool:
    """Feed the prompt and a failover's resumed tokens; False when cancelled meanwhile."""
    if plan.resumed and not plan.replay:
        steps.feed([*plan.prompt, *plan.resumed])
        return True
    steps.feed(plan.prompt)
    # A failover: the tokens already sent go in one per step, as they were generated (each runs the
    # model on one token, as a decode step does), so greedy output goes on as an uninterrupted run's.
    for t in plan.resumed:
        if job.cancelled:
            return False
        steps.feed((t,))
    return True
