"""Sequences' KV to and from the host-memory prefix cache, each copy priced against a prefill.

A sequence's state is saved when its KV is about to be cut or moved out (its conversation may
come back after the slot has gone to others) and restored for a later prompt that starts the same
way. On a GPU behind PCIe, copying a long conversation's KV can cost as much as prefilling it
again, so both directions are weighed with rates measured here.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable
from typing import Any

import llama_cpp as lc
import numpy as np
import numpy.typing as npt

from engines.llamacpp.kv_pool import MIN_COPY_GAIN
from engines.llamacpp.prefix_cache import MIN_ENTRY_TOKENS, HostPrefixCache
from engines.llamacpp.slots import GenJob, Slot, clear, common_prefix, ema, floor

log = logging.getLogger(__name__)

# Seconds of prefill a saved state must stand for: a save stops every running stream for its copy,
# and most saved states never come back (one-off prompts). A state that prefills again in less
# than this is not worth a host-cache entry (on the H100, SmolLM2's 256-token requests: saving
# each cost 4-12% of 1-16-stream throughput and 40% of TTFT; docs/benchmarks/history.md#saving-only-what-pays).
MIN_SAVE_GAIN_S = 0.05

# `save_size` verdicts besides a size: prefilling the state again beats copying it; it cannot be
# saved (no host cache, or larger than its bound).
NOT_WORTH_IT = -1
NOT_SAVABLE = -2

# Bytes per second a save or restore is priced at before one has been measured (the H100's pinned
# copies ran at 17 and 42 GB/s, the 2-core CPU's at several GB/s).
COPY_BPS_PRIOR = 8e9


class HostTransfer:
    """Saves and restores the sequences' KV through the host prefix cache (when there is one)."""

    def __init__(self, ctx: Any, slots: list[Slot], host_cache: HostPrefixCache | None, identity: str,
                 n_swa: int) -> None:
        self._ctx = ctx
        self._mem = lc.llama_get_memory(ctx)
        self._slots = slots
        self.host_cache = host_cache
        self._identity = identity
        self._n_swa = n_swa
        # Measured here (moving averages; None until seen): prompt tokens per second, and bytes per
        # second of saving a sequence's state to host memory and of loading one back. They decide
        # whether a save or a restore is worth its copy.
        self.prefill_tps: float | None = None
        self.save_bps: float | None = None
        self.restore_bps: float | None = None

    def usable(self, slot: Slot, n: int) -> int:
        """`n` tokens of the slot's prefix if its KV can serve them, else 0."""
        return n if n >= floor(self._mem, self._n_swa, slot) else 0

    def lookup(self, tokens: list[int], limit: int, floors: bool = True) -> int:
        """How many of `tokens` (at most `limit`) a host-cache entry holds, touching nothing."""
        if self.host_cache is None:
            return 0
        return self.host_cache.lookup(self._identity, np.asarray(tokens, dtype=np.int32), limit, touch=False,
                                      floors=floors)[1]

    def evict(self, slot: Slot) -> None:
        """The sequence's KV out of the device, saved to the host cache when worth its copy."""
        self.save(slot, 0)
        clear(self._mem, slot)

    def save(self, slot: Slot, keep: int) -> None:
        """Keep the slot's KV in host memory when the new request would cut it (its conversation
        may come back after the slot has gone to others)."""
        host = self.host_cache
        size = self.save_size(slot, keep)
        if host is not None and size == NOT_WORTH_IT:
            host.skipped_saves += 1
        elif host is not None and size > 0:
            self._copy_to_host(host, slot, np.asarray(slot.cached, dtype=np.int32), size)

    def save_size(self, slot: Slot, keep: int) -> int:
        """Bytes `save` would copy of the slot's KV before it is cut to `keep` tokens; else 0 (too
        short, or an entry holds it already), NOT_WORTH_IT (prefilling its new part again is
        quicker than the copy) or NOT_SAVABLE (no host cache, or the state exceeds its bound)."""
        host = self.host_cache
        if host is None:
            return NOT_SAVABLE
        if len(slot.cached) < MIN_ENTRY_TOKENS or len(slot.cached) - keep < MIN_COPY_GAIN:
            return 0
        covered = self.covered(slot)
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

    def covered(self, slot: Slot) -> int:
        """How much of the slot's KV (a prefix, in tokens) is held elsewhere: by a host-cache entry,
        or by another sequence's KV (a conversation whose next turn took an empty sequence and
        shared this one's cells)."""
        covered = self.lookup(slot.cached, len(slot.cached))
        if covered < len(slot.cached):
            covered = max(covered, max((self.usable(s, common_prefix(s.cached, slot.cached))
                                        for s in self._slots if s is not slot and s.cached), default=0))
        return covered

    def trim_price(self, slot: Slot) -> tuple[bool, float | None]:
        """Whether the idle sequence's KV may leave the device, and the seconds its copies would
        take (saved, when not held already, then restored for its next turn; at most what
        prefilling it again takes; None until a prefill rate is measured). It may leave when
        nothing of it is lost (an entry covers it, or it prefills again faster than it copies) or
        the host cache has room for it (its earlier turn's entry counted free). Not when saving it
        would push other conversations' entries out: on the H100 an agent session's KV (1.4 GiB)
        did, the 8 GiB cache held 5 of them, and a 4-session replay's later turns went from 160 to
        532 ms p50 (restores that missed) while the device had room. Kept on the slot while its KV
        and the host cache are unchanged (the lookup and state size cost too much for every step)."""
        host = self.host_cache
        assert host is not None
        if slot.trim_memo[:2] != (len(slot.cached), host.bytes):
            size = self.save_size(slot, 0)
            if size == NOT_SAVABLE:
                ok = False  # it would be lost, prefill and all
            elif size <= 0:
                ok = True  # nothing to save, or not worth a copy
            else:
                ok = host.has_room(self._identity, np.asarray(slot.cached, dtype=np.int32), size,
                                   floor(self._mem, self._n_swa, slot))
            cost = None
            if ok and self.prefill_tps:
                nbytes = size if size > 0 else lc.llama_state_seq_get_size(self._ctx, slot.seq_id)
                save, restore = self.save_bps or COPY_BPS_PRIOR, self.restore_bps or COPY_BPS_PRIOR
                copy = (nbytes / save if size > 0 else 0.0) + nbytes / restore
                cost = min(copy, len(slot.cached) / self.prefill_tps)
            slot.trim_memo = (len(slot.cached), host.bytes, ok, cost)
        return slot.trim_memo[2], slot.trim_memo[3]

    def save_checkpoint(self, slot: Slot) -> None:
        """The sequence's state at its checkpoint (its prompt's first `checkpoint` tokens, nothing
        else yet) to the host cache: a later prompt sharing that prefix restores it."""
        slot.checkpoint = 0
        host = self.host_cache
        size = lc.llama_state_seq_get_size(self._ctx, slot.seq_id)
        if host is None or size <= 0 or size > host.limit_bytes:
            return
        if self._copy_to_host(host, slot, np.asarray(slot.cached, dtype=np.int32), size):
            host.checkpoints += 1

    def _copy_to_host(self, host: HostPrefixCache, slot: Slot, tokens: npt.NDArray[np.int32], size: int) -> bool:
        """Copy the sequence's state (`size` bytes, covering `tokens`) into the host cache, timing
        the copy; whether it was stored."""
        def fill(array: npt.NDArray[np.uint8]) -> int:
            t0 = time.perf_counter()
            n = lc.llama_state_seq_get_data(self._ctx, array.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                                            size, slot.seq_id)
            took = max(time.perf_counter() - t0, 1e-6)
            self.save_bps = host.save_bytes_per_s = ema(self.save_bps, n / took)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("saved sequence %d: %d tokens, %.1f MiB in %.1f ms", slot.seq_id, len(tokens),
                          n / 2**20, took * 1000)
            return int(n)

        return host.put(self._identity, tokens, size, fill, floor(self._mem, self._n_swa, slot))

    def restore(self, slot: Slot, job: GenJob, keep: int, limit: int,
                make_room: Callable[[int, Slot], bool] | None) -> int:
        """Load the longest host-cached prefix of the prompt into the slot when it beats `keep`
        (what the slot or another sequence holds) by enough to be worth it: its length, else 0.
        In a shared KV cache, `make_room(cells, slot)` frees the cells the entry needs beside the
        slot's own (None: each sequence has its own)."""
        host = self.host_cache
        if host is None or limit - keep < MIN_COPY_GAIN:
            return 0
        slot.lookup = "miss"
        entry, hit = host.lookup(self._identity, np.asarray(job.prompt_ids, dtype=np.int32), limit)
        if entry is None or hit < keep + MIN_COPY_GAIN or (
                self.restore_bps and self.prefill_tps and (hit - keep) / self.prefill_tps < entry.nbytes / self.restore_bps):
            host.misses += 1  # nothing, or nothing that loads faster than it prefills
            return 0
        if make_room is not None and not make_room(len(entry.tokens) - len(slot.cached), slot):
            host.misses += 1  # the shared KV has no room for the whole entry now: prefill the rest
            return 0
        clear(self._mem, slot)
        t0 = time.perf_counter()
        read = lc.llama_state_seq_set_data(self._ctx, entry.block.array.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                                           entry.nbytes, slot.seq_id)
        took = max(time.perf_counter() - t0, 1e-6)
        self.restore_bps = host.restore_bytes_per_s = ema(self.restore_bps, entry.nbytes / took)
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
