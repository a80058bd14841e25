"""One KV cache shared by the sequences (kv_unified): kv_pool's decisions, carried out on the slots.

The policies themselves are pure functions in kv_pool.py; this keeps what they need measured (what
idle cells cost the running passes) and does what they decide (moves KV out through the host
cache, pauses requests).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import llama_cpp as lc

from engines.llamacpp import kv_pool
from engines.llamacpp.host_transfer import HostTransfer
from engines.llamacpp.kv_pool import PoolSeq
from engines.llamacpp.pass_cost import MaskedCellCost
from engines.llamacpp.slots import GenJob, Job, ScoreJob, Slot, active, common_prefix, unfed, used

log = logging.getLogger(__name__)


class SharedKv:
    """The shared cache of `capacity` cells over the scheduler's slots."""

    def __init__(self, ctx: Any, slots: list[Slot], host: HostTransfer, capacity: int, n_batch: int,
                 trim_payback: float, requeue: Callable[[Job], None]) -> None:
        self._slots = slots
        self._host = host
        self._capacity = capacity
        self._n_batch = n_batch
        self._trim_payback = trim_payback  # kv_pool.TRIM_PAYBACK, or another for a side-by-side run
        self._requeue = requeue  # puts a paused request back at the head of the queue
        # What other sequences' cells cost a pass over the shared cache, fitted from the passes.
        self._masked_cost = MaskedCellCost()
        # FLOPs of a token's attention per KV cell it walks (QK and PV over every layer's heads;
        # n_embd stands for heads x head size), and of the rest of a token's pass (2 per weight):
        # what prices the cells idle sequences leave in a shared cache (`charge_idle`).
        model = lc.llama_get_model(ctx)
        self._cell_flops = 4.0 * lc.llama_model_n_layer(model) * lc.llama_model_n_embd(model)
        self._token_flops = 2.0 * max(lc.llama_model_n_params(model), 1)
        self.preemptions = 0  # requests paused because the shared KV was full
        self.idle_evictions = 0  # idle sequences' KV moved out of the shared cache by `trim_idle`

    def _state(self) -> list[PoolSeq]:
        """The cache as kv_pool's policies see it."""
        return [PoolSeq(s.seq_id, len(s.cached), s.job is not None, s.idle_since, s.idle_cost,
                        s.job.submitted if s.job is not None else 0.0, s.pending is not None,
                        len(s.job.prompt_ids) - s.n_fed if s.job is not None and s.pending is None else 0)
                for s in self._slots]

    def slot_for(self, job: Job, free: list[Slot]) -> Slot:
        """The free sequence a request takes (kv_pool.free_slot_by_prefix, kv_pool.least_missed)."""
        cells = [len(s.cached) for s in free]
        held = [common_prefix(s.cached, job.prompt_ids) if s.cached else 0 for s in free]
        i = kv_pool.free_slot_by_prefix(cells, held)
        if i is None:
            i = kv_pool.least_missed(cells, [self._host.covered(s) for s in free], [s.idle_since for s in free])
        return free[i]

    def make_room(self, need: int, keep: Slot | None = None) -> bool:
        """Free idle sequences' KV (kv_pool.evictions) until `need` cells are free; whether they are."""
        if kv_pool.has_room(self._capacity, used(self._slots), need):
            return True
        evict, fits = kv_pool.evictions(self._state(), self._capacity, need, None if keep is None else keep.seq_id)
        for seq_id in evict:
            self._host.evict(self._slots[seq_id])
        return fits

    def fits(self, job: Job, slot: Slot) -> bool:
        """Room for `job` in `slot` (kv_pool.start_need). Alone, it always fits (a request's
        context is at most the shared KV)."""
        need = kv_pool.start_need(unfed(self._slots), len(job.prompt_ids), common_prefix(slot.cached, job.prompt_ids),
                                  self._n_batch)
        return self.make_room(need, keep=slot) or not active(self._slots)

    def fit_step(self, per_decode: int) -> None:
        """Make room for the next step's tokens (kv_pool.fit_step), each decoding sequence taking
        `per_decode`: idle sequences' KV first, then pause the newest running requests until the
        step fits."""
        self.trim_idle()
        running = active(self._slots)
        need = kv_pool.step_need(self._n_batch, per_decode * sum(s.pending is not None for s in running), unfed(running))
        if kv_pool.has_room(self._capacity, used(self._slots), need):
            return
        evict, pause = kv_pool.fit_step(self._state(), self._capacity, self._n_batch, per_decode)
        for seq_id in evict:
            self._host.evict(self._slots[seq_id])
        for seq_id in pause:
            self._preempt(self._slots[seq_id])

    def _preempt(self, slot: Slot) -> None:
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
        self._host.evict(slot)
        slot.job = None
        slot.pending = None
        slot.idle_since = time.perf_counter()
        self.preemptions += 1
        log.info("the shared KV cache is full: paused a request (%d tokens) until there is room", len(job.prompt_ids))
        self._requeue(job)

    def trim_idle(self) -> None:
        """Move idle sequences' KV out of the shared cache (kv_pool.trim), to the host cache when
        worth the copy. Measured before it (bench_speed, SmolLM2, 16 sequences' KV shared): 1 and 8
        streams ran at 0.67 and 0.57 of the per-sequence layout on the H100 after a 16-stream round
        had left its KV. A conversation's next turn then restores from host memory instead of
        finding its KV in place, a copy that costs a fraction of its prefill (a state that
        prefills again faster than it copies is not saved: then it is prefilled). Without a host
        cache the device is the only place idle KV can stay, and it stays (until its cells are
        needed)."""
        running = active(self._slots)
        if not running or self._host.host_cache is None:
            return
        if not kv_pool.trim_wanted(sum(len(s.cached) for s in self._slots if s.job is None),
                                   used(running) + unfed(running)):
            return
        for seq_id in kv_pool.trim(self._state(), time.perf_counter(), kv_pool.IDLE_TRIM_S, self._trim_payback,
                                   self._trim_price):
            slot = self._slots[seq_id]
            if log.isEnabledFor(logging.DEBUG):
                per = self._masked_cost.per_masked_cell
                log.debug("idle sequence %d (%d cells) out of the shared cache: it cost the passes %.1f ms, its "
                          "copies %s (a masked cell %s per token)", slot.seq_id, len(slot.cached), slot.idle_cost * 1e3,
                          "unpriced" if slot.trim_memo[3] is None else f"{slot.trim_memo[3] * 1e3:.1f} ms",
                          "unmeasured" if per is None else f"{per * 1e9:.3f} ns")
            self._host.evict(slot)
            self.idle_evictions += 1

    def _trim_price(self, seq_id: int) -> tuple[bool, float | None]:
        return self._host.trim_price(self._slots[seq_id])

    def charge_idle(self, batch: Any, seconds: float, tokens: int) -> None:
        """Charge each idle sequence holding KV for the pass of the batch's first `tokens` tokens
        that took `seconds` and walked its cells, at what a masked cell costs a token as
        fitted over the passes so far (`MaskedCellCost`); until that has seen enough of them, at
        the cells' attention FLOPs over the pass's (the whole model's per token, at the measured
        prompt rate; on the H200 the fit came out near that, 2.3-5.1 ns per token and cell for a
        Llama-3-8B-shaped model against ~3.2)."""
        if tokens <= 0:
            return
        cells = used(self._slots)
        seq = batch.seq_id
        counts = Counter(seq[i][0] for i in range(tokens))  # the pass's tokens per sequence (= slot index)
        held = [(t, len(self._slots[sid].cached)) for sid, t in counts.items()]
        self._masked_cost.observe(seconds, tokens, float(sum(t * n for t, n in held)),
                                  float(sum(t * (cells - n) for t, n in held)))
        per_token = self._masked_cost.per_masked_cell
        if per_token is None:
            if not self._host.prefill_tps:
                return
            per_token = self._cell_flops / (self._token_flops * self._host.prefill_tps)
        per_cell = tokens * per_token
        for slot in self._slots:
            if slot.job is None and slot.cached:
                slot.idle_cost += per_cell * len(slot.cached)
