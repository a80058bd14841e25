"""What the cells of other sequences cost a pass over a shared KV cache, measured from the passes.

llama.cpp attends over every used cell of a shared (kv_unified) cache, masking the cells of other
sequences; what walking a masked cell costs depends on the backend's attention kernel and the
model (on the 2-core CPU a prompt chunk beside idle conversations took ~800 ms instead of ~50; on
the H200 this fit put a Llama-3-8B-shaped model's at 2.3-5.1 ns per token and cell, near its
FLOPs' ~3.2). Instead of assuming it, the scheduler fits each pass's seconds to what the pass did,
by recursive least squares with forgetting:

    seconds ~ a + b * tokens + c * (token x own cell) + d * (token x masked cell)

and `per_masked_cell` is d: what an idle sequence's cells cost each token of a pass, the price
the shared KV cache's trim (engines/llamacpp/kv_pool.py) weighs against moving them to host memory
and back.
"""

from __future__ import annotations

import numpy as np

# Feature scales: a pass's tokens are ~1..512, its token x cell products ~1e3..1e8.
_SCALE = np.array([1.0, 1e-3, 1e-6, 1e-6])


class MaskedCellCost:
    """Recursive least squares of pass seconds on (1, tokens, token x own cells, token x masked
    cells), with exponential forgetting so that it follows the machine's current speed."""

    def __init__(self, forget: float = 0.99, min_passes: int = 32) -> None:
        self._forget = forget
        self._min_passes = min_passes
        self._theta = np.zeros(4)
        self._p = np.eye(4) * 1e4
        self.passes = 0

    def observe(self, seconds: float, tokens: int, own: float, masked: float) -> None:
        """One pass: its seconds, its tokens, and the sums over them of the cells each attended
        to of its own sequence and of others (masked)."""
        x = np.array([1.0, tokens, own, masked]) * _SCALE
        px = self._p @ x
        gain = px / (self._forget + x @ px)
        self._theta += gain * (seconds - x @ self._theta)
        self._p -= np.outer(gain, px)
        # Passes all alike (a run of decode steps) teach nothing about some coefficients, and
        # forgetting alone would let their uncertainty grow without bound: it stops growing here.
        if np.trace(self._p) < 1e6:
            self._p /= self._forget
        self.passes += 1

    @property
    def per_masked_cell(self) -> float | None:
        """Seconds a pass spends per token and masked cell (None until enough passes were seen)."""
        if self.passes < self._min_passes:
            return None
        return max(0.0, float(self._theta[3] * _SCALE[3]))
