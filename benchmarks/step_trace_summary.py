"""Where the time between tokens goes, from the engines' step traces (GATEWAY_STEP_TRACE=DIR):

    GATEWAY_STEP_TRACE=/tmp/steps gateway serve ...      # then load it (benchmarks/bench_speed.py)
    python benchmarks/step_trace_summary.py /tmp/steps [--client-itl-p99 MS]

A running stream gets one token per step, so the worker's gap between tokens is the time from one
step's end to the next one's: the step's model pass (`llama_decode`), the host's work on its
outputs, and the scheduler's time between steps. For the slowest 1 % of those gaps it says what
they held: a prompt prefilled beside the decoding streams, a slow pass without one, host work, or
time between steps. With the clients' ITL p99 (bench's `itl_p99_ms`) it also says how much of the
tail is past the worker (its events to the gateway, the gateway, HTTP).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Step:
    start: float  # µs
    end: float
    sequences: int
    decode_ms: float = 0.0
    outputs_ms: float = 0.0
    prompt_tokens: int = 0
    decoding: int = 0
    passes: int = 0  # model passes in the step (more than one: prompt passes while the streams wait)


def read_events(path: Path) -> list[dict[str, Any]]:
    """A trace file's events, whether or not its array was closed."""
    out = []
    for line in path.read_text().splitlines():
        line = line.strip().rstrip(",")
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:  # a line cut by a killed process
                continue
    return out


def steps_of(events: list[dict[str, Any]]) -> list[Step]:
    """Each step with the passes inside it, in time order."""
    spans = sorted((e for e in events if e.get("ph") == "X"), key=lambda e: (e["ts"], -e["dur"]))
    steps: list[Step] = []
    for e in spans:
        if e["name"] == "step":
            steps.append(Step(e["ts"], e["ts"] + e["dur"], e["args"].get("sequences", 0)))
        elif steps and e["ts"] <= steps[-1].end:
            s = steps[-1]
            if e["name"] == "llama_decode":
                s.decode_ms += e["dur"] / 1000
                s.passes += 1
                s.prompt_tokens += e["args"].get("prompt_tokens", 0)
                s.decoding += e["args"].get("decoding", 0)
            elif e["name"] == "outputs":
                s.outputs_ms += e["dur"] / 1000
    return steps


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def summarize(steps: list[Step], client_p99: float | None = None) -> str:
    # Gaps between consecutive steps' ends while streams decode (a pause with nothing running is
    # no stream's gap).
    gaps: list[tuple[float, Step, float]] = []  # (gap ms, the step that ended it, idle ms before it)
    for prev, cur in zip(steps, steps[1:], strict=False):
        if cur.decoding and prev.sequences:
            gaps.append(((cur.end - prev.end) / 1000, cur, (cur.start - prev.end) / 1000))
    if not gaps:
        return "no decoding steps in the trace"
    values = [g for g, _, _ in gaps]
    p50, p99 = statistics.median(values), pct(values, 0.99)
    tail = [(g, s, idle) for g, s, idle in gaps if g >= p99]
    prefill = [t for t in tail if t[1].prompt_tokens]
    lines = [
        f"steps {len(steps)}, decoding gaps {len(gaps)}",
        f"worker gap between tokens: p50 {p50:.1f} ms, p90 {pct(values, 0.9):.1f}, p99 {p99:.1f}, max {max(values):.1f}",
        f"steps with a prompt prefilled beside decoding: {sum(1 for _, s, _ in gaps if s.prompt_tokens) / len(gaps):.0%} "
        f"of all, {len(prefill) / len(tail):.0%} of the slowest 1 %",
        "the slowest 1 % of gaps (mean ms): "
        f"model pass {statistics.mean(s.decode_ms for _, s, _ in tail):.1f}, "
        f"host work on outputs {statistics.mean(s.outputs_ms for _, s, _ in tail):.1f}, "
        f"between steps {statistics.mean(idle for *_, idle in tail):.1f}, "
        f"prompt tokens {statistics.mean(s.prompt_tokens for _, s, _ in tail):.0f}, "
        f"streams {statistics.mean(s.decoding for _, s, _ in tail):.1f}",
        "the median gap's step (ms): model pass "
        f"{statistics.median(s.decode_ms for _, s, _ in gaps):.1f}, host work "
        f"{statistics.median(s.outputs_ms for _, s, _ in gaps):.1f}, between steps "
        f"{statistics.median(idle for *_, idle in gaps):.1f}",
    ]
    lines += _by_kind(steps)
    if client_p99 is not None:
        lines.append(f"clients' ITL p99 {client_p99:.1f} ms: {max(0.0, client_p99 - p99):.1f} ms of it after the "
                     f"worker (events to the gateway, the gateway, HTTP)")
    return "\n".join(lines)


SIZES = ((1, 32), (33, 128), (129, 512), (513, 1 << 30))


def _by_kind(steps: list[Step]) -> list[str]:
    """Whole steps (model pass and host work together: on a GPU their split depends on where the
    device is waited for) by what they held: decoding only, right after a decode-only step or right
    after one that prefilled (a change of batch shape can cost the next steps, e.g. a rebuilt CUDA
    graph); and steps that prefilled beside decoding streams, by their prompt tokens, with what
    each prompt token added over the median decode-only step."""
    def ms(s: Step) -> float:
        return (s.end - s.start) / 1000

    plain = [(prev, cur) for prev, cur in zip(steps, steps[1:], strict=False) if cur.decoding and not cur.prompt_tokens]
    calm = [ms(c) for p, c in plain if not p.prompt_tokens]
    after = [ms(c) for p, c in plain if p.prompt_tokens]
    if not calm:
        return []
    base = statistics.median(calm)
    out = [f"decode-only steps (ms, whole step): p50 {base:.1f} after a decode-only step ({len(calm)}), "
           f"p50 {pct(after, 0.5):.1f} right after a step that prefilled ({len(after)})"]
    for lo, hi in SIZES:
        mixed = [s for s in steps if s.decoding and lo <= s.prompt_tokens <= hi]
        if mixed:
            med = statistics.median(ms(s) for s in mixed)
            per = (med - base) / statistics.median(s.prompt_tokens for s in mixed)
            out.append(f"steps prefilling {lo}-{hi if hi < 1 << 30 else 'more'} prompt tokens beside decoding: "
                       f"{len(mixed)}, p50 {med:.1f} ms, {per * 1000:.0f} µs a prompt token over a decode step")
    return out


def prompt_passes(events: list[dict[str, Any]]) -> list[str]:
    """Passes of prompt tokens alone (a step's later passes while the streams wait, or a burst with
    nothing decoding), by size: how fast a burst of prompts goes through (benchmarks/pass_shapes.py
    measures the same shapes apart from serving, beside llama-bench's pp)."""
    alone = [(e["args"]["prompt_tokens"], e["dur"] / 1000) for e in events
             if e.get("name") == "llama_decode" and e.get("ph") == "X"
             and not e["args"].get("decoding") and e["args"].get("prompt_tokens")]
    out = []
    for lo, hi in SIZES:
        group = [(t, ms) for t, ms in alone if lo <= t <= hi]
        if group:
            tokens = statistics.median(t for t, _ in group)
            ms = statistics.median(ms for _, ms in group)
            out.append(f"passes of {lo}-{hi if hi < 1 << 30 else 'more'} prompt tokens alone: {len(group)}, "
                       f"p50 {tokens:.0f} tokens in {ms:.1f} ms ({tokens / ms * 1000:.0f} tok/s)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="a trace file or the GATEWAY_STEP_TRACE directory")
    ap.add_argument("--client-itl-p99", type=float, help="the clients' ITL p99 in ms, from the same run")
    args = ap.parse_args()
    p = Path(args.trace)
    for f in sorted(p.glob("steps-*.json")) if p.is_dir() else [p]:
        print(f"# {f.name}")
        events = read_events(f)
        print(summarize(steps_of(events), args.client_itl_p99))
        print("\n".join(prompt_passes(events)))


if __name__ == "__main__":
    main()
