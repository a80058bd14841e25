"""Host-memory prefix cache: the KV of sequences that left their slot, restored on a later prompt.

A sequence slot is reused for a new request at every turn of every conversation; with more
conversations than slots, the KV of a conversation is overwritten before its next turn arrives
(measured on a 2-core CPU: 3-4 % of follow-up prompt tokens from cache with 16 conversations on 8
slots, docs/benchmarks/history.md#ray-serve).
Before a slot's KV is cut, it is saved here (`llama_state_seq_get_data`: the cells of one sequence,
with their positions); a new request whose prompt starts with a saved entry's tokens gets them
back into its slot (`llama_state_seq_set_data`) instead of prefilling them.

One per engine, bounded in bytes, least recently used first out. Every entry also carries the
identity of the engine that wrote it (the model file, the llama.cpp build and device, the KV
layout): a state is only ever restored into an engine of the same identity.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from engines.base import PrefixCacheStats
from engines.llamacpp.host_memory import Block, HostMemory

# Entries shorter than this are not worth a save (their prefill is cheaper than the bookkeeping).
MIN_ENTRY_TOKENS = 64


def common_prefix(a: npt.NDArray[np.int32], b: npt.NDArray[np.int32]) -> int:
    """Length of the common prefix of two token arrays."""
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


@dataclass(eq=False)
class Entry:
    identity: str
    tokens: npt.NDArray[np.int32]  # the tokens whose KV `block` holds, from position 0
    block: Block  # its `array` holds llama_state_seq_get_data's output
    nbytes: int
    # The shortest prefix of `tokens` this state can serve: 0, but for a sliding-window KV cache
    # (the window's layers keep only their last positions), the oldest position kept plus the
    # window (a prefix cut earlier would miss the window before its end).
    floor: int = 0


@dataclass
class HostPrefixCache:
    """LRU of sequence states, at most `limit_bytes` in all, in `memory` (page-locked where the
    engine's device has such memory: engines/llamacpp/host_memory.py)."""

    limit_bytes: int
    memory: HostMemory = field(default_factory=HostMemory)
    _entries: OrderedDict[int, Entry] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _next: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    restored_tokens: int = 0
    saved: int = 0
    skipped_saves: int = 0  # states not saved: their new part prefills faster than the copy
    checkpoints: int = 0  # states saved mid-prompt at a shared prefix's end (sliding-window models)
    evictions: int = 0
    unpinned: int = 0  # states saved to pageable memory: no page-locked range was free
    save_bytes_per_s: float = 0.0  # the engine's measured copy rates (PrefixCacheStats)
    restore_bytes_per_s: float = 0.0

    def lookup(self, identity: str, prompt: npt.NDArray[np.int32], limit: int,
               touch: bool = True, floors: bool = True) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with `prompt` (at most `limit` tokens of it) that
        can serve it (`floors=False`: whether it can or not); with `touch`, it becomes the most
        recently used."""
        best: tuple[Entry | None, int] = (None, 0)
        best_key = -1
        with self._lock:
            for key, e in self._entries.items():
                if e.identity != identity:
                    continue
                n = min(common_prefix(e.tokens, prompt), limit)
                if n > best[1] and (n >= e.floor or not floors):
                    best, best_key = (e, n), key
            if best[0] is not None and touch:
                self._entries.move_to_end(best_key)
        return best

    def covers(self, identity: str, tokens: npt.NDArray[np.int32]) -> bool:
        """Whether an entry already holds all of `tokens` (then saving them again adds nothing)."""
        with self._lock:
            return any(e.identity == identity and len(e.tokens) >= len(tokens)
                       and common_prefix(e.tokens, tokens) == len(tokens) for e in self._entries.values())

    def has_room(self, identity: str, tokens: npt.NDArray[np.int32], nbytes: int, floor: int = 0) -> bool:
        """Whether `put` could keep this state without evicting another conversation's entry (the
        entries it replaces, this conversation's earlier turns, make room)."""
        with self._lock:
            freed = sum(e.nbytes for e in self._entries.values() if self._replaces(e, identity, tokens, floor))
            return self.bytes - freed + nbytes <= self.limit_bytes

    @staticmethod
    def _replaces(e: Entry, identity: str, tokens: npt.NDArray[np.int32], floor: int) -> bool:
        """Whether a new entry of `tokens` stands in for `e` (it extends it, and a sliding window
        has not moved past what `e` could serve)."""
        return e.identity == identity and len(e.tokens) <= len(tokens) and floor <= e.floor \
            and common_prefix(e.tokens, tokens) == len(e.tokens)

    def put(self, identity: str, tokens: npt.NDArray[np.int32], nbytes: int,
            fill: Callable[[npt.NDArray[np.uint8]], int], floor: int = 0) -> bool:
        """Keep a sequence's state of `nbytes`, written by `fill` into a block of `memory` (it returns
        the bytes written, 0 if it failed). Entries it extends and can stand in for (the same
        conversation's earlier turn, unless a sliding window has moved past what that turn could
        serve) go, and the least recently used while there is no room, before the block is taken
        (in page-locked memory when a range is free, else pageable: engines/llamacpp/host_memory.py)."""
        if nbytes > self.limit_bytes:
            return False
        with self._lock:
            for key, e in list(self._entries.items()):
                if self._replaces(e, identity, tokens, floor):
                    self._drop(key)
            while self._entries and self.bytes + nbytes > self.limit_bytes:
                self._drop(next(iter(self._entries)))
                self.evictions += 1
            block = self.memory.take(nbytes)
            if not block.capacity:
                # No free range that large in the page-locked arena (a conversation's state grows
                # each turn): pageable memory rather than evicting entries still in use.
                block = HostMemory().take(nbytes)
                self.unpinned += 1
            n = fill(block.array)
            if n <= 0:
                self.memory.give(block)
                return False
            self._entries[self._next] = Entry(identity, tokens, block, n, floor)
            self._next += 1
            self.bytes += n
            self.saved += 1
        return True

    def _drop(self, key: int) -> None:
        e = self._entries.pop(key)
        self.bytes -= e.nbytes
        self.memory.give(e.block)

    def close(self) -> None:
        """Drop every entry and free the memory kept for reuse (the engine is going away)."""
        with self._lock:
            for key in list(self._entries):
                self._drop(key)
            self.memory.close()

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(hits=self.hits, misses=self.misses, restored_tokens=self.restored_tokens,
                                saved=self.saved, skipped_saves=self.skipped_saves,
                                checkpoints=self.checkpoints, evictions=self.evictions, entries=len(self._entries),
                                bytes=self.bytes, limit_bytes=self.limit_bytes, pinned=self.memory.pinned,
                                save_bytes_per_s=self.save_bytes_per_s, restore_bytes_per_s=self.restore_bytes_per_s,
                                allocations=self.memory.allocations, allocation_seconds=self.memory.allocation_seconds,
                                unpinned=self.unpinned)


def default_limit_bytes() -> int:
    """A quarter of the memory available now, at most 8 GiB (llama-server's --cache-ram default)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return min(8 << 30, int(line.split()[1]) * 1024 // 4)
    except OSError:
        pass
    return 1 << 30
