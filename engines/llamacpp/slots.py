"""The slot ledger: the requests the scheduler runs, and which KV sequence holds what.

Every active request holds a slot: its own KV sequence id, what that sequence's KV stands for
(`cached`), and the request's progress through its prompt and output. A finished slot keeps its
tokens, so a later request sharing a prefix finds them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import llama_cpp as lc
import numpy as np
import numpy.typing as npt

from engines.base import SamplingParams, TokenEvent
from engines.llamacpp.vision import Media
from engines.text import Detokenizer, StopMatcher

EmitFn = Callable[[TokenEvent | BaseException], None]


@dataclass(eq=False)
class GenJob:
    """A generation waiting for, or holding, a slot."""

    prompt_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    sampler: Any  # llama_sampler_p, owned by the job and freed when it leaves the engine
    emit: EmitFn
    # What the sampler chain is (`sampler_key`), when it can run on the device: None for
    # grammars and logprobs, which need the full logits on the host.
    device_key: tuple[Any, ...] | None = None
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    # Failover (GenerationRequest.resume_ids), fed in one prefill: the last `resumed` prompt ids
    # were generated before it, are counted as generated, and their text was already sent (it
    # passes through the detokenizer and stop matcher unseen).
    resumed: int = 0
    # Fed one per step instead, as they were generated: each output takes the next of these in
    # place of a sample (the sampler accepts it), and its text is not sent again.
    forced: deque[int] = field(default_factory=deque)
    # Control tokens whose text the output shows (GenerationRequest.shown), with that text.
    shown: dict[int, bytes] = field(default_factory=dict)
    # The prompt's images (engines/llamacpp/vision.py), owned by the job: their places in prompt_ids
    # hold stand-in ids, and the scheduler feeds each whole.
    media: list[Media] = field(default_factory=list)


@dataclass(eq=False)
class ScoreJob:
    """Teacher-forced logits for every position of a token sequence (parity mode)."""

    token_ids: list[int]
    done: Callable[[npt.NDArray[np.float32] | BaseException], None]
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    rows: list[npt.NDArray[np.float32]] = field(default_factory=list)
    media: list[Media] = field(default_factory=list)  # the images in token_ids (their rows are NaN)

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids


@dataclass(eq=False)
class EmbedJob:
    """Pooled embeddings of several token sequences, computed between generation steps."""

    inputs: list[list[int]]
    done: Callable[[npt.NDArray[np.float32] | BaseException], None]
    cancelled: bool = False


Job = GenJob | ScoreJob


@dataclass(eq=False)
class Slot:
    """One KV sequence: what its KV holds, and the request running on it (if any)."""

    seq_id: int
    cached: list[int] = field(default_factory=list)  # tokens whose KV this sequence holds
    job: Job | None = None
    n_fed: int = 0  # prompt tokens already in the KV cache
    pending: int | None = None  # sampled token not yet decoded
    n_generated: int = 0
    n_cached_prompt: int = 0
    n_restored: int = 0  # of those, restored from the host-memory prefix cache
    lookup: str = ""  # the host cache's answer for this request: "hit", "miss" or "" (not asked)
    queue_seconds: float = 0.0
    detok: Detokenizer | None = None
    stopper: StopMatcher | None = None
    # The sampler chain attached to this sequence for sampling on the device (owned by the slot,
    # kept across requests with the same `device_key`: attaching one makes llama.cpp re-reserve
    # its compute graphs), and whether the running job uses it.
    device_chain: Any = None
    device_key: tuple[Any, ...] | None = None
    on_device: bool = False
    attach_due: bool = False  # the running job samples on the host until its chain is attached (`attach_due`)
    idle_since: float = 0.0  # perf_counter() when the sequence's last request left it
    # Speculative decoding: prompt + generated tokens, their n-grams (-> index of the next token),
    # and this request's draft tokens proposed / accepted.
    history: list[int] = field(default_factory=list)
    ngrams: dict[tuple[int, ...], int] | None = None
    drafted: int = 0
    accepted: int = 0
    draft_len: int = 0  # the next draft's length limit: halved on a rejection, doubled on a full accept
    # Sliding-window KV: a prompt position where this prompt's state goes to the host cache on the
    # way (the end of a prefix another sequence or entry shares but, its window having moved on,
    # cannot serve); 0 = none.
    checkpoint: int = 0
    # (leader, its request, n): this request's first n prompt tokens are the leader's, whose prefill
    # has not reached them yet; this one waits for it and copies them (`follow`).
    follow: tuple[Slot, Job, int] | None = None
    # The trim's verdict on this idle sequence's KV while it holds this many tokens and the host
    # cache this many bytes (the lookup and state size it needs cost too much for every step),
    # and the seconds its copies would take (saved, then restored; None: not measured yet).
    trim_memo: tuple[int, int, bool, float | None] = (-1, -1, False, None)
    # Seconds of the running passes' time this idle sequence's cells have cost them so far (an
    # estimate, `charge_idle`); reset when the sequence goes idle.
    idle_cost: float = 0.0


def active(slots: list[Slot]) -> list[Slot]:
    """The slots running a request, in sequence order."""
    return [s for s in slots if s.job is not None]


def used(slots: list[Slot]) -> int:
    """Cells of the KV the sequences hold (an upper bound in a shared cache: a prefix copied from
    another sequence shares that sequence's cells)."""
    return sum(len(s.cached) for s in slots)


def unfed(slots: list[Slot]) -> int:
    """Prompt tokens the running requests have yet to prefill."""
    return sum(len(s.job.prompt_ids) - s.n_fed for s in slots if s.job is not None and s.pending is None)


def idle_by_age(slots: list[Slot], keep: Slot | None = None) -> list[Slot]:
    """Idle sequences holding KV (but `keep`), idle longest first."""
    return sorted((s for s in slots if s.job is None and s.cached and s is not keep), key=lambda s: s.idle_since)


def floor(mem: Any, n_swa: int, slot: Slot) -> int:
    """The shortest prefix of the slot's KV that can be kept: 0 without a sliding window; with
    one, the oldest position its window layers still hold plus the window less one (the next
    token, at position `keep`, attends to positions keep - window + 1 ... keep, and older ones
    have been overwritten). A window cache under pressure (one shared by several sequences)
    keeps exactly that much: the whole KV of a sequence is then still usable, no shorter part."""
    if not n_swa or not slot.cached:
        return 0
    pos_min = lc.llama_memory_seq_pos_min(mem, slot.seq_id)
    return 0 if pos_min <= 0 else int(pos_min) + n_swa - 1


def clear(mem: Any, slot: Slot) -> None:
    """Drop the sequence's KV."""
    lc.llama_memory_seq_rm(mem, slot.seq_id, -1, -1)
    slot.cached = []


def release(slot: Slot) -> None:
    """The slot's request leaves it (finished, cancelled or failed); its KV stays."""
    if slot.job is not None:
        free_job(slot.job)
    slot.job = None
    slot.pending = None
    slot.attach_due = False
    slot.idle_since = time.perf_counter()
    slot.idle_cost = 0.0


def free_job(job: Job) -> None:
    if isinstance(job, GenJob) and job.sampler is not None:
        lc.llama_sampler_free(job.sampler)
        job.sampler = None
    if isinstance(job, GenJob | ScoreJob):
        for m in job.media:
            m.free()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def ema(old: float | None, new: float, weight: float = 0.3) -> float:
    """A moving average of a measured rate (None until the first measure)."""
    return new if old is None else (1 - weight) * old + weight * new
