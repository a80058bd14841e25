"""Speculative decoding with n-gram drafts from the sequence's own text (prompt lookup).

The tokens that followed the latest earlier occurrence of the text's last n-gram are decoded in
the same step as the sampled token, and kept while they agree with what is sampled after them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import llama_cpp as lc

from engines.llamacpp.slots import GenJob, Slot


class NgramDrafter:
    """Drafts for the decoding sequences, and their verification."""

    def __init__(self, mem: Any, ngram: int, draft_max: int, streams: int) -> None:
        self._mem = mem
        self.ngram = ngram if draft_max > 0 else 0  # 0: off
        self.draft_max = draft_max
        # Verifying drafts costs every sequence of the step (logits of every draft position come
        # back to the host): worth it only while this few sequences are decoding.
        self.streams = streams
        self.drafted = 0  # draft tokens proposed, and accepted
        self.accepted = 0

    def start(self, slot: Slot, job: GenJob) -> None:
        """A new request on the slot: its prompt is the text drafts come from."""
        slot.history = list(job.prompt_ids)
        slot.ngrams = None
        slot.drafted = slot.accepted = 0
        slot.draft_len = self.draft_max

    def draft(self, slot: Slot, room: int) -> list[int]:
        """Up to max_draft tokens that followed the latest earlier occurrence of the text's last
        n-gram (prompt lookup), or none."""
        job = slot.job
        assert isinstance(job, GenJob) and slot.pending is not None
        hist = slot.history
        if slot.ngrams is None:  # index the prompt once per request
            slot.ngrams = {}
            ng = self.ngram
            for i in range(ng, len(hist)):
                slot.ngrams[tuple(hist[i - ng : i])] = i
        start = slot.ngrams.get(tuple(hist[-self.ngram :]))
        if start is None:
            return []
        left = job.max_new_tokens - slot.n_generated  # the draft's tokens plus one sampled after it
        k = min(slot.draft_len, room, left - 1, len(hist) - start)
        if k <= 0:
            return []
        draft = hist[start : start + k]
        cut = next((i for i, t in enumerate(draft) if t < 0), None)  # an image's stand-ins are no tokens
        if cut is not None:
            draft = draft[:cut]
            if not draft:
                return []
        self.drafted += len(draft)
        slot.drafted += len(draft)
        return draft

    def remember(self, slot: Slot, token: int) -> None:
        """Append a generated token to the lookup history and index the n-gram it completes."""
        hist = slot.history
        hist.append(token)
        ng = self.ngram
        if slot.ngrams is not None and len(hist) > ng:
            slot.ngrams[tuple(hist[-ng - 1 : -1])] = len(hist) - 1

    def verify(self, slot: Slot, idx: int, draft: list[int], sample: Callable[[Slot, int], bool]) -> None:
        """Sample each position in turn; keep the draft while it agrees with what was sampled.

        Every emitted token is sampled from the model given the tokens before it, so the output
        is distributed exactly as without drafts (and equal to it at temperature 0)."""
        base = len(slot.cached) - len(draft)  # KV length up to and including the decoded pending token
        accepted = 0
        for i in range(len(draft) + 1):
            if not sample(slot, idx + i):
                break  # finished
            if i < len(draft) and slot.pending == draft[i]:
                accepted += 1
                slot.accepted += 1
                self.accepted += 1
                slot.pending = None  # already in the KV cache: the next output samples after it
                continue
            break
        # Long drafts while they are accepted, short ones (cheap to verify) after a miss.
        if accepted == len(draft):
            slot.draft_len = min(self.draft_max, 2 * slot.draft_len)
        else:
            slot.draft_len = max(1, accepted + 1, slot.draft_len // 2)
        keep = base + accepted
        if keep < len(slot.cached):
            lc.llama_memory_seq_rm(self._mem, slot.seq_id, keep, -1)
            del slot.cached[keep:]
