"""Continuous batching over llama.cpp's low-level API: the step loop.

One thread owns the `llama_context`.  Every active request holds a slot (engines/llamacpp/slots.py):
its own KV sequence id, sampler chain, detokenizer and stop matcher.  Each step builds one
`llama_batch` with one token per decoding sequence plus chunks of pending prompts (chunked
prefill, so a long prompt cannot stall running streams), calls `llama_decode` once (twice in the
shared KV layout on the CPU: the decoding tokens, then the prompt chunks; `_step` says why), then
samples each sequence that produced logits.
Requests join and leave the batch at token boundaries.  A finished slot keeps its tokens in the KV
cache, so a later request sharing a prefix (the next chat turn, a common system prompt) only
prefills the part that differs (prefix.py), or restores it from host memory (host_transfer.py).
In one KV cache shared by the sequences, kv_pool.py decides which sequence gives way; the
scheduler carries its decisions out.  Drafts (speculation.py) and device sampler chains
(sampling.py) plug into the step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import llama_cpp as lc
import numpy as np
import numpy.typing as npt

from engines.base import EngineClosed, EngineFailure, EngineOverloaded, KvStats
from engines.llamacpp import prefix
from engines.llamacpp.host_transfer import HostTransfer
from engines.llamacpp.kv_pool import MIN_COPY_GAIN, TRIM_PAYBACK
from engines.llamacpp.load_settings import PrefillPlan
from engines.llamacpp.outputs import Outputs
from engines.llamacpp.prefix_cache import MIN_ENTRY_TOKENS, HostPrefixCache
from engines.llamacpp.sampling import DeviceSampler, build_sampler, sampler_key
from engines.llamacpp.shared_kv import SharedKv
from engines.llamacpp.slots import (
    EmbedJob,
    GenJob,
    Job,
    ScoreJob,
    Slot,
    active,
    clear,
    common_prefix,
    ema,
    free_job,
    release,
    unfed,
    used,
)
from engines.llamacpp.speculation import NgramDrafter
from engines.llamacpp.vision import Vision, floor_media, media_at, next_media
from engines.steptrace import StepTrace
from engines.text import Detokenizer, StopMatcher

__all__ = ["TRIM_PAYBACK", "BatchScheduler", "EmbedJob", "GenJob", "ScoreJob", "build_sampler", "sampler_key"]

log = logging.getLogger(__name__)
# Each step keeps this share of the peak of sequences in use (a half-life of ~70 steps): requests
# that finish together and come back a few at a time still count as the load they are.
LOAD_HOLD = 0.99


class BatchScheduler:
    """Runs every request of one model on one llama_context, batched."""

    def __init__(self, ctx: Any, n_vocab: int, n_parallel: int, n_batch: int, max_queue: int,
                 piece: Callable[[int], bytes], is_eog: Callable[[int], bool], device_sampling: bool = False,
                 draft_ngram: int = 0, draft_max: int = 0, draft_streams: int = 1,
                 host_cache: HostPrefixCache | None = None, identity: str = "", prefill: PrefillPlan | None = None,
                 overlap: bool = False,
                 n_swa: int = 0, kv_pool: int = 0, n_cells: int = 0, split_mixed: bool = False,
                 follow: bool = True, attach_defer: bool = True, trim_payback: float = TRIM_PAYBACK,
                 trace: StepTrace | None = None, vision: Vision | None = None) -> None:
        self._ctx = ctx
        self._vision = vision  # the model's vision projector: feeds prompts' images
        self._trace = trace
        self._mem = lc.llama_get_memory(ctx)
        self._n_cells = n_cells  # the KV cache's cells, every sequence's (reported in kv_stats)
        # A step with both running streams and prompt chunks as two passes (the shared layout on
        # the CPU: `_split_pass` says why).
        self._split_mixed = split_mixed
        # The sliding window of the model's SWA layers when their KV keeps only the window
        # (swa_full off): a sequence's KV then serves a prefix only if the window before its end is
        # still there (slots.floor). 0: every layer keeps every position.
        self._n_swa = n_swa
        self._slots = [Slot(seq_id=i) for i in range(n_parallel)]
        # Sequences' KV saved to host memory when their slot is reused, restored for a later
        # prompt that starts the same way (the next turn of a conversation that lost its slot).
        self.host_cache = host_cache
        self._identity = identity
        self._host = HostTransfer(ctx, self._slots, host_cache, identity, n_swa)
        self._spec = NgramDrafter(self._mem, draft_ngram, draft_max, draft_streams)
        self._draft_ngram = self._spec.ngram
        self._draft = self._spec.draft  # called per token
        # Drafts are verified on the host, one output at a time (a device chain samples every
        # output of a step at once, before the first rejection is known).
        self._device = DeviceSampler(ctx, device_sampling and not self._draft_ngram, attach_defer)
        # Prompt tokens a step takes beside decoding sequences (PrefillPlan), so a long prompt slows
        # them by a bounded amount instead of stalling them for its prefill; alone, the whole batch.
        self._prefill = prefill if prefill is not None and prefill.budget > 0 else PrefillPlan(n_batch)
        self._load = 0.0  # sequences in use, its peak held over a few hundred steps (LOAD_HOLD)
        self._n_batch, self._max_queue = n_batch, max_queue
        self._piece = piece
        outputs = Outputs(ctx, n_vocab, piece, is_eog, self._spec.remember if self._draft_ngram else None)
        self._sample, self._collect_logits, self._skip_rows = outputs.sample, outputs.collect_logits, outputs.skip_rows
        # A pass's tokens made text and events while the next pass runs (`Outputs` says how); not
        # with the shared layout, whose steps may pause a request between passes.
        self._flush, self._overlap = outputs.flush, overlap and not kv_pool
        self._batch = lc.llama_batch_init(n_batch, 0, 1)
        # One KV cache shared by the sequences (kv_unified), of `kv_pool` cells (0: one stream per
        # sequence, each with its own context).
        self._shared = SharedKv(ctx, self._slots, self._host, kv_pool, n_batch, trim_payback,
                                self._requeue) if kv_pool else None
        self._follow_on = follow  # whether a prompt may wait for a running prefill of its prefix
        self.split_steps = 0  # steps run as two passes (`_step`)
        self.prefix_copies = 0  # prompts that took their prefix from another sequence's KV
        self.prefix_follows = 0  # of those, prompts that waited for a running prefill to copy it
        self.step_started = 0.0  # perf_counter() when the running step began; 0 between steps
        self._waiting: deque[Job] = deque()
        self._embeds: deque[EmbedJob] = deque()
        self.embedder: Any = None  # engines.llamacpp.embed.Embedder, set by the engine
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="llamacpp-batch", daemon=True)
        self._thread.start()

    @property
    def preemptions(self) -> int:
        """Requests paused because the shared KV was full."""
        return self._shared.preemptions if self._shared is not None else 0

    @property
    def idle_evictions(self) -> int:
        """Idle sequences' KV moved out of the shared cache."""
        return self._shared.idle_evictions if self._shared is not None else 0

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
        best = max((common_prefix(list(s.cached), tokens) for s in self._slots), default=0)
        if self.host_cache is not None:
            best = max(best, self._host.lookup(tokens, len(tokens)))
        return best

    def kv_stats(self) -> KvStats:
        """The KV cache's cells, what the sequences hold of them, and the shared cache's counters."""
        slots = list(self._slots)
        return KvStats(cells=self._n_cells, used=used(slots), idle=sum(len(s.cached) for s in slots if s.job is None),
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
                    self._cv.wait(self._device.detach_idle(self._slots))
                if self._stopping:
                    break
                self._drop_cancelled_waiting()
                self._admit()
                embeds, self._embeds = list(self._embeds), deque()
            self.step_started = started = time.perf_counter()
            for ejob in embeds:
                self._embed(ejob)
            self._release_cancelled()
            if running := self._active():
                try:
                    self._step()
                except Exception as exc:  # a runtime failure must not kill the thread silently
                    log.exception("llama.cpp batch step failed")
                    for slot in self._active():
                        self._fail(slot, EngineFailure(f"llama.cpp failed: {exc}"))
                if self._trace is not None:
                    self._trace.span("step", started, time.perf_counter(), sequences=len(running),
                                     waiting=len(self._waiting), embeds=len(embeds))
            self.step_started = 0.0
            if not self._active():
                self._flush()
            self._device.detach_idle(self._slots)
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

    def _active(self) -> list[Slot]:
        return active(self._slots)

    def _drop_cancelled_waiting(self) -> None:
        kept: deque[Job] = deque()
        for job in self._waiting:
            if job.cancelled:
                free_job(job)
            else:
                kept.append(job)
        self._waiting = kept

    def _admit(self) -> None:
        free = [s for s in self._slots if s.job is None]
        while self._waiting and free:
            job = self._waiting[0]
            slot = self._slot_for(job, free)
            if self._shared is not None and not self._shared.fits(job, slot):
                break  # in order: the first waiting request starts first
            self._waiting.popleft()
            free.remove(slot)
            self._start(slot, job)

    def _slot_for(self, job: Job, free: list[Slot]) -> Slot:
        return self._shared.slot_for(job, free) if self._shared is not None else prefix.own_slot(job, free)

    def _start(self, slot: Slot, job: Job) -> None:
        keep = own = held = 0
        slot.n_restored, slot.lookup = 0, ""
        if isinstance(job, GenJob):
            keep, own, held = self._reuse_prefix(slot, job)
            keep = floor_media(job.media, keep)  # an image is fed whole
        if keep == 0 or not lc.llama_memory_seq_rm(self._mem, slot.seq_id, keep, -1):
            lc.llama_memory_seq_rm(self._mem, slot.seq_id, -1, -1)
            keep = 0
        # (A prompt with images takes no stops inside them: no waiting for another's prefill, no checkpoint.)
        plain = isinstance(job, GenJob) and not job.media
        slot.follow = prefix.leader_for(self._active(), job, keep) if isinstance(job, GenJob) and plain and \
            self._follow_on else None
        slot.checkpoint = self._checkpoint_for(job, keep, max(own, held)) if plain else 0
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
                    slot.stopper.push(slot.detok.push(job.shown.get(t) or self._piece(t)))
                slot.n_generated = job.resumed
                slot.n_cached_prompt = min(keep, len(job.prompt_ids) - job.resumed)
            if self._draft_ngram:
                self._spec.start(slot, job)
        self._device.place(slot, job)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s on sequence %d: %d prompt tokens, %d kept (own %d, another sequence %d, "
                      "restored %d), %.0f ms queued, %d running, %d cells used%s",
                      "generation" if isinstance(job, GenJob) else "scoring", slot.seq_id, len(job.prompt_ids),
                      keep, own, held, slot.n_restored, slot.queue_seconds * 1000, len(self._active()),
                      used(self._slots),
                      f", waits for sequence {slot.follow[0].seq_id}'s first {slot.follow[2]}" if slot.follow else "")

    def _reuse_prefix(self, slot: Slot, job: GenJob) -> tuple[int, int, int]:
        """How much of the prompt the slot keeps: its own cached prefix, another sequence's copied
        in, or the host cache's restored. (kept, the slot's own prefix, another sequence's)."""
        # At least one prompt token must be decoded for logits.
        limit = len(job.prompt_ids) - 1
        own = min(common_prefix(slot.cached, job.prompt_ids), limit)
        keep = self._host.usable(slot, own)
        self._host.save(slot, keep)
        # Another sequence (running or finished) may hold a longer prefix: a shared system
        # prompt, the previous turn of this chat. Copy its KV instead of recomputing it.
        donor = prefix.donor_for(self._slots, slot, job.prompt_ids)
        held = min(common_prefix(donor.cached, job.prompt_ids), limit) if donor is not None else 0
        shared = self._host.usable(donor, held) if donor is not None else 0
        # Or the host cache, when it holds more of the prompt than any sequence does (the
        # conversation's last turn, saved when its slot went to another).
        restored = self._host.restore(slot, job, max(keep, shared), limit,
                                      self._shared.make_room if self._shared is not None else None)
        # A restore that failed to load has emptied the sequence: nothing of it is kept then.
        keep = restored or min(keep, len(slot.cached))
        if not restored and donor is not None:
            if shared >= keep + MIN_COPY_GAIN:
                prefix.copy_prefix(self._mem, donor, slot, shared)
                self.prefix_copies += 1
                keep = shared
        return keep, own, held

    def _checkpoint_for(self, job: Job, keep: int, shared: int) -> int:
        """Where the prompt's state goes to the host cache on the way (0: nowhere). With a sliding
        window, a prefix this prompt shares with another sequence or entry (`shared` tokens, or
        more in the cache) that the window keeps from serving (sessions with one system prompt) is
        prefilled again here, and saved when the prefill passes its end, for the next such prompt."""
        if not isinstance(job, GenJob) or not self._n_swa or self.host_cache is None:
            return 0
        seen = max(shared, self._host.lookup(job.prompt_ids, len(job.prompt_ids) - 1, floors=False))
        return seen if seen >= max(keep, MIN_ENTRY_TOKENS) + prefix.OWN_SLOT_TOKENS else 0

    def _follow(self, slot: Slot) -> bool:
        """Whether the slot waiting for its leader's prefill may be fed now (prefix.take_followed)."""
        copied = prefix.take_followed(self._mem, slot, self._host.usable)
        if copied is None:
            return False
        if copied:
            self.prefix_copies += 1
            self.prefix_follows += 1
        return True

    def _requeue(self, job: Job) -> None:
        """A paused request back to the head of the queue."""
        with self._cv:
            self._waiting.appendleft(job)

    # --- requests leaving ---------------------------------------------------------------------

    def _release_cancelled(self) -> None:
        for slot in self._active():
            if slot.job is not None and slot.job.cancelled:
                release(slot)

    def _fail(self, slot: Slot, exc: BaseException) -> None:
        self._flush()  # the tokens taken before the failure go out first
        job = slot.job
        clear(self._mem, slot)
        release(slot)
        if isinstance(job, GenJob):
            job.emit(exc)
        elif isinstance(job, ScoreJob):
            job.done(exc)

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
            self._device.detach(slot)
        for job in waiting:
            free_job(job)
            if isinstance(job, GenJob):
                job.emit(closed)
            else:
                job.done(closed)

    # --- the step ------------------------------------------------------------------------------

    def _step(self) -> None:
        """One step: the decoding sequences' tokens, then prompt chunks, in one pass (or two:
        `_split_pass` says why), and their outputs taken; then up to `prefill_passes - 1` more."""
        n = 0
        # (slot, index of its first output, draft tokens whose outputs follow it)
        outputs: list[tuple[Slot, int, list[int]]] = []
        running, drafting = self._prepare()
        # Decoding sequences first: one token each (plus its draft), so running streams never
        # wait for prefill.
        for slot in running:
            if slot.pending is not None:
                replaying = isinstance(slot.job, GenJob) and bool(slot.job.forced)
                draft = self._draft(slot, self._n_batch - n - 1) if drafting and not replaying else []
                outputs.append((slot, n, draft))
                # A replayed token's output is the next replayed token, not a sample: no logits
                # (the LM head is skipped; the KV cache is computed as in any step).
                self._put(n, slot, slot.pending, not replaying)
                n += 1
                for t in draft:
                    self._put(n, slot, t, True)
                    n += 1
                slot.pending = None
        # Alone (nothing decoding in this step), prompts fill the batch; beside running streams,
        # they get at most the plan's budget.
        decoding = n
        self._load = max(len(running), self._load * LOAD_HOLD)
        budget, passes = self._prefill.for_step(round(self._load))
        split = bool(decoding) and self._split_mixed and unfed(self._slots) > 0
        if split:
            if not self._split_pass(n, outputs, running):
                return
            n, outputs = 0, []
        n = self._feed(running, n, budget if decoding else self._n_batch, outputs)
        if not n or not self._decode(n, outputs, running, n if split else n - decoding):
            return
        # More prompt passes while the streams wait: a burst of prompts then costs each stream one
        # long gap instead of one per pass (the shared layout fits each step's tokens to its KV
        # first: one pass a step there). Requests that came meanwhile join the next pass.
        for _ in range(passes - 1 if decoding and self._shared is None else 0):
            running, outputs = self._admitted(), []
            self._load = max(len(running), self._load)
            if self._prefill.for_step(round(self._load))[1] == 1:
                break  # those admitted made them more than the plan's passes allow: one chunk a step now
            n = self._feed(running, 0, budget, outputs)
            if not n or not self._decode(n, outputs, running, n):
                return

    def _admitted(self) -> list[Slot]:
        """The running slots, once the requests that came since the step began are admitted."""
        with self._cv:
            self._drop_cancelled_waiting()
            self._admit()
        self._release_cancelled()
        return self._active()

    def _put(self, n: int, slot: Slot, token: int, want_logits: bool) -> None:
        """The batch's token `n`: `token` at the end of the slot's sequence."""
        batch = self._batch
        batch.token[n] = token
        batch.pos[n] = len(slot.cached)
        batch.n_seq_id[n] = 1
        batch.seq_id[n][0] = slot.seq_id
        batch.logits[n] = want_logits
        slot.cached.append(token)

    def _feed(self, running: list[Slot], n: int, room: int, outputs: list[tuple[Slot, int, list[int]]]) -> int:
        """The running requests' prompt chunks after the batch's first `n` tokens, at most `room`
        of them (and what the batch holds); the batch's tokens now."""
        stops = self._follow_stops(running)
        for slot in running:
            job = slot.job
            if job is None or slot.follow is not None or slot.n_fed >= len(job.prompt_ids) or \
                    not self._feed_image(slot, job):
                continue  # finished in the decode pass above, waiting, fed, or its image failed
            take = self._chunk(slot, job, min(self._n_batch - n, room), stops)
            if take <= 0:
                continue
            room -= take
            score = isinstance(job, ScoreJob)
            for i in range(slot.n_fed, slot.n_fed + take):
                last = i == len(job.prompt_ids) - 1
                if score or last:
                    outputs.append((slot, n, []))
                self._put(n, slot, job.prompt_ids[i], score or last)
                n += 1
            slot.n_fed += take
        return n

    def _prepare(self) -> tuple[list[Slot], bool]:
        """The running slots and whether they draft in this step, once its tokens fit the shared
        KV (pausing some) and the chains due are attached."""
        running = self._active()
        drafting = bool(self._draft_ngram) and sum(s.pending is not None for s in running) <= self._spec.streams
        if self._shared is not None:
            self._shared.fit_step(1 + (self._spec.draft_max if drafting else 0))
            running = self._active()
        self._device.attach_due(running)
        return running, drafting

    def _split_pass(self, n: int, outputs: list[tuple[Slot, int, list[int]]], running: list[Slot]) -> bool:
        """The step's decoding tokens as a pass of their own, before its prompt chunks (in one
        shared KV stream, kv_unified, on the CPU: `split_mixed`); False when it failed. ggml's CPU
        attention takes a prompt pass in tiles of 64 query rows and skips a tile of cells only when
        every row of it masks them all, so a tile holding the running streams' tokens beside a
        prompt chunk walks every sequence's cells. As two passes, the streams' tokens take the
        row-wise kernel (which skips masked cells one by one) and the chunk walks its own
        sequence's cells. On the CPU, Gemma-3-270M, 4 sessions at ~14.7k tokens: a step of 3
        streams' tokens and a 64-token chunk took ~800 ms in one pass, 50 + 450-680 ms in two."""
        self.split_steps += 1
        return self._decode(n, outputs, running, 0)

    def _follow_stops(self, running: list[Slot]) -> dict[int, int]:
        """Requests waiting for a running prefill of their prefix (prefix.leader_for): copied in
        once the KV holds it (from earlier steps only: this step's tokens are not computed yet).
        Their leaders' chunks end where the copy begins (a sliding window would move past it):
        those ends, by the leader's sequence id."""
        stops: dict[int, int] = {}
        for slot in running:
            if slot.follow is not None and slot.job is not None and not self._follow(slot):
                leader, _, shared = slot.follow
                stops[leader.seq_id] = min(shared, stops.get(leader.seq_id, shared))
        return stops

    def _feed_image(self, slot: Slot, job: Job) -> bool:
        """The image that starts where the slot's prompt stands, if one does, decoded whole now (its own
        pass, before the step's batch, after the text before it). False: it failed, and the request with it."""
        m = media_at(job.media, slot.n_fed)
        if m is None:
            return True
        assert self._vision is not None
        try:
            self._vision.feed(self._ctx, m, len(slot.cached), slot.seq_id, self._n_batch)
        except EngineFailure as exc:
            self._fail(slot, exc)
            return False
        slot.cached.extend(job.prompt_ids[slot.n_fed : slot.n_fed + m.n_tokens])
        slot.n_fed += m.n_tokens
        if isinstance(job, ScoreJob):  # its positions have no logits
            self._skip_rows(slot, m.n_tokens)
        return True

    def _chunk(self, slot: Slot, job: Job, room: int, stops: dict[int, int]) -> int:
        """Prompt tokens the slot feeds in this step, with `room` left in the batch and budget."""
        take = min(len(job.prompt_ids) - slot.n_fed, room)
        if job.media:
            image = next_media(job.media, slot.n_fed)
            if image is not None:
                take = min(take, image - slot.n_fed)  # up to the next image, fed whole next step
        if slot.seq_id in stops:
            take = min(take, stops[slot.seq_id] - slot.n_fed)
        if slot.n_fed < slot.checkpoint:
            take = min(take, slot.checkpoint - slot.n_fed)  # the step ends at the checkpoint
        return take

    def _decode(self, n: int, outputs: list[tuple[Slot, int, list[int]]], running: list[Slot], prompt_tokens: int) -> bool:
        """Run the batch's first `n` tokens through the model and take their outputs; False when
        llama.cpp failed it (the requests in it have failed then)."""
        self._batch.n_tokens = n
        step_started = time.perf_counter()
        if prompt_tokens:  # llama_decode returns only once all but the last of its micro-batches ran
            self._flush()
        rc = lc.llama_decode(self._ctx, self._batch)
        self._flush()  # the last pass's events, while this one runs on the device
        if self._trace is not None:  # a device's pass runs on after the call: its time, apart from the host's work
            lc.llama_synchronize(self._ctx)
        decoded = time.perf_counter()
        if rc != 0:
            reason = "no free KV cache space" if rc == 1 else f"llama_decode returned {rc}"
            for slot in {s for s, _, _ in outputs} | set(running):
                self._fail(slot, EngineFailure(f"llama.cpp could not decode: {reason}"))
            return False
        copied = False
        for slot in running:
            if slot.checkpoint and slot.n_fed == slot.checkpoint == len(slot.cached):
                self._host.save_checkpoint(slot)
                copied = True
        for slot, idx, draft in outputs:
            if isinstance(slot.job, ScoreJob):
                self._collect_logits(slot, idx)
            elif isinstance(slot.job, GenJob):
                if draft:
                    self._spec.verify(slot, idx, draft, self._sample)
                else:
                    self._sample(slot, idx, self._overlap)
        if self._trace is not None:
            self._trace.span("llama_decode", step_started, decoded, decoding=n - prompt_tokens,
                             prompt_tokens=prompt_tokens, cells=used(self._slots))
            self._trace.span("outputs", decoded, time.perf_counter(), outputs=len(outputs))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("pass: %d decoding, %d prompt tokens, %.1f ms (llama_decode %.1f), %d running, %d cells used",
                      n - prompt_tokens, prompt_tokens, (time.perf_counter() - step_started) * 1000,
                      (decoded - step_started) * 1000, len(running), used(self._slots))
        # Idle cells cost this pass's tokens, but on the CPU the running streams' tokens of a split
        # step (`_step`), whose kernel skips masked cells (a pass that also copied a state to host
        # memory is no measure of its cost).
        if self._shared is not None and not copied and (prompt_tokens or not self._split_mixed):
            self._shared.charge_idle(self._batch, time.perf_counter() - step_started, n)
        if prompt_tokens >= 64:  # a pass mostly of prompt: its rate (the sampling above waited for it)
            self._host.prefill_tps = ema(self._host.prefill_tps, n / max(time.perf_counter() - step_started, 1e-6))
        return True
