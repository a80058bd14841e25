"""A step's batch laid out so that llama.cpp runs it in as few micro-batches as it can.

With one KV stream per sequence (the default layout, not kv_unified), llama.cpp splits a batch into
micro-batches by `split_equal(sequential)`: one micro-batch takes a run of consecutive sequence ids,
in the order the batch first names them, and the same number of tokens from each. Every
micro-batch is a pass over the weights, so a step laid out carelessly pays for several:

- running sequences 0-3 and 5-8 (4 idle) decode in two passes, 0-7 named backwards in eight;
- the running streams' tokens and a prompt's chunk always take two (one token from every
  sequence, then the rest of the chunk), and a prompt whose sequence the batch names after
  higher ones splits the streams' micro-batch too.

So before a pass (`Layout.arrange`) the batch's tokens go in sequence order (a stable sort: each
sequence's tokens stay in order and together, as drafts and prompt chunks need), and an idle
sequence between two that run gets one throwaway token at the end of its KV, no logits, cut off
again after the pass (`Layout.restore`): a row of the pass instead of a pass. On a 2-core Xeon
(SmolLM2-135M, CPU), 8 decoding streams with one idle sequence among them took 38 ms a step
instead of 32 contiguous, with three 60, and named backwards 72
(docs/benchmarks/history.md#gaps-between-sequence-ids-cost-a-pass-each).

A throwaway token changes nothing a sequence's next request sees only where a token can be taken
back: attention KV without a sliding window (a window's cells fall out as positions move on) and
no recurrent state. The engine decides (`fill`); sorting is always safe.
"""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp as lc
import numpy as np

from engines.llamacpp.slots import Slot

Output = tuple[Slot, int, list[int]]  # (slot, the batch index of its first output, its draft tokens)


class Layout:
    """Numpy views of one llama_batch (one sequence per token) and the step's throwaway tokens."""

    def __init__(self, batch: Any, capacity: int, mem: Any, slots: list[Slot], n_ctx_seq: int, sort: bool,
                 fill: bool) -> None:
        self._batch = batch
        self._capacity = capacity
        self._mem = mem
        self._slots = slots
        self._n_ctx_seq = n_ctx_seq
        self.sort, self.fill = sort, fill
        self.token = np.ctypeslib.as_array(batch.token, shape=(capacity,))
        self.pos = np.ctypeslib.as_array(batch.pos, shape=(capacity,))
        self.logits = np.ctypeslib.as_array(ctypes.cast(batch.logits, ctypes.POINTER(ctypes.c_int8)), shape=(capacity,))
        # Each token's sequence id lives in an array of its own (llama_batch_init); the pointers
        # move with their tokens, and `seq` mirrors their values for sorting.
        self._seq_ptr = np.ctypeslib.as_array(ctypes.cast(batch.seq_id, ctypes.POINTER(ctypes.c_uint64)),
                                              shape=(capacity,))
        self.seq = np.zeros(capacity, dtype=np.int32)
        self._fillers: list[tuple[int, int]] = []  # (sequence, position) of this pass's throwaway tokens
        self.filled = 0  # throwaway tokens run so far
        self.sorted = 0  # passes whose tokens were put in sequence order

    def put(self, n: int, seq: int, token: int, pos: int, want_logits: bool) -> None:
        """The batch's token `n`."""
        batch = self._batch
        batch.token[n] = token
        batch.pos[n] = pos
        batch.n_seq_id[n] = 1
        batch.seq_id[n][0] = seq
        batch.logits[n] = want_logits
        self.seq[n] = seq

    def arrange(self, n: int, outputs: list[Output]) -> tuple[int, list[Output]]:
        """The batch's first `n` tokens with throwaway tokens in the gaps, in sequence order; the
        tokens now and the outputs at their new indexes."""
        if not self.sort:
            return n, outputs
        n = self._add_fillers(n)
        seq = self.seq[:n]
        if n < 2 or bool(np.all(seq[:-1] <= seq[1:])):
            return n, outputs
        order = np.argsort(seq, kind="stable")
        for a in (self.token, self.pos, self.logits, self._seq_ptr, self.seq):
            a[:n] = a[:n][order]
        new_index = np.empty(n, dtype=np.int64)
        new_index[order] = np.arange(n)
        self.sorted += 1
        return n, [(slot, int(new_index[i]), draft) for slot, i, draft in outputs]

    def _add_fillers(self, n: int) -> int:
        """Throwaway tokens for the idle sequences between the lowest and highest in the batch."""
        if not self.fill or n == 0:
            return n
        present = np.unique(self.seq[:n])
        lo, hi = int(present[0]), int(present[-1])
        if hi - lo + 1 == len(present):
            return n
        gaps = [s for s in range(lo, hi) if s not in set(present.tolist()) and self._slots[s].job is None]
        if n + len(gaps) > self._capacity:
            return n
        for s in gaps:
            # The sequence's next position in its KV (its own record, not the slot's token list).
            pos = lc.llama_memory_seq_pos_max(self._mem, s) + 1
            if pos + 1 > self._n_ctx_seq:
                continue
            cached = self._slots[s].cached
            self.put(n, s, cached[-1] if cached else 0, pos, False)
            self._fillers.append((s, pos))
            n += 1
        self.filled += len(self._fillers)
        return n

    def restore(self) -> None:
        """The throwaway tokens out of their sequences' KV (after the pass, whether or not it ran)."""
        for s, pos in self._fillers:
            lc.llama_memory_seq_rm(self._mem, s, pos, -1)
        self._fillers.clear()

