"""Turning a token stream into text: incremental UTF-8 decoding and stop-string matching.

Shared by every engine so that stop strings behave the same whatever the runtime.
"""

from __future__ import annotations

import codecs
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

import numpy as np
import numpy.typing as npt

from engines.base import SamplingParams, TokenEvent, TokenLogprob, TopLogprob, Usage


class StopMatcher:
    """Releases text as it streams, holding back any tail that may be the start of a stop string."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, text: str) -> str:
        """Add generated text; return the text that is now safe to send."""
        if self.stopped:
            return ""
        buf = self._held + text
        if not self._stops:
            self._held = ""
            return buf
        first = -1
        for stop in self._stops:
            i = buf.find(stop)
            if i != -1 and (first == -1 or i < first):
                first, self.matched = i, stop
        if first != -1:
            self.stopped = True
            self._held = ""
            return buf[:first]
        keep = 0
        for stop in self._stops:
            # Longest suffix of buf that is a proper prefix of this stop string.
            for n in range(min(len(stop) - 1, len(buf)), 0, -1):
                if buf.endswith(stop[:n]):
                    keep = max(keep, n)
                    break
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """At the end of generation, release whatever was held back."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out


class Detokenizer:
    """Decodes token byte pieces to text without splitting multi-byte UTF-8 characters."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, piece: bytes) -> str:
        return self._decoder.decode(piece)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


def prompt_logprobs(
    rows: npt.NDArray[np.float32], ids: list[int], top_n: int, piece: Callable[[int], bytes]
) -> tuple[TokenLogprob, ...]:
    """Each prompt token's log-probability under the logits of the positions before it (`rows`:
    the engine's logits at every position of `ids`); the first token's is NaN."""
    b = piece(ids[0])
    first = TokenLogprob(token=b.decode("utf-8", errors="replace"), token_id=ids[0], logprob=float("nan"), bytes=b)
    return (first, *(token_logprob(rows[k - 1], ids[k], top_n, piece) for k in range(1, len(ids))))


async def with_scored_prompt(
    prompt: list[int], sp: SamplingParams, logits: Callable[[list[int]], Awaitable[npt.NDArray[np.float32]]],
    piece: Callable[[int], bytes], run: Callable[[], AsyncIterator[TokenEvent]],
) -> AsyncIterator[TokenEvent]:
    """A generation's events (`run`), the first one carrying the prompt's own log-probabilities
    when `sp.prompt_logprobs` asks for them; with `max_tokens` 0 the prompt is only scored."""
    if sp.prompt_logprobs is None:
        async for ev in run():
            yield ev
        return
    scored = prompt_logprobs(await logits(prompt), prompt, sp.prompt_logprobs, piece)
    if sp.max_tokens == 0:
        yield TokenEvent(text="", finish_reason="length", usage=Usage(len(prompt), 0, prompt_ids=tuple(prompt)),
                         prompt_tokens=len(prompt), prompt_logprobs=scored)
        return
    async for ev in run():
        if scored:
            ev, scored = replace(ev, prompt_logprobs=scored), ()
        yield ev


def token_logprob(
    logits: npt.NDArray[np.float32], token: int, top_n: int, piece: Callable[[int], bytes]
) -> TokenLogprob:
    """The log-probability of `token` (and the `top_n` most likely) under a raw logits row."""
    x = logits.astype(np.float64)
    m = float(x.max())
    lse = m + float(np.log(np.exp(x - m).sum()))
    top: tuple[TopLogprob, ...] = ()
    if top_n > 0:
        ids = np.argpartition(-x, top_n)[:top_n]
        ids = ids[np.argsort(-x[ids])]
        top = tuple(
            TopLogprob(
                token=piece(int(t)).decode("utf-8", errors="replace"),
                token_id=int(t),
                logprob=float(x[t] - lse),
                bytes=piece(int(t)),
            )
            for t in ids
        )
    b = piece(token)
    return TokenLogprob(
        token=b.decode("utf-8", errors="replace"), token_id=token, logprob=float(x[token] - lse), bytes=b, top=top
    )
