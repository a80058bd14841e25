"""Continuous batching over llama.cpp's low-level API.

One thread owns the `llama_context`.  Every active request holds a slot: its own KV sequence id,
sampler chain, detokenizer and stop matcher.  Each step builds one `llama_batch` with one token per
decoding sequence plus chunks of pending prompts (chunked prefill, so a long prompt cannot stall
running streams), calls `llama_decode` once (twice in the shared KV layout on the CPU: the
decoding tokens, then the prompt chunks; `_step` says why), then samples each sequence that
produced logits.
Requests join and leave the batch at token boundaries.  A finished slot keeps its tokens in the KV
cache, so a later request sharing a prefix (the next chat turn, a common system prompt) only
prefills the part that differs.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import llama_cpp as lc
import numpy as np
import numpy.typing as npt

from engines.base import (
    EngineClosed,
    EngineFailure,
    EngineOverloaded,
    KvStats,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
    Usage,
)
from engines.llamacpp.pass_cost import MaskedCellCost
from engines.llamacpp.prefix_cache import MIN_ENTRY_TOKENS, HostPrefixCache
from engines.text import Detokenizer, StopMatcher, token_logprob

log = logging.getLogger(__name__)

EmitFn = Callable[[TokenEvent | BaseException], None]


# Tokens of prefix that make copying another sequence's KV stream worth it: the copy moves the
# whole stream (a few MB for a small model), prefill of 16 tokens costs more on any backend.
MIN_COPY_GAIN = 16

# Seconds of prefill a saved state must stand for: a save stops every running stream for its copy,
# and most saved states never come back (one-off prompts). A state that prefills again in less
# than this is not worth a host-cache entry (on the H100, SmolLM2's 256-token requests: saving
# each cost 4-12% of 1-16-stream throughput and 40% of TTFT; docs/benchmarks/history.md#saving-only-what-pays).
MIN_SAVE_GAIN_S = 0.05

# `_save_size` verdicts besides a size: prefilling the state again beats copying it; it cannot be
# saved (no host cache, or larger than its bound).
NOT_WORTH_IT = -1
NOT_SAVABLE = -2

# A prompt goes to the free sequence already holding its prefix (instead of the lowest free one)
# when that prefix is at least this long and at least half the prompt.
OWN_SLOT_TOKENS = 256

# Tokens of prefix a new prompt must share with a running request's prompt, beyond what any KV
# holds of it yet, to wait for that request's prefill and copy it rather than prefill it alongside
# (`_start`): `n` choices of one prompt, agents' sessions opened at once with one system prompt.
FOLLOW_MIN_TOKENS = 64

# Seconds an idle sequence keeps its device sampler chain. llama.cpp builds every attached chain
# into every step's graph (idle ones on a dummy row), so chains left on idle sequences slow down the
# few that run: on the H100 one stream fell from ~700 to ~600 tok/s after a 16-stream burst. Kept
# briefly, a busy server reuses them (attaching one costs a graph re-reserve).
IDLE_DETACH_S = 0.5

# Seconds a chain due to be attached (`_attach_due`) waits while other requests are still before
# their first token. Attaching one re-reserves llama.cpp's compute graphs at the next pass (~46 ms
# for a Llama-3-8B-shaped model on the H100), a stall every request in that pass waits for: the
# request samples on the host until a pass with no first token to wait for, or this long.
ATTACH_DEFER_S = 0.25

# Seconds a sequence stays idle before `_trim_idle` may move its KV out of a shared cache. A
# conversation whose next turn comes sooner (an agent's tool call, a quick follow-up) finds its KV
# in place: on the H100 (Llama-3-8B-shaped, 4 agent sessions) the trim moved out two sessions
# 0.3 s before their next turns, each save stopping the last running stream for ~50 ms and each
# restore ~40 ms of the next turn's queue, to spare a few decode steps 0.3 ms each. After it, the
# trim also waits until the idle KV has cost the running passes TRIM_PAYBACK times what its copies
# would (`_trim_paid`).
IDLE_TRIM_S = 1.0

# What idle KV must have cost the running passes, as a multiple of its copies' time, before
# `_trim_idle` moves it out (1: a ski rental's break-even for the machine's time; 0: as soon as
# IDLE_TRIM_S has passed). More than 1 because the copies fall on one request's time to its first
# token and stop every stream at once, while the masked cells cost each pass a little: on the H200
# (Llama-3-8B-shaped, 4 agent sessions) at 1 the sessions that finished their first turn first
# were moved out during the others' prefills (charged ~300 ms each, copies ~120 ms) and restored
# for their next turn, whose TTFT p95 went from 13.2 % to 18.2 % of a cold prefill (the first
# turns within 3 % either way). At 8 such sessions stay, and a short conversation's KV (a few MiB,
# copies ~1 ms) still leaves after ~a second of others' decode steps.
TRIM_PAYBACK = 8.0

# Bytes per second a save or restore is priced at before one has been measured (the H100's pinned
# copies ran at 17 and 42 GB/s, the 2-core CPU's at several GB/s).
COPY_BPS_PRIOR = 8e9


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


@dataclass(eq=False)
class ScoreJob:
    """Teacher-forced logits for every position of a token sequence (parity mode)."""

    token_ids: list[int]
    done: Callable[[npt.NDArray[np.float32] | BaseException], None]
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    rows: list[npt.NDArray[np.float32]] = field(default_factory=list)

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
class _Slot:
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
    attach_due: bool = False  # the running job samples on the host until `_attach_due` attaches its chain
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
    # has not reached them yet; this one waits for it and copies them (`_follow`).
    follow: tuple[_Slot, Job, int] | None = None
    # `_trim_idle`'s verdict on this idle sequence's KV while it holds this many tokens and the
    # host cache this many bytes (the lookup and state size it needs cost too much for every step).
    # and the seconds its copies would take (saved, then restored; None: not measured yet).
    trim_memo: tuple[int, int, bool, float | None] = (-1, -1, False, None)
    # Seconds of the running passes' time this idle sequence's cells have cost them so far (an
    # estimate, `_charge_idle`); reset when the sequence goes idle.
    idle_cost: float = 0.0


class BatchScheduler:
    """Runs every request of one model on one llama_context, batched."""

    def __init__(
        self,
        ctx: Any,
        n_vocab: int,
        n_parallel: int,
        n_batch: int,
        max_queue: int,
        piece: Callable[[int], bytes],
        is_eog: Callable[[int], bool],
        device_sampling: bool = False,
        draft_ngram: int = 0,
        draft_max: int = 0,
        draft_streams: int = 1,
        host_cache: HostPrefixCache | None = None,
        identity: str = "",
        prefill_budget: int = 0,
        n_swa: int = 0,
        kv_pool: int = 0,
        n_cells: int = 0,
        split_mixed: bool = False,
        follow: bool = True,
        attach_defer: bool = True,
        trim_payback: float = TRIM_PAYBACK,
    ) -> None:
        self._ctx = ctx
        self._n_cells = n_cells  # the KV cache's cells, every sequence's (reported in kv_stats)
        # One KV cache shared by the sequences (kv_unified), of this many cells (0: one stream per
        # sequence, each with its own context). Shared, it bounds how many requests run at once,
        # not the sequence count: a request starts when its prompt fits beside the others, idle
        # sequences' KV gives way first (to the host cache), and when the running ones outgrow it
        # the newest is paused (`_preempt`) and resumes when there is room, as vLLM preempts.
        self._kv_pool = kv_pool
        # What other sequences' cells cost a pass over the shared cache, fitted from the passes.
        self._masked_cost = MaskedCellCost() if kv_pool else None
        # A step with both running streams and prompt chunks as two passes (the shared layout on
        # the CPU: `_step` says why).
        self._split_mixed = split_mixed
        self.split_steps = 0  # steps run as two passes for it
        self.preemptions = 0  # requests paused because the shared KV was full
        self.idle_evictions = 0  # idle sequences' KV moved out of the shared cache by `_trim_idle`
        # The sliding window of the model's SWA layers when their KV keeps only the window
        # (swa_full off): a sequence's KV then serves a prefix only if the window before its end is
        # still there (`_floor`). 0: every layer keeps every position.
        self._n_swa = n_swa
        # Sequences' KV saved to host memory when their slot is reused, restored for a later
        # prompt that starts the same way (the next turn of a conversation that lost its slot).
        self.host_cache = host_cache
        self._identity = identity
        # Prompt tokens per step while other sequences decode: a long prompt is fed in chunks of
        # this size between their tokens, so it slows them by a bounded amount instead of
        # stalling them for its whole prefill. Alone, a prompt takes the whole batch.
        self._prefill_budget = prefill_budget if prefill_budget > 0 else n_batch
        # Measured here (moving averages; None until seen): prompt tokens per second, and bytes per
        # second of saving a sequence's state to host memory and of loading one back. They decide
        # whether a save or a restore is worth its copy: on a GPU behind PCIe, copying a long
        # conversation's KV can cost as much as prefilling it again.
        self.prefill_tps: float | None = None
        self.save_bps: float | None = None
        self.restore_bps: float | None = None
        self._draft_ngram = draft_ngram if draft_max > 0 else 0
        self._draft_max = draft_max
        # Verifying drafts costs every sequence of the step (logits of every draft position come
        # back to the host): worth it only while few sequences are decoding.
        self._draft_streams = draft_streams
        # Drafts are verified on the host, one output at a time (a device chain samples every
        # output of a step at once, before the first rejection is known).
        self._device_sampling = device_sampling and not self._draft_ngram
        self._n_vocab = n_vocab
        self._n_batch = n_batch
        self._max_queue = max_queue
        self._piece = piece
        self._is_eog = is_eog
        self._mem = lc.llama_get_memory(ctx)
        # FLOPs of a token's attention per KV cell it walks (QK and PV over every layer's heads;
        # n_embd stands for heads x head size), and of the rest of a token's pass (2 per weight):
        # what prices the cells idle sequences leave in a shared cache (`_charge_idle`).
        model = lc.llama_get_model(ctx)
        self._cell_flops = 4.0 * lc.llama_model_n_layer(model) * lc.llama_model_n_embd(model)
        self._token_flops = 2.0 * max(lc.llama_model_n_params(model), 1)
        self._batch = lc.llama_batch_init(n_batch, 0, 1)
        self._slots = [_Slot(seq_id=i) for i in range(n_parallel)]
        self.prefix_copies = 0  # prompts that took their prefix from another sequence's KV
        self.prefix_follows = 0  # of those, prompts that waited for a running prefill to copy it
        self._follow_on = follow  # whether they may wait for it (`_leader_for`)
        self.device_attaches = 0  # sampler chains attached to a sequence (each costs a graph reserve)
        self.deferred_attaches = 0  # of those, attached after the request's first tokens (`_attach_due`)
        self._attach_defer = attach_defer  # whether they may be (off: attached before the first pass)
        self._trim_payback = trim_payback  # TRIM_PAYBACK, or another for a side-by-side run
        self.drafted = 0  # speculative draft tokens proposed, and accepted
        self.accepted = 0
        self.step_started = 0.0  # perf_counter() when the running step began; 0 between steps
        self._waiting: deque[Job] = deque()
        self._embeds: deque[EmbedJob] = deque()
        self.embedder: Any = None  # engines.llamacpp.embed.Embedder, set by the engine
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="llamacpp-batch", daemon=True)
        self._thread.start()

    # --- called from other threads -------------------------------------------------------

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._stopping:
                raise EngineClosed("the engine is shutting down")
            if len(self._waiting) >= self._max_queue:
                raise EngineOverloaded(
                    f"all {len(self._slots)} sequences are busy and {len(self._waiting)} "
                    "requests are already waiting; retry later"
                )
            if isinstance(job, GenJob) and (job.resumed or job.forced):
                self._waiting.appendleft(job)  # a stream that lost its engine goes first
            else:
                self._waiting.append(job)
            self._cv.notify()

    def submit_embed(self, job: EmbedJob) -> None:
        with self._cv:
            if self._stopping:
                raise EngineClosed("the engine is shutting down")
            if len(self._embeds) >= self._max_queue:
                raise EngineOverloaded(f"{len(self._embeds)} embedding requests are already waiting; retry later")
            self._embeds.append(job)
            self._cv.notify()

    def cancel(self, job: Job | EmbedJob) -> None:
        with self._cv:
            job.cancelled = True
            self._cv.notify()

    def counts(self) -> tuple[int, int]:
        """(running, waiting)."""
        with self._cv:
            return sum(s.job is not None for s in self._slots), len(self._waiting)

    def held_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` a sequence's KV or the host cache already holds: a hint for routing
        a request between schedulers (read from another thread, so it may be a step old)."""
        best = max((_common_prefix(list(s.cached), tokens) for s in self._slots), default=0)
        if self.host_cache is not None:
            _, n = self.host_cache.lookup(self._identity, np.asarray(tokens, dtype=np.int32), len(tokens), touch=False)
            best = max(best, n)
        return best

    def kv_stats(self) -> KvStats:
        """The KV cache's cells, what the sequences hold of them, and the shared cache's counters."""
        slots = list(self._slots)
        used = sum(len(s.cached) for s in slots)
        return KvStats(cells=self._n_cells, used=used, idle=sum(len(s.cached) for s in slots if s.job is None),
                       preemptions=self.preemptions, idle_evictions=self.idle_evictions,
                       prefix_copies=self.prefix_copies, prefix_follows=self.prefix_follows)

    def close(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join()
        lc.llama_batch_free(self._batch)
        if self.host_cache is not None:
            self.host_cache.close()

    # --- the scheduler thread --------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._waiting and not self._active() and not self._embeds:
                    self._cv.wait(self._detach_idle())
                if self._stopping:
                    break
                self._drop_cancelled_waiting()
                self._admit()
                embeds, self._embeds = list(self._embeds), deque()
            self.step_started = time.perf_counter()
            for ejob in embeds:
                self._embed(ejob)
            self._release_cancelled()
            if self._active():
                try:
                    self._step()
                except Exception as exc:  # a runtime failure must not kill the thread silently
                    log.exception("llama.cpp batch step failed")
                    for slot in self._active():
                        self._fail(slot, EngineFailure(f"llama.cpp failed: {exc}"))
            self.step_started = 0.0
            self._detach_idle()
        self._shutdown()

    def _embed(self, job: EmbedJob) -> None:
        if job.cancelled:
            return
        try:
            result: npt.NDArray[np.float32] | BaseException = self.embedder.embed(job.inputs)
        except Exception as exc:  # noqa: BLE001 - handed to the waiting request
            log.exception("llama.cpp embedding failed")
            result = exc if isinstance(exc, EngineFailure) else EngineFailure(f"llama.cpp failed: {exc}")
        job.done(result)

    def _active(self) -> list[_Slot]:
        return [s for s in self._slots if s.job is not None]

    def _drop_cancelled_waiting(self) -> None:
        kept: deque[Job] = deque()
        for job in self._waiting:
            if job.cancelled:
                _free_job(job)
            else:
                kept.append(job)
        self._waiting = kept

    def _admit(self) -> None:
        # The lowest free sequence id, always: llama.cpp computes a step's attention over the KV
        # streams from the lowest to the highest sequence id in the batch (unused ones masked), so
        # 8 running sequences spread over ids 0-15 cost as much as 16. Measured on the H100 after
        # a 16-stream burst: 8 streams fell from ~2000 to ~850 tok/s when new requests took the
        # free slot with the longest cached prefix. A longer prefix held by another slot is still
        # reused: `_start` copies it into the chosen stream. The exception: a free slot that holds
        # most of a long prompt (a conversation's own sequence, its next turn) keeps it, rather
        # than evicting another conversation's KV to copy this one's over.
        free = [s for s in self._slots if s.job is None]
        while self._waiting and free:
            job = self._waiting[0]
            slot = self._slot_for(job, free)
            if self._kv_pool and not self._fits(job, slot):
                break  # in order: the first waiting request starts first
            self._waiting.popleft()
            free.remove(slot)
            self._start(slot, job)

    def _slot_for(self, job: Job, free: list[_Slot]) -> _Slot:
        if self._kv_pool:
            # Shared KV: a sequence id costs nothing, the cells do. A sequence whose KV starts the
            # prompt but for a few tokens (nothing of it is lost), else an empty one (a prefix
            # another sequence holds is copied in by sharing its cells), else one holding at least
            # half its KV of the prompt (the conversation's own, whose last answer was tokenized
            # differently: only that tail goes), else the one idle longest (its KV gives way).
            held = [_common_prefix(s.cached, job.prompt_ids) if s.cached else 0 for s in free]
            best = max(range(len(free)), key=held.__getitem__)
            mine = held[best] >= MIN_COPY_GAIN
            if mine and held[best] + MIN_COPY_GAIN >= len(free[best].cached):
                return free[best]
            empty = [s for s in free if not s.cached]
            if empty:
                return empty[0]
            if mine and 2 * held[best] >= len(free[best].cached):
                return free[best]
            # The one whose KV is least missed: held elsewhere (a conversation whose next turn took
            # another sequence and shares these cells), else idle longest. On the H100 a next turn
            # took the idle-longest sequence, another session's only copy, over a stale one whose
            # session now ran elsewhere: a 58 ms save and a 44 ms restore in that session's queue.
            return min(free, key=lambda s: (len(s.cached) - self._covered(s), s.idle_since))
        if isinstance(job, GenJob) and len(free) > 1 and len(job.prompt_ids) >= 2 * OWN_SLOT_TOKENS:
            held = [_common_prefix(s.cached, job.prompt_ids) for s in free]
            best = max(range(len(free)), key=held.__getitem__)
            if held[best] >= OWN_SLOT_TOKENS and 2 * held[best] >= len(job.prompt_ids) and held[best] > held[0]:
                return free[best]
        return free[0]

    def _start(self, slot: _Slot, job: Job) -> None:
        keep = own = held = 0
        slot.n_restored, slot.lookup = 0, ""
        if isinstance(job, GenJob):
            # Reuse the cached prefix; at least one prompt token must be decoded for logits.
            limit = len(job.prompt_ids) - 1
            own = min(_common_prefix(slot.cached, job.prompt_ids), limit)
            keep = self._usable(slot, own)
            self._save(slot, keep)
            # Another sequence (running or finished) may hold a longer prefix: a shared system
            # prompt, the previous turn of this chat. Copy its KV instead of recomputing it.
            donor = max((s for s in self._slots if s is not slot), default=None,
                        key=lambda s: _common_prefix(s.cached, job.prompt_ids))
            held = min(_common_prefix(donor.cached, job.prompt_ids), limit) if donor is not None else 0
            shared = self._usable(donor, held) if donor is not None else 0
            # Or the host cache, when it holds more of the prompt than any sequence does (the
            # conversation's last turn, saved when its slot went to another).
            restored = self._restore(slot, job, max(keep, shared), limit)
            # A restore that failed to load has emptied the sequence: nothing of it is kept then.
            keep = restored or min(keep, len(slot.cached))
            if not restored and donor is not None:
                if shared >= keep + MIN_COPY_GAIN:
                    self._copy_prefix(donor, slot, shared)
                    keep = shared
        if keep == 0 or not lc.llama_memory_seq_rm(self._mem, slot.seq_id, keep, -1):
            lc.llama_memory_seq_rm(self._mem, slot.seq_id, -1, -1)
            keep = 0
        slot.follow = self._leader_for(job, keep) if isinstance(job, GenJob) and self._follow_on else None
        slot.checkpoint = 0
        if isinstance(job, GenJob) and self._n_swa and self.host_cache is not None:
            # A prefix this prompt shares with another sequence or entry that a sliding window
            # keeps from serving (sessions with one system prompt): prefilled again here, and
            # saved to the host cache when the prefill passes its end, for the next such prompt.
            seen = max(own, held, self.host_cache.lookup(self._identity, np.asarray(job.prompt_ids, dtype=np.int32),
                                                         limit, touch=False, floors=False)[1])
            if seen >= max(keep, MIN_ENTRY_TOKENS) + OWN_SLOT_TOKENS:
                slot.checkpoint = seen
        slot.cached = slot.cached[:keep]
        slot.job = job
        slot.n_fed = keep
        slot.n_cached_prompt = keep
        slot.pending = None
        slot.n_generated = 0
        slot.queue_seconds = time.perf_counter() - job.submitted
        if isinstance(job, GenJob):
            slot.detok = Detokenizer()
            slot.stopper = StopMatcher(job.sampling.stop)
            if job.resumed:
                for t in job.prompt_ids[-job.resumed:]:
                    slot.stopper.push(slot.detok.push(self._piece(t)))
                slot.n_generated = job.resumed
                slot.n_cached_prompt = min(keep, len(job.prompt_ids) - job.resumed)
            if self._draft_ngram:
                slot.history = list(job.prompt_ids)
                slot.ngrams = None
                slot.drafted = slot.accepted = 0
                slot.draft_len = self._draft_max
        self._place_sampler(slot, job)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s on sequence %d: %d prompt tokens, %d kept (own %d, another sequence %d, "
                      "restored %d), %.0f ms queued, %d running, %d cells used%s",
                      "generation" if isinstance(job, GenJob) else "scoring", slot.seq_id, len(job.prompt_ids),
                      keep, own, held, slot.n_restored, slot.queue_seconds * 1000, len(self._active()), self._used(),
                      f", waits for sequence {slot.follow[0].seq_id}'s first {slot.follow[2]}" if slot.follow else "")

    def _copy_prefix(self, donor: _Slot, slot: _Slot, n: int) -> None:
        """The donor's KV into the slot's sequence, standing for its first `n` tokens. Sequences
        live in separate KV streams; llama.cpp copies whole streams (at the next decode), and the
        caller cuts the copy back to `n` (`llama_memory_seq_rm` from `n` on)."""
        lc.llama_memory_seq_rm(self._mem, slot.seq_id, -1, -1)
        lc.llama_memory_seq_cp(self._mem, donor.seq_id, slot.seq_id, -1, -1)
        slot.cached = donor.cached[:n]
        self.prefix_copies += 1

    def _leader_for(self, job: GenJob, keep: int) -> tuple[_Slot, Job, int] | None:
        """A running request whose prompt starts as this one's for at least FOLLOW_MIN_TOKENS more
        than `keep` (what this sequence holds now) and whose prefill has not fed that far yet: this
        request waits for it and copies its KV (`_follow`) instead of computing the same prefix
        alongside it, sharing the step's prompt budget. A request that itself waits leads no other
        (each waits for the one computing)."""
        limit = len(job.prompt_ids) - 1  # at least one prompt token is decoded here, for logits
        best: tuple[_Slot, Job, int] | None = None
        for s in self._active():
            if not isinstance(s.job, GenJob) or s.follow is not None:
                continue
            shared = min(_common_prefix(s.job.prompt_ids, job.prompt_ids), limit)
            if shared > s.n_fed and shared >= keep + FOLLOW_MIN_TOKENS and (best is None or shared > best[2]):
                best = (s, s.job, shared)
        return best

    def _follow(self, slot: _Slot) -> bool:
        """Whether the waiting slot may be fed now: once its leader's KV holds the shared prefix (fed
        in an earlier step), that prefix is copied in; when the leader is gone (finished, failed,
        cancelled, paused), whatever its sequence still holds of the prefix is copied, and the rest
        prefilled here."""
        assert slot.follow is not None and isinstance(slot.job, GenJob)
        leader, led, n = slot.follow
        if leader.job is led and leader.n_fed < n:
            return False
        slot.follow = None
        job = slot.job
        have = self._usable(leader, min(_common_prefix(leader.cached, job.prompt_ids), n))
        if have < slot.n_fed + MIN_COPY_GAIN:
            return True
        self._copy_prefix(leader, slot, have)
        lc.llama_memory_seq_rm(self._mem, slot.seq_id, have, -1)
        slot.n_fed = have
        slot.n_cached_prompt = min(have, len(job.prompt_ids) - job.resumed)
        self.prefix_follows += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("sequence %d copied %d prompt tokens from sequence %d's prefill", slot.seq_id, have, leader.seq_id)
        return True

    # --- one KV cache shared by the sequences (kv_pool) ----------------------------------------

    def _used(self) -> int:
        """Cells of the shared KV the sequences hold (an upper bound: a prefix copied from another
        sequence shares that sequence's cells)."""
        return sum(len(s.cached) for s in self._slots)

    def _make_room(self, need: int, keep: _Slot | None = None) -> bool:
        """Free idle sequences' KV, least recently used first (each saved to the host cache when
        that is worth its copy), until `need` cells are free; whether they are."""
        for slot in self._idle_by_age(keep):
            if self._kv_pool - self._used() >= need:
                break
            self._evict(slot)
        return self._kv_pool - self._used() >= need

    def _idle_by_age(self, keep: _Slot | None = None) -> list[_Slot]:
        """Idle sequences holding KV (but `keep`), idle longest first."""
        return sorted((s for s in self._slots if s.job is None and s.cached and s is not keep), key=lambda s: s.idle_since)

    def _evict(self, slot: _Slot) -> None:
        """The sequence's KV out of the shared cache, saved to the host cache when worth its copy."""
        self._save(slot, 0)
        lc.llama_memory_seq_rm(self._mem, slot.seq_id, -1, -1)
        slot.cached = []

    def _unfed(self) -> int:
        """Prompt tokens the running requests have yet to prefill."""
        return sum(len(s.job.prompt_ids) - s.n_fed for s in self._active() if s.job is not None and s.pending is None)

    def _fits(self, job: Job, slot: _Slot) -> bool:
        """Room for `job` in `slot`: its prompt (less what the slot holds of it) beside what the
        running requests have yet to prefill, and a batch more, so that a request just started is
        not paused by the next step. Alone, it always fits (a request's context is at most the
        shared KV)."""
        need = self._unfed() + len(job.prompt_ids) - _common_prefix(slot.cached, job.prompt_ids) + self._n_batch
        return self._make_room(need, keep=slot) or not self._active()

    def _trim_idle(self) -> None:
        """Move idle sequences' KV out of the shared cache (to the host cache when worth the copy),
        least recently used first, while it exceeds what the running requests hold and have yet to
        prefill. llama.cpp attends over every used cell of a shared cache, masked or not, so each
        running token also pays for the idle cells: this bounds that to about its own attention.
        Measured before it (bench_speed, SmolLM2, 16 sequences' KV shared): 1 and 8 streams ran at
        0.67 and 0.57 of the per-sequence layout on the H100 after a 16-stream round had left its
        KV. A conversation's next turn then restores from host memory instead of finding its KV in
        place, a copy that costs a fraction of its prefill (a state that prefills again faster than
        it copies is not saved: then it is prefilled). Without a host cache the device is the only
        place idle KV can stay, and it stays (until its cells are needed)."""
        active = self._active()
        if not active or self.host_cache is None:
            return
        running = sum(len(s.cached) for s in active) + self._unfed()
        idle = self._idle_by_age()
        held = sum(len(s.cached) for s in idle)
        recent = time.perf_counter() - IDLE_TRIM_S
        for slot in idle:
            if held <= running or slot.idle_since > recent:
                break  # oldest first: the rest were idle for less than IDLE_TRIM_S too
            if not self._trimmable(slot) or not self._trim_paid(slot):
                continue
            held -= len(slot.cached)
            if log.isEnabledFor(logging.DEBUG):
                per = self._masked_cost.per_masked_cell if self._masked_cost is not None else None
                log.debug("idle sequence %d (%d cells) out of the shared cache: it cost the passes %.1f ms, its "
                          "copies %s (a masked cell %s per token)", slot.seq_id, len(slot.cached), slot.idle_cost * 1e3,
                          "unpriced" if slot.trim_memo[3] is None else f"{slot.trim_memo[3] * 1e3:.1f} ms",
                          "unmeasured" if per is None else f"{per * 1e9:.3f} ns")
            self._evict(slot)
            self.idle_evictions += 1

    def _trimmable(self, slot: _Slot) -> bool:
        """Whether the idle sequence's KV may leave the device for `_trim_idle`: when nothing of it
        is lost (an entry covers it, or it prefills again faster than it copies) or the host cache
        has room for it (its earlier turn's entry counted free). Not when saving it would push other
        conversations' entries out: on the H100 an agent session's KV (1.4 GiB) did, the 8 GiB
        cache held 5 of them, and a 4-session replay's later turns went from 160 to 532 ms p50
        (restores that missed) while the device had room."""
        host = self.host_cache
        assert host is not None
        if slot.trim_memo[:2] != (len(slot.cached), host.bytes):
            size = self._save_size(slot, 0)
            if size == NOT_SAVABLE:
                ok = False  # it would be lost, prefill and all
            elif size <= 0:
                ok = True  # nothing to save, or not worth a copy
            else:
                ok = host.has_room(self._identity, np.asarray(slot.cached, dtype=np.int32), size, self._floor(slot))
            cost = None
            if ok and self.prefill_tps:
                nbytes = size if size > 0 else lc.llama_state_seq_get_size(self._ctx, slot.seq_id)
                # Saved (when not held already), then restored for its next turn; at most what
                # prefilling it again takes (what a state not worth a copy costs).
                save, restore = self.save_bps or COPY_BPS_PRIOR, self.restore_bps or COPY_BPS_PRIOR
                copy = (nbytes / save if size > 0 else 0.0) + nbytes / restore
                cost = min(copy, len(slot.cached) / self.prefill_tps)
            slot.trim_memo = (len(slot.cached), host.bytes, ok, cost)
        return slot.trim_memo[2]

    def _trim_paid(self, slot: _Slot) -> bool:
        """Whether the idle sequence's cells have cost the running passes as much as moving them
        out and back would (`_trimmable` priced that): until then they stay, as a ski rental. What
        the cells cost is measured (`_charge_idle`): on the 2-core CPU a prompt chunk walks every
        masked cell and idle conversations leave soon; on the H200 an 8B model's agent sessions
        (~90-130 ms to save and restore) are charged ~300 ms while another session's first prompt
        is prefilled, and stay at TRIM_PAYBACK 8 (later turns' TTFT p95 13.2 % of a cold prefill,
        18.2 % at 1, the first turns no slower). Not priced yet (no prompt prefilled to measure the
        rate): IDLE_TRIM_S alone decides."""
        cost = slot.trim_memo[3]
        return cost is None or slot.idle_cost >= self._trim_payback * cost

    def _charge_idle(self, seconds: float, tokens: int) -> None:
        """Charge each idle sequence holding KV for the pass of the batch's first `tokens` tokens
        that took `seconds` and walked its cells, at what a masked cell costs a token as
        fitted over the passes so far (`MaskedCellCost`); until that has seen enough of them, at
        the cells' attention FLOPs over the pass's (the whole model's per token, at the measured
        prompt rate; on the H200 the fit came out near that, 2.3-5.1 ns per token and cell for a
        Llama-3-8B-shaped model against ~3.2)."""
        if self._masked_cost is None or tokens <= 0:
            return
        used = self._used()
        seq = self._batch.seq_id
        counts = Counter(seq[i][0] for i in range(tokens))  # the pass's tokens per sequence (= slot index)
        held = [(t, len(self._slots[sid].cached)) for sid, t in counts.items()]
        self._masked_cost.observe(seconds, tokens, float(sum(t * n for t, n in held)), float(sum(t * (used - n) for t, n in held)))
        per_token = self._masked_cost.per_masked_cell
        if per_token is None:
            if not self.prefill_tps:
                return
            per_token = self._cell_flops / (self._token_flops * self.prefill_tps)
        per_cell = tokens * per_token
        for slot in self._slots:
            if slot.job is None and slot.cached:
                slot.idle_cost += per_cell * len(slot.cached)

    def _fit_step(self, drafting: bool) -> None:
        """Make room for the next step's tokens: idle sequences' KV first, then pause the newest
        running requests until the step fits."""
        self._trim_idle()
        while True:
            active = self._active()
            decode = sum(1 + (self._draft_max if drafting else 0) for s in active if s.pending is not None)
            if self._make_room(min(self._n_batch, decode + self._unfed())) or len(active) <= 1:
                return
            self._preempt(max(active, key=lambda s: s.job.submitted if s.job is not None else 0.0))

    def _preempt(self, slot: _Slot) -> None:
        """Pause the slot's request: its KV to the host cache (when worth the copy), the request back
        to the head of the queue. A generation resumes with what it generated as prompt, counted as
        generated and not sent again (as after a failover); a scoring job starts over."""
        job = slot.job
        assert job is not None
        if isinstance(job, GenJob) and slot.n_fed >= len(job.prompt_ids):
            done = slot.cached[len(job.prompt_ids):] + ([slot.pending] if slot.pending is not None else [])
            job.prompt_ids = job.prompt_ids + done
            job.resumed += len(done)
        elif isinstance(job, ScoreJob):
            job.rows.clear()
        self._evict(slot)
        slot.job = None
        slot.pending = None
        slot.idle_since = time.perf_counter()
        self.preemptions += 1
        log.info("the shared KV cache is full: paused a request (%d tokens) until there is room", len(job.prompt_ids))
        with self._cv:
            self._waiting.appendleft(job)

    def _floor(self, slot: _Slot) -> int:
        """The shortest prefix of the slot's KV that can be kept: 0 without a sliding window; with
        one, the oldest position its window layers still hold plus the window less one (the next
        token, at position `keep`, attends to positions keep - window + 1 ... keep, and older ones
        have been overwritten). A window cache under pressure (one shared by several sequences)
        keeps exactly that much: the whole KV of a sequence is then still usable, no shorter part."""
        if not self._n_swa or not slot.cached:
            return 0
        pos_min = lc.llama_memory_seq_pos_min(self._mem, slot.seq_id)
        return 0 if pos_min <= 0 else pos_min + self._n_swa - 1

    def _usable(self, slot: _Slot, n: int) -> int:
        """`n` tokens of the slot's prefix if its KV can serve them, else 0."""
        return n if n >= self._floor(slot) else 0

    def _save(self, slot: _Slot, keep: int) -> None:
        """Keep the slot's KV in host memory when the new request would cut it (its conversation
        may come back after the slot has gone to others)."""
        host = self.host_cache
        size = self._save_size(slot, keep)
        if host is not None and size == NOT_WORTH_IT:
            host.skipped_saves += 1
        elif host is not None and size > 0:
            self._copy_to_host(host, slot, np.asarray(slot.cached, dtype=np.int32), size)

    def _save_size(self, slot: _Slot, keep: int) -> int:
        """Bytes `_save` would copy of the slot's KV before it is cut to `keep` tokens; else 0 (too
        short, or an entry holds it already), NOT_WORTH_IT (prefilling its new part again is
        quicker than the copy) or NOT_SAVABLE (no host cache, or the state exceeds its bound)."""
        host = self.host_cache
        if host is None:
            return NOT_SAVABLE
        if len(slot.cached) < MIN_ENTRY_TOKENS or len(slot.cached) - keep < MIN_COPY_GAIN:
            return 0
        covered = self._covered(slot)
        if covered == len(slot.cached):
            return 0
        size = lc.llama_state_seq_get_size(self._ctx, slot.seq_id)
        if size <= 0 or size > host.limit_bytes:
            return NOT_SAVABLE
        # Worth it when prefilling what no entry holds yet would take longer than the copy, and
        # long enough to matter.
        tail = len(slot.cached) - max(covered, keep)
        if self.prefill_tps and (tail / self.prefill_tps < MIN_SAVE_GAIN_S or (
                self.save_bps and tail / self.prefill_tps < size / self.save_bps)):
            return NOT_WORTH_IT
        return int(size)

    def _covered(self, slot: _Slot) -> int:
        """How much of the slot's KV (a prefix, in tokens) is held elsewhere: by a host-cache entry,
        or by another sequence's KV (a conversation whose next turn took an empty sequence and
        shared this one's cells)."""
        covered = 0
        if self.host_cache is not None:
            _, covered = self.host_cache.lookup(self._identity, np.asarray(slot.cached, dtype=np.int32),
                                                len(slot.cached), touch=False)
        if covered < len(slot.cached):
            covered = max(covered, max((self._usable(s, _common_prefix(s.cached, slot.cached))
                                        for s in self._slots if s is not slot and s.cached), default=0))
        return covered

    def _save_checkpoint(self, slot: _Slot) -> None:
        """The sequence's state at its checkpoint (its prompt's first `checkpoint` tokens, nothing
        else yet) to the host cache: a later prompt sharing that prefix restores it."""
        slot.checkpoint = 0
        host = self.host_cache
        size = lc.llama_state_seq_get_size(self._ctx, slot.seq_id)
        if host is None or size <= 0 or size > host.limit_bytes:
            return
        if self._copy_to_host(host, slot, np.asarray(slot.cached, dtype=np.int32), size):
            host.checkpoints += 1

    def _copy_to_host(self, host: HostPrefixCache, slot: _Slot, tokens: npt.NDArray[np.int32], size: int) -> bool:
        """Copy the sequence's state (`size` bytes, covering `tokens`) into the host cache, timing
        the copy; whether it was stored."""
        def fill(array: npt.NDArray[np.uint8]) -> int:
            t0 = time.perf_counter()
            n = lc.llama_state_seq_get_data(self._ctx, array.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                                            size, slot.seq_id)
            took = max(time.perf_counter() - t0, 1e-6)
            self.save_bps = host.save_bytes_per_s = _ema(self.save_bps, n / took)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("saved sequence %d: %d tokens, %.1f MiB in %.1f ms", slot.seq_id, len(tokens),
                          n / 2**20, took * 1000)
            return int(n)

        return host.put(self._identity, tokens, size, fill, self._floor(slot))

    def _restore(self, slot: _Slot, job: GenJob, keep: int, limit: int) -> int:
        """Load the longest host-cached prefix of the prompt into the slot when it beats `keep`
        (what the slot or another sequence holds) by enough to be worth it: its length, else 0."""
        host = self.host_cache
        if host is None or limit - keep < MIN_COPY_GAIN:
            return 0
        slot.lookup = "miss"
        entry, hit = host.lookup(self._identity, np.asarray(job.prompt_ids, dtype=np.int32), limit)
        if entry is None or hit < keep + MIN_COPY_GAIN or (
                self.restore_bps and self.prefill_tps and (hit - keep) / self.prefill_tps < entry.nbytes / self.restore_bps):
            host.misses += 1  # nothing, or nothing that loads faster than it prefills
            return 0
        if self._kv_pool and not self._make_room(len(entry.tokens) - len(slot.cached), keep=slot):
            host.misses += 1  # the shared KV has no room for the whole entry now: prefill the rest
            return 0
        lc.llama_memory_seq_rm(self._mem, slot.seq_id, -1, -1)
        slot.cached = []
        t0 = time.perf_counter()
        read = lc.llama_state_seq_set_data(self._ctx, entry.block.array.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                                           entry.nbytes, slot.seq_id)
        took = max(time.perf_counter() - t0, 1e-6)
        self.restore_bps = host.restore_bytes_per_s = _ema(self.restore_bps, entry.nbytes / took)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("restored sequence %d: %d tokens, %.1f MiB in %.1f ms", slot.seq_id, len(entry.tokens),
                      entry.nbytes / 2**20, took * 1000)
        if read == 0:
            log.warning("the host prefix cache's entry of %d tokens did not load; prefilling", len(entry.tokens))
            lc.llama_memory_seq_rm(self._mem, slot.seq_id, -1, -1)
            host.misses += 1
            return 0
        slot.cached = entry.tokens.tolist()
        host.hits += 1
        host.restored_tokens += hit
        slot.n_restored, slot.lookup = hit, "hit"
        return hit

    def _place_sampler(self, slot: _Slot, job: Job) -> None:
        """Sample `job` on the device when it can be, else make sure the sequence has no chain."""
        key = job.device_key if isinstance(job, GenJob) and self._device_sampling else None
        slot.on_device = slot.attach_due = False
        if key is not None and key == slot.device_key:
            lc.llama_sampler_reset(slot.device_chain)  # same chain, fresh state (penalties, seed)
            slot.on_device = True
            return
        if key is None:
            self._detach(slot)
            return
        assert isinstance(job, GenJob)
        sp = job.sampling
        if self._attach_defer and slot.device_chain is None and (sp.temperature <= 0.0 or sp.seed is None):
            # Attached at the start of a later step (`_attach_due`), not in this request's time to
            # its first token: its graph re-reserve would be. Until then the host samples. Not
            # for a seeded draw: the device's random stream would not go on from the host's, and
            # the same seed must give the same text.
            slot.attach_due = True
            return
        self._attach(slot)

    def _attach_due(self, active: list[_Slot]) -> None:
        """Attach the chains of running requests that sample on the host until then (`_place_sampler`),
        all at once (one graph re-reserve), once no running request waits for its first token or
        the oldest has waited ATTACH_DEFER_S. Sampled on the host so far, a request's chain is a
        clone of its host chain, penalties' history and random state included: the tokens are
        those of a request sampled on one side only (greedy, or unseeded and so any draw)."""
        due = [s for s in active if s.attach_due]
        if not due:
            return
        first_waits = any(isinstance(s.job, GenJob) and s.pending is None for s in active)
        oldest = min(s.job.submitted for s in due if s.job is not None)
        if first_waits and time.perf_counter() - oldest < ATTACH_DEFER_S:
            return
        for slot in due:
            slot.attach_due = False
            if self._device_sampling:
                self._attach(slot)
                self.deferred_attaches += 1

    def _attach(self, slot: _Slot) -> None:
        """Attach a chain for the slot's job (replacing the one there) and sample on the device."""
        job = slot.job
        assert isinstance(job, GenJob)
        # A new chain for this sequence: a clone, since a chain can be attached only once and
        # the job's own copy stays usable on the host.
        chain = lc.llama_sampler_clone(job.sampler)
        if lc.llama_set_sampler(self._ctx, slot.seq_id, chain):
            self._drop_device_chain(slot)
            slot.device_chain, slot.device_key, slot.on_device = chain, job.device_key, True
            self.device_attaches += 1
            return
        # The backend cannot run it (llama.cpp logs why): the host samples, from now on.
        lc.llama_sampler_free(chain)
        self._drop_device_chain(slot)
        self._device_sampling = False
        log.warning("llama.cpp cannot sample on this device; sampling on the host")

    def _detach(self, slot: _Slot) -> None:
        """Take the sequence's chain off the context and free it."""
        if slot.device_chain is not None:
            lc.llama_set_sampler(self._ctx, slot.seq_id, None)
            self._drop_device_chain(slot)

    def _drop_device_chain(self, slot: _Slot) -> None:
        if slot.device_chain is not None:
            lc.llama_sampler_free(slot.device_chain)
        slot.device_chain, slot.device_key, slot.on_device = None, None, False

    def _release_cancelled(self) -> None:
        for slot in self._active():
            if slot.job is not None and slot.job.cancelled:
                self._finish_slot(slot)

    def _finish_slot(self, slot: _Slot) -> None:
        if slot.job is not None:
            _free_job(slot.job)
        slot.job = None
        slot.pending = None
        slot.attach_due = False
        slot.idle_since = time.perf_counter()
        slot.idle_cost = 0.0

    def _detach_idle(self) -> float | None:
        """Detach the chains of sequences idle for IDLE_DETACH_S; seconds until the next is due."""
        now = time.perf_counter()
        due: float | None = None
        for slot in self._slots:
            if slot.job is None and slot.device_chain is not None:
                left = slot.idle_since + IDLE_DETACH_S - now
                if left <= 0:
                    self._detach(slot)
                else:
                    due = left if due is None else min(due, left)
        return due

    def _fail(self, slot: _Slot, exc: BaseException) -> None:
        job = slot.job
        lc.llama_memory_seq_rm(self._mem, slot.seq_id, -1, -1)
        slot.cached = []
        self._finish_slot(slot)
        if isinstance(job, GenJob):
            job.emit(exc)
        elif isinstance(job, ScoreJob):
            job.done(exc)

    def _step(self) -> None:
        batch = self._batch
        n = 0
        # (slot, index of its first output, draft tokens whose outputs follow it)
        outputs: list[tuple[_Slot, int, list[int]]] = []

        def add(slot: _Slot, token: int, want_logits: bool) -> None:
            nonlocal n
            batch.token[n] = token
            batch.pos[n] = len(slot.cached)
            batch.n_seq_id[n] = 1
            batch.seq_id[n][0] = slot.seq_id
            batch.logits[n] = want_logits
            slot.cached.append(token)
            n += 1

        active = self._active()
        drafting = bool(self._draft_ngram) and sum(s.pending is not None for s in active) <= self._draft_streams
        if self._kv_pool:
            self._fit_step(drafting)
            active = self._active()
        self._attach_due(active)
        # Decoding sequences first: one token each (plus its draft), so running streams never
        # wait for prefill.
        for slot in active:
            if slot.pending is not None:
                replaying = isinstance(slot.job, GenJob) and bool(slot.job.forced)
                draft = self._draft(slot, self._n_batch - n - 1) if drafting and not replaying else []
                outputs.append((slot, n, draft))
                # A replayed token's output is the next replayed token, not a sample: no logits
                # (the LM head is skipped; the KV cache is computed as in any step).
                add(slot, slot.pending, not replaying)
                for t in draft:
                    add(slot, t, True)
                slot.pending = None
        # Alone (nothing decoding in this step), prompts fill the batch; beside running streams,
        # they get at most the prefill budget.
        prefill_room = self._prefill_budget if n else self._n_batch
        decoding = n
        split = bool(decoding) and self._split_mixed and self._unfed() > 0
        if split:
            # One shared KV stream (kv_unified): ggml's CPU attention takes a prompt pass in tiles
            # of 64 query rows and skips a tile of cells only when every row of it masks them all,
            # so a tile holding the running streams' tokens beside a prompt chunk walks every
            # sequence's cells. As two passes, the streams' tokens take the row-wise kernel (which
            # skips masked cells one by one) and the chunk walks its own sequence's cells. On the
            # CPU, Gemma-3-270M, 4 sessions at ~14.7k tokens: a step of 3 streams' tokens and a
            # 64-token chunk took ~800 ms in one pass, 50 + 450-680 ms in two.
            self.split_steps += 1
            if not self._decode(n, outputs, active, 0):
                return
            n, outputs = 0, []
        # Requests waiting for a running prefill of their prefix (`_leader_for`): copied in once the
        # KV holds it (from earlier steps only: this step's tokens are not computed yet), and their
        # leaders' chunks end where the copy begins (a sliding window would move past it).
        stops: dict[int, int] = {}
        for slot in active:
            if slot.follow is not None and slot.job is not None and not self._follow(slot):
                leader, _, shared = slot.follow
                stops[leader.seq_id] = min(shared, stops.get(leader.seq_id, shared))
        for slot in active:
            job = slot.job
            if job is None or slot.follow is not None:  # finished in the decode pass above, or waiting
                continue
            remaining = len(job.prompt_ids) - slot.n_fed
            take = min(remaining, self._n_batch - n, prefill_room)
            if slot.seq_id in stops:
                take = min(take, stops[slot.seq_id] - slot.n_fed)
            if slot.n_fed < slot.checkpoint:
                take = min(take, slot.checkpoint - slot.n_fed)  # the step ends at the checkpoint
            if take <= 0:
                continue
            prefill_room -= take
            score = isinstance(job, ScoreJob)
            for i in range(slot.n_fed, slot.n_fed + take):
                last = i == len(job.prompt_ids) - 1
                if score or last:
                    outputs.append((slot, n, []))
                add(slot, job.prompt_ids[i], score or last)
            slot.n_fed += take
        if n:
            self._decode(n, outputs, active, n if split else n - decoding)

    def _decode(self, n: int, outputs: list[tuple[_Slot, int, list[int]]], active: list[_Slot], prompt_tokens: int) -> bool:
        """Run the batch's first `n` tokens through the model and take their outputs; False when
        llama.cpp failed it (the requests in it have failed then)."""
        self._batch.n_tokens = n
        step_started = time.perf_counter()
        rc = lc.llama_decode(self._ctx, self._batch)
        decoded = time.perf_counter()
        if rc != 0:
            reason = "no free KV cache space" if rc == 1 else f"llama_decode returned {rc}"
            for slot in {s for s, _, _ in outputs} | set(active):
                self._fail(slot, EngineFailure(f"llama.cpp could not decode: {reason}"))
            return False
        copied = False
        for slot in active:
            if slot.checkpoint and slot.n_fed == slot.checkpoint == len(slot.cached):
                self._save_checkpoint(slot)
                copied = True
        for slot, idx, draft in outputs:
            if isinstance(slot.job, ScoreJob):
                self._collect_logits(slot, idx)
            elif isinstance(slot.job, GenJob):
                if draft:
                    self._verify(slot, idx, draft)
                else:
                    self._sample(slot, idx)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("pass: %d decoding, %d prompt tokens, %.1f ms (llama_decode %.1f), %d running, %d cells used",
                      n - prompt_tokens, prompt_tokens, (time.perf_counter() - step_started) * 1000,
                      (decoded - step_started) * 1000, len(active), self._used())
        # Idle cells cost this pass's tokens, but on the CPU the running streams' tokens of a split
        # step (`_step`), whose kernel skips masked cells (a pass that also copied a state to host
        # memory is no measure of its cost).
        if not copied and (prompt_tokens or not self._split_mixed):
            self._charge_idle(time.perf_counter() - step_started, n)
        if prompt_tokens >= 64:  # a pass mostly of prompt: its rate (the sampling above waited for it)
            self.prefill_tps = _ema(self.prefill_tps, n / max(time.perf_counter() - step_started, 1e-6))
        return True

    # --- speculative decoding: n-gram drafts from the sequence's own text ---------------------

    def _draft(self, slot: _Slot, room: int) -> list[int]:
        """Up to max_draft tokens that followed the latest earlier occurrence of the text's last
        n-gram (prompt lookup), or none."""
        job = slot.job
        assert isinstance(job, GenJob) and slot.pending is not None
        hist = slot.history
        if slot.ngrams is None:  # index the prompt once per request
            slot.ngrams = {}
            ng = self._draft_ngram
            for i in range(ng, len(hist)):
                slot.ngrams[tuple(hist[i - ng : i])] = i
        start = slot.ngrams.get(tuple(hist[-self._draft_ngram :]))
        if start is None:
            return []
        left = job.max_new_tokens - slot.n_generated  # the draft's tokens plus one sampled after it
        k = min(slot.draft_len, room, left - 1, len(hist) - start)
        if k <= 0:
            return []
        draft = hist[start : start + k]
        self.drafted += len(draft)
        slot.drafted += len(draft)
        return draft

    def _remember(self, slot: _Slot, token: int) -> None:
        """Append a generated token to the lookup history and index the n-gram it completes."""
        hist = slot.history
        hist.append(token)
        ng = self._draft_ngram
        if slot.ngrams is not None and len(hist) > ng:
            slot.ngrams[tuple(hist[-ng - 1 : -1])] = len(hist) - 1

    def _verify(self, slot: _Slot, idx: int, draft: list[int]) -> None:
        """Sample each position in turn; keep the draft while it agrees with what was sampled.

        Every emitted token is sampled from the model given the tokens before it, so the output
        is distributed exactly as without drafts (and equal to it at temperature 0)."""
        base = len(slot.cached) - len(draft)  # KV length up to and including the decoded pending token
        accepted = 0
        for i in range(len(draft) + 1):
            if not self._sample(slot, idx + i):
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
            slot.draft_len = min(self._draft_max, 2 * slot.draft_len)
        else:
            slot.draft_len = max(1, accepted + 1, slot.draft_len // 2)
        keep = base + accepted
        if keep < len(slot.cached):
            lc.llama_memory_seq_rm(self._mem, slot.seq_id, keep, -1)
            del slot.cached[keep:]

    def _logits_row(self, idx: int) -> npt.NDArray[np.float32]:
        ptr = lc.llama_get_logits_ith(self._ctx, idx)
        return np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))

    def _collect_logits(self, slot: _Slot, idx: int) -> None:
        job = slot.job
        assert isinstance(job, ScoreJob)
        job.rows.append(self._logits_row(idx).copy())
        if len(job.rows) == len(job.token_ids):
            self._finish_slot(slot)
            job.done(np.stack(job.rows))

    def _sample(self, slot: _Slot, idx: int) -> bool:
        """Sample output `idx` for `slot` and emit it; False when the request finished."""
        job = slot.job
        assert isinstance(job, GenJob) and slot.detok is not None and slot.stopper is not None
        if job.forced:  # replaying what was sent before a failover
            token = job.forced.popleft()
            lc.llama_sampler_accept(job.sampler, token)
            slot.n_generated += 1
            slot.stopper.push(slot.detok.push(self._piece(token)))
            slot.pending = token
            if self._draft_ngram:
                self._remember(slot, token)
            return True
        sp = job.sampling
        logprobs: tuple[TokenLogprob, ...] = ()
        raw = self._logits_row(idx).copy() if sp.logprobs else None
        if slot.on_device:
            # The device sampled it; the chain on the host records it (penalties' history).
            token = lc.llama_get_sampled_token_ith(self._ctx, idx)
            if token == lc.LLAMA_TOKEN_NULL:
                raise EngineFailure("llama.cpp returned no token from its device sampler")
            lc.llama_sampler_accept(slot.device_chain, token)
        else:
            token = lc.llama_sampler_sample(job.sampler, self._ctx, idx)
        if raw is not None:
            logprobs = (token_logprob(raw, token, sp.top_logprobs, self._piece),)
        slot.n_generated += 1
        finish: str | None = None
        text = ""
        if self._is_eog(token) and not sp.ignore_eos:
            finish = "stop"
        else:
            text = slot.stopper.push(slot.detok.push(self._piece(token)))
            if slot.stopper.stopped:
                finish = "stop"
            elif slot.n_generated >= job.max_new_tokens:
                finish = "length"
        if finish is None:
            slot.pending = token
            if self._draft_ngram:
                self._remember(slot, token)
            first = slot.n_generated == 1
            job.emit(TokenEvent(text=text, token_ids=(token,), logprobs=logprobs,
                                prompt_tokens=len(job.prompt_ids) - job.resumed if first else 0,
                                cached_tokens=slot.n_cached_prompt if first else 0))
            return True
        text += slot.stopper.push(slot.detok.flush()) + slot.stopper.flush()
        usage = Usage(
            prompt_tokens=len(job.prompt_ids) - job.resumed,
            completion_tokens=slot.n_generated,
            cached_tokens=slot.n_cached_prompt,
            queue_seconds=slot.queue_seconds,
            prompt_ids=tuple(job.prompt_ids[:len(job.prompt_ids) - job.resumed]),
            draft_tokens=slot.drafted,
            accepted_draft_tokens=slot.accepted,
            restored_tokens=min(slot.n_restored, slot.n_cached_prompt),
            prefix_lookup=slot.lookup,
        )
        self._finish_slot(slot)
        job.emit(
            TokenEvent(
                text=text, token_ids=(token,), logprobs=logprobs, finish_reason=finish, usage=usage,
                stop_sequence=slot.stopper.matched,
            )
        )
        return False

    def _shutdown(self) -> None:
        closed = EngineClosed("the model was unloaded")
        for slot in self._active():
            self._fail(slot, closed)
        with self._cv:
            waiting, self._waiting = list(self._waiting), deque()
            embeds, self._embeds = list(self._embeds), deque()
        for ejob in embeds:
            ejob.done(closed)
        if self.embedder is not None:
            self.embedder.close()
        for slot in self._slots:
            self._detach(slot)
        for job in waiting:
            _free_job(job)
            if isinstance(job, GenJob):
                job.emit(closed)
            else:
                job.done(closed)


def _free_job(job: Job) -> None:
    if isinstance(job, GenJob) and job.sampler is not None:
        lc.llama_sampler_free(job.sampler)
        job.sampler = None


def _ema(old: float | None, new: float, weight: float = 0.3) -> float:
    return new if old is None else (1 - weight) * old + weight * new


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def sampler_key(sp: SamplingParams, penalty_window: int) -> tuple[Any, ...]:
    """What `build_sampler` builds from `sp` without a grammar: equal keys, equal chains."""
    penalties = (sp.presence_penalty, sp.frequency_penalty, sp.repeat_penalty)
    return (
        sp.logit_bias, sp.ignore_eos,
        (*penalties, penalty_window) if penalties != (0.0, 0.0, 1.0) else None,
        (sp.temperature,) if sp.temperature <= 0.0 else (sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.seed),
    )


def build_sampler(
    vocab: Any,
    n_vocab: int,
    sp: SamplingParams,
    grammar: bytes | None,
    eog_ids: list[int],
    penalty_window: int,
    lazy_patterns: list[bytes] | None = None,
) -> Any:
    """A llama.cpp sampler chain for one request.  Returns None if the grammar does not parse."""
    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    bias = list(sp.logit_bias)
    if sp.ignore_eos:
        bias += [(t, float("-inf")) for t in eog_ids]
    if bias:
        arr = (lc.llama_logit_bias * len(bias))()
        for i, (tok, b) in enumerate(bias):
            arr[i] = lc.llama_logit_bias(token=tok, bias=b)
        lc.llama_sampler_chain_add(
            chain, lc.llama_sampler_init_logit_bias(n_vocab, len(bias), arr)
        )
    if grammar is not None:
        if lazy_patterns:
            # The grammar applies from the first match of a pattern on; the text before is free.
            pats = (ctypes.c_char_p * len(lazy_patterns))(*lazy_patterns)
            g = lc.llama_sampler_init_grammar_lazy_patterns(vocab, grammar, b"root", pats, len(lazy_patterns), None, 0)
        else:
            g = lc.llama_sampler_init_grammar(vocab, grammar, b"root")
        if not g:
            lc.llama_sampler_free(chain)
            return None
        lc.llama_sampler_chain_add(chain, g)
    if sp.presence_penalty or sp.frequency_penalty or sp.repeat_penalty != 1.0:
        lc.llama_sampler_chain_add(
            chain,
            lc.llama_sampler_init_penalties(
                n_vocab, penalty_window, sp.repeat_penalty, sp.frequency_penalty, sp.presence_penalty
            ),
        )
    if sp.temperature <= 0.0:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
        return chain
    if sp.top_k > 0:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_k(sp.top_k))
    if sp.top_p < 1.0:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_p(sp.top_p, 1))
    if sp.min_p > 0.0:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_min_p(sp.min_p, 1))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(sp.temperature))
    seed = sp.seed if sp.seed is not None else lc.LLAMA_DEFAULT_SEED
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(seed & 0xFFFFFFFF))
    return chain

