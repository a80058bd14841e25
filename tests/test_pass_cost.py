"""The fit of what other sequences' cells cost a pass over a shared KV cache (`MaskedCellCost`),
on passes shaped like an agent replay's: decode steps of a few sequences and prompt chunks beside
them, with idle conversations' cells in the cache or not."""

from __future__ import annotations

import numpy as np
import pytest

from engines.llamacpp.pass_cost import MaskedCellCost


def _passes(per_masked: float, n: int, seed: int = 0) -> MaskedCellCost:
    rng = np.random.default_rng(seed)
    fit = MaskedCellCost()
    for _ in range(n):
        k = int(rng.integers(1, 5))
        lens = rng.integers(100, 12000, size=k)
        tokens = np.ones(k, dtype=int)
        if rng.random() < 0.3:  # a prompt chunk beside the others' decode steps
            tokens[0] = 512
        used = int(lens.sum() + rng.integers(0, 30000))  # and idle conversations' cells, or not
        own = float((tokens * lens).sum())
        masked = float((tokens * (used - lens)).sum())
        seconds = 0.005 + 1e-4 * tokens.sum() + 3e-9 * own + per_masked * masked
        fit.observe(seconds * (1 + 0.05 * rng.standard_normal()), int(tokens.sum()), own, masked)
    return fit


@pytest.mark.parametrize("per_masked", [0.0, 2.7e-9, 2e-8])
def test_the_cost_of_a_masked_cell_is_recovered_from_noisy_passes(per_masked: float) -> None:
    fit = _passes(per_masked, 600)
    got = fit.per_masked_cell
    assert got is not None
    # Within 10 % of a cost that matters (2.7e-9 s: an 8B model's FLOPs on the H100), and next to
    # nothing where masked cells cost nothing (a kernel that skips them).
    assert abs(got - per_masked) <= 0.1 * per_masked + 2e-10, (got, per_masked)


def test_no_price_before_enough_passes() -> None:
    assert _passes(2e-8, 31).per_masked_cell is None
    assert _passes(2e-8, 32).per_masked_cell is not None


def test_a_long_run_of_like_passes_keeps_the_fit() -> None:
    """Thousands of identical decode steps (nothing to learn from) neither lose nor blow up the fit."""
    fit = _passes(2e-8, 600)
    for _ in range(5000):
        fit.observe(0.006, 1, 5000.0, 20000.0)
    got = fit.per_masked_cell
    assert got is not None and abs(got - 2e-8) < 0.2 * 2e-8, got
