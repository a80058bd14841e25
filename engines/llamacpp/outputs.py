"""What a step does with each output row: a generation's token sampled and emitted, a scoring
job's logits collected."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import llama_cpp as lc
import numpy as np
import numpy.typing as npt

from engines.base import EngineFailure, TokenEvent, TokenLogprob, Usage
from engines.llamacpp.slots import GenJob, ScoreJob, Slot, release
from engines.text import token_logprob


class Outputs:
    """Takes the outputs of the passes on one llama_context.

    A pass's tokens can be taken in two halves (`sample(..., defer=True)`): what the next pass
    needs (the token, the sampler's history, whether the request ended by its end-of-generation
    token or its length) at once, and the rest (the token's text, stop strings, the event) by
    `flush`, which the scheduler calls once the next pass is launched, so that work overlaps the
    device's. A stop string found there ends the request a token late: its slot's next token is
    already in the running pass, whose output for it is dropped (the token stays in the slot's KV
    and in `slot.cached`, as any generated token does)."""

    def __init__(self, ctx: Any, n_vocab: int, piece: Callable[[int], bytes], is_eog: Callable[[int], bool],
                 remember: Callable[[Slot, int], None] | None) -> None:
        self._ctx = ctx
        self._n_vocab = n_vocab
        self._piece = piece
        self._is_eog = is_eog
        self._remember = remember  # each generated token, for n-gram drafts (None: no drafts)
        # (slot, its job, token, its logits row if logprobs were asked for): taken, not yet emitted
        self._deferred: list[tuple[Slot, GenJob, int, npt.NDArray[np.float32] | None]] = []

    def _logits_row(self, idx: int) -> npt.NDArray[np.float32]:
        ptr = lc.llama_get_logits_ith(self._ctx, idx)
        return np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))

    def collect_logits(self, slot: Slot, idx: int) -> None:
        """A scoring job's logits row; the job is done with its last."""
        job = slot.job
        assert isinstance(job, ScoreJob)
        job.rows.append(self._logits_row(idx).copy())
        if len(job.rows) == len(job.token_ids):
            release(slot)
            job.done(np.stack(job.rows))

    def skip_rows(self, slot: Slot, n: int) -> None:
        """A scoring job's rows for `n` positions without logits of their own (an image's): NaN."""
        job = slot.job
        assert isinstance(job, ScoreJob)
        job.rows.extend([np.full(self._n_vocab, np.nan, np.float32)] * n)

    def sample(self, slot: Slot, idx: int, defer: bool = False) -> bool:
        """Sample output `idx` for `slot` and emit it (with `defer`, at the next `flush` unless the
        token ends the request); False when the request finished."""
        job = slot.job
        assert isinstance(job, GenJob) and slot.detok is not None and slot.stopper is not None
        if job.forced:  # replaying what was sent before a failover
            self._replay(slot, job)
            return True
        sp = job.sampling
        raw = self._logits_row(idx).copy() if sp.logprobs else None
        if slot.on_device:
            # The device sampled it; the chain on the host records it (penalties' history).
            token = lc.llama_get_sampled_token_ith(self._ctx, idx)
            if token == lc.LLAMA_TOKEN_NULL:
                raise EngineFailure("llama.cpp returned no token from its device sampler")
            lc.llama_sampler_accept(slot.device_chain, token)
        else:
            token = lc.llama_sampler_sample(job.sampler, self._ctx, idx)
        slot.n_generated += 1
        eog = self._is_eog(token) and not sp.ignore_eos
        if defer and not eog and slot.n_generated < job.max_new_tokens:
            self._continue(slot, token)
            self._deferred.append((slot, job, token, raw))
            return True
        return self._emit(slot, job, token, raw, eog, taken=False)

    def flush(self) -> None:
        """Emit the tokens `sample` deferred, in order (those of requests cancelled or failed since
        are dropped); a stop string among them ends its request."""
        deferred, self._deferred = self._deferred, []
        for slot, job, token, raw in deferred:
            if slot.job is job:
                self._emit(slot, job, token, raw, False, taken=True)

    def _emit(self, slot: Slot, job: GenJob, token: int, raw: npt.NDArray[np.float32] | None, eog: bool,
              taken: bool) -> bool:
        """The token's text through the request's stop strings, as an event; False when it ended
        the request (the slot is free then). `taken`: the token was made the slot's next input
        when it was sampled (deferred)."""
        assert slot.detok is not None and slot.stopper is not None
        sp = job.sampling
        logprobs: tuple[TokenLogprob, ...] = ()
        if raw is not None:
            logprobs = (token_logprob(raw, token, sp.top_logprobs, self._piece),)
        finish: str | None = None
        text = ""
        if eog:
            finish = "stop"
        else:
            text = slot.stopper.push(slot.detok.push(job.shown.get(token) or self._piece(token)))
            if slot.stopper.stopped:
                finish = "stop"
            elif slot.n_generated >= job.max_new_tokens:
                finish = "length"
        if finish is None:
            if not taken:
                self._continue(slot, token)
            first = slot.n_generated == 1
            job.emit(TokenEvent(text=text, token_ids=(token,), logprobs=logprobs,
                                prompt_tokens=len(job.prompt_ids) - job.resumed if first else 0,
                                cached_tokens=slot.n_cached_prompt if first else 0))
            return True
        self._finish_generation(slot, job, token, text, logprobs, finish)
        return False

    def _replay(self, slot: Slot, job: GenJob) -> None:
        """Take the next token sent before a failover as this output (not sent again)."""
        assert slot.detok is not None and slot.stopper is not None
        token = job.forced.popleft()
        lc.llama_sampler_accept(job.sampler, token)
        slot.n_generated += 1
        slot.stopper.push(slot.detok.push(job.shown.get(token) or self._piece(token)))
        self._continue(slot, token)

    def _continue(self, slot: Slot, token: int) -> None:
        """The request goes on: `token` is its slot's next input (and, for drafts, its history)."""
        slot.pending = token
        if self._remember is not None:
            self._remember(slot, token)

    def _finish_generation(self, slot: Slot, job: GenJob, token: int, text: str,
                           logprobs: tuple[TokenLogprob, ...], finish: str) -> None:
        """Emit the request's last token, with the rest of its text and its usage, and free the slot."""
        assert slot.detok is not None and slot.stopper is not None
        text += slot.stopper.push(slot.detok.flush()) + slot.stopper.flush()
        usage = Usage(
            prompt_tokens=len(job.prompt_ids) - job.resumed,
            completion_tokens=slot.n_generated,
            cached_tokens=slot.n_cached_prompt,
            queue_seconds=slot.queue_seconds,
            prompt_ids=tuple(job.prompt_ids[:len(job.prompt_ids) - job.resumed]),  # images as their stand-ins
            draft_tokens=slot.drafted,
            accepted_draft_tokens=slot.accepted,
            restored_tokens=min(slot.n_restored, slot.n_cached_prompt),
            prefix_lookup=slot.lookup,
        )
        release(slot)
        job.emit(
            TokenEvent(
                text=text, token_ids=(token,), logprobs=logprobs, finish_reason=finish, usage=usage,
                stop_sequence=slot.stopper.matched,
            )
        )
