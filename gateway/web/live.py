"""Live numbers for the web page and scripts: windowed percentiles and rates, read from the
gateway's own metric objects (gateway/metrics.py) and kept as a short time series.

Sampling is lazy: a sample is taken when someone asks (`GET /api/status`), at most once per
`SAMPLE_S` however many pages poll, so a gateway nobody watches does no work for this. Each sample
becomes one point: TTFT and inter-token-latency percentiles over the last `WINDOW_S` seconds
(Prometheus' `histogram_quantile` on the bucket counts, as deploy/prometheus/rules.yml computes
them over 5 minutes), generated tokens per second over the last `RATE_WINDOW_S`, 429s in the
window, and the running/waiting gauges at that instant. Percentiles, rates and counts are over
every model and engine together.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import Counter, Histogram
from pydantic import BaseModel

from engines.base import EngineHealth
from gateway.metrics import TOKEN_GAP_BUCKETS, TTFT_BUCKETS, Metrics

SAMPLE_S = 1.0  # at most one sample per second
HISTORY_S = 900.0  # points kept: 15 minutes
WINDOW_S = 30.0  # latency percentiles over this many seconds of observations
RATE_WINDOW_S = 5.0  # tokens per second over this many seconds

Resident = Callable[[], Iterable[tuple[str, str, str, EngineHealth]]]

_TTFT_EDGES = (*TTFT_BUCKETS, math.inf)
_GAP_EDGES = (*TOKEN_GAP_BUCKETS, math.inf)


def quantile(q: float, edges: tuple[float, ...], cumulative: tuple[float, ...]) -> float | None:
    """Prometheus' histogram_quantile: linear inside the bucket that holds rank q, the first bucket
    starting at 0, and the highest finite edge when the rank falls in +Inf. None without data."""
    total = cumulative[-1] if cumulative else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for edge, count in zip(edges, cumulative, strict=True):
        if count >= rank and count > below:
            if math.isinf(edge):
                return lower
            return lower + (edge - lower) * (rank - below) / (count - below)
        lower, below = edge, count
    return lower


def _buckets(hist: Histogram, edges: tuple[float, ...]) -> tuple[float, ...]:
    """Cumulative bucket counts summed over every label set, in `edges` order."""
    sums = dict.fromkeys(edges, 0.0)
    for family in hist.collect():
        for s in family.samples:
            if s.name.endswith("_bucket"):
                sums[float(s.labels["le"])] += s.value
    return tuple(sums[e] for e in edges)


def _total(counter: Counter, status: Callable[[str], bool] | None = None) -> float:
    return sum(s.value for family in counter.collect() for s in family.samples
               if s.name.endswith("_total") and (status is None or status(s.labels.get("status", ""))))


@dataclass(frozen=True)
class Counts:
    """Cumulative counts at one instant, summed over every model and engine."""

    ttft: tuple[float, ...]
    itl: tuple[float, ...]
    tokens: float
    requests: float
    rejected: float  # answered 429
    errors: float  # answered 5xx

    @classmethod
    def zero(cls) -> Counts:
        return cls((0.0,) * len(_TTFT_EDGES), (0.0,) * len(_GAP_EDGES), 0.0, 0.0, 0.0, 0.0)

    @classmethod
    def read(cls, m: Metrics) -> Counts:
        return cls(
            ttft=_buckets(m.ttft, _TTFT_EDGES),
            itl=_buckets(m.itl, _GAP_EDGES),
            tokens=_total(m.gen_tokens),
            requests=_total(m.requests),
            rejected=_total(m.requests, lambda s: s == "429"),
            errors=_total(m.requests, lambda s: s.startswith("5")),
        )


class Point(BaseModel):
    """One sample of the live series."""

    t: float  # server time, Unix seconds
    window_s: float  # the span the percentiles and the 429 count really cover (longer after a pause)
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    itl_p50_s: float | None
    itl_p95_s: float | None
    tokens_per_s: float
    running: int
    waiting: int
    rejected_429: int  # answered 429 within the window


class Totals(BaseModel):
    """Since the gateway started."""

    requests: int
    generation_tokens: int
    rejected_429: int
    errors_5xx: int


def _diff(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(x - y for x, y in zip(a, b, strict=True))


class LiveStats:
    """The sampled series; `sample()` on each status request, `since()` for the page's new points."""

    def __init__(self, metrics: Metrics, resident: Resident, clock: Callable[[], float] = time.time) -> None:
        self.metrics = metrics
        self.resident = resident
        self._clock = clock
        self._start = (clock(), Counts.zero())  # the base until samples reach back a whole window
        self._samples: deque[tuple[float, Counts]] = deque()
        self.points: deque[Point] = deque()

    def _base(self, now: float, span: float) -> tuple[float, Counts]:
        """The newest sample at least `span` old; else the oldest one there is."""
        base = self._samples[0] if self._samples else self._start
        for t, c in self._samples:
            if now - t < span:
                break
            base = (t, c)
        return base

    def sample(self) -> None:
        now = self._clock()
        if self.points and now - self.points[-1].t < SAMPLE_S:
            return
        counts = Counts.read(self.metrics)
        t0, base = self._base(now, WINDOW_S)
        r0, rate_base = self._base(now, RATE_WINDOW_S)
        ttft, itl = _diff(counts.ttft, base.ttft), _diff(counts.itl, base.itl)
        running = waiting = 0
        for _, _, _, h in self.resident():
            running += h.running
            waiting += h.waiting
        self.points.append(Point(
            t=round(now, 3), window_s=round(now - t0, 3),
            ttft_p50_s=quantile(0.5, _TTFT_EDGES, ttft), ttft_p95_s=quantile(0.95, _TTFT_EDGES, ttft),
            itl_p50_s=quantile(0.5, _GAP_EDGES, itl), itl_p95_s=quantile(0.95, _GAP_EDGES, itl),
            tokens_per_s=round((counts.tokens - rate_base.tokens) / max(now - r0, 1e-9), 2),
            running=running, waiting=waiting, rejected_429=int(counts.rejected - base.rejected),
        ))
        self._samples.append((now, counts))
        # Keep what later windows can still start from, and 15 minutes of points.
        while len(self._samples) > 1 and now - self._samples[1][0] >= HISTORY_S + WINDOW_S:
            self._samples.popleft()
        while self.points and now - self.points[0].t > HISTORY_S:
            self.points.popleft()

    def since(self, t: float | None) -> list[Point]:
        """Points newer than `t` (all when None)."""
        return [p for p in self.points if t is None or p.t > t]

    def totals(self) -> Totals:
        """Read now, not at the last sample: a script sees its own requests counted at once."""
        m = self.metrics
        return Totals(requests=int(_total(m.requests)), generation_tokens=int(_total(m.gen_tokens)),
                      rejected_429=int(_total(m.requests, lambda s: s == "429")),
                      errors_5xx=int(_total(m.requests, lambda s: s.startswith("5"))))
