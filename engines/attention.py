"""Attention masks a runtime feeds its model, shared with the exporter that traces that model."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


def causal_mask(q_len: int, end: int) -> npt.NDArray[np.float16]:
    """Additive mask for `q_len` new tokens after `end - q_len` cached ones (0 = attend)."""
    start = end - q_len
    allowed = np.arange(end)[None, :] <= (start + np.arange(q_len))[:, None]
    return np.where(allowed, 0.0, -np.inf).astype(np.float16)[None, None]
