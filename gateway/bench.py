"""`gateway bench`: a client-side load generator for any OpenAI-compatible server.

In the spirit of `vllm bench serve`: synthetic prompts of a given length (or a prompts file),
arrivals at fixed concurrency or as a Poisson process, warm-up, fixed output length
(`ignore_eos` plus `max_tokens`), and TTFT / TPOT / ITL / e2e percentiles, throughput and goodput
against SLOs.  Metric definitions match gateway/metrics.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""
    status: int = 0  # HTTP status (0: no answer)
    retry_after: float | None = None  # seconds, on a 429/503

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, output_len: int, ignore_eos: bool) -> Result:
    body: dict[str, Any] = {
        "model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    t0 = time.perf_counter()
    stamps: list[float] = []
    res = Result(ok=False)
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                if "retry-after" in r.headers:
                    try:
                        res.retry_after = float(r.headers["retry-after"])
                    except ValueError:
                        pass
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    res.error = data["error"].get("message", "error")
                    return res
                if data.get("choices") and data["choices"][0].get("text"):
                    stamps.append(time.perf_counter())
                if data.get("usage"):
                    res.prompt_tokens = data["usage"]["prompt_tokens"]
                    res.output_tokens = data["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    if not stamps:
        res.error = "no tokens received"
        return res
    res.ok = True
    res.ttft = stamps[0] - t0
    res.e2e = stamps[-1] - t0
    res.itl = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    res.output_tokens = res.output_tokens or len(stamps)
    return res


def synthetic_prompts(n: int, input_len: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = "the of and to in is was for on with as by at from it an be this that are or not".split()
    # Roughly one token per common English word; the server's usage reports the exact count.
    return [" ".join(rng.choice(words) for _ in range(input_len)) for _ in range(n)]


def read_prompts(path: Path) -> list[str]:
    """One prompt per line; in a .jsonl file each line is a JSON string or {"prompt": ...} (prompts
    with newlines: code, documents)."""
    lines = path.read_text().splitlines()
    if path.suffix != ".jsonl":
        return lines
    items = [json.loads(line) for line in lines if line.strip()]
    return [x["prompt"] if isinstance(x, dict) else str(x) for x in items]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarise(results: list[Result], duration: float, slo_ttft: float | None, slo_tpot: float | None) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_token_throughput": sum(r.output_tokens for r in ok) / duration if duration else 0.0,
        "total_prompt_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": sum(r.output_tokens for r in ok),
        "errors": sorted({r.error for r in results if not r.ok and r.status != 429})[:5],
        # Refused by admission control, with the Retry-After the server gave.
        "rejected": sum(r.status == 429 for r in results),
        "rejected_without_retry_after": sum(r.status == 429 and r.retry_after is None for r in results),
        "server_errors": sum(r.status >= 500 for r in results),
    }
    waits = [r.retry_after for r in results if r.status == 429 and r.retry_after is not None]
    if waits:
        out["retry_after_s"] = {"min": min(waits), "p50": _pct(waits, 0.5), "max": max(waits)}
    series = {
        "ttft": [r.ttft for r in ok], "e2e": [r.e2e for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None], "itl": [g for r in ok for g in r.itl],
    }
    for name, vals in series.items():
        out[name] = {"mean": statistics.fmean(vals) if vals else float("nan"),
                     **{f"p{int(q * 100)}": _pct(vals, q) for q in (0.5, 0.9, 0.95, 0.99)},
                     "max": max(vals) if vals else float("nan")}
    good = [r for r in ok if (slo_ttft is None or r.ttft <= slo_ttft) and (slo_tpot is None or (r.tpot or 0) <= slo_tpot)]
    out["goodput"] = len(good) / duration if duration else 0.0
    out["slo"] = {"ttft_s": slo_ttft, "tpot_s": slo_tpot, "met": len(good)}
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    prompts = (read_prompts(Path(args.prompts_file)) if args.prompts_file
               else synthetic_prompts(args.num_prompts, args.input_len, args.seed))
    prompts = [p for p in prompts if p.strip()][: args.num_prompts]
    limits = httpx.Limits(max_connections=max(args.concurrency or 1, 64))
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        # Warm-up prompts are not measured prompts: a server's prompt cache must not flatter the run.
        warm = synthetic_prompts(args.warmup, args.input_len, args.seed + 1_000_003)
        for p in warm[: args.warmup]:
            await one_request(client, args.url, args.model, p, args.output_len, not args.no_ignore_eos)
        results: list[Result] = []
        queue_before = await _queue_wait(args.url) if args.server_metrics else None
        t0 = time.perf_counter()
        if args.duration:
            await _for_duration(client, args, prompts, results)
        else:
            await _for_prompts(client, args, prompts, results)
        duration = time.perf_counter() - t0
    summary = summarise(results, duration, args.slo_ttft, args.slo_tpot)
    if queue_before is not None:
        summary["server_queue_wait"] = _queue_wait_delta(queue_before, await _queue_wait(args.url))
    summary["config"] = {k: v for k, v in vars(args).items() if k not in ("func",)}
    if args.plot:
        plot(results, args.plot)
    return summary


async def _for_prompts(client: httpx.AsyncClient, args: argparse.Namespace, prompts: list[str],
                       results: list[Result]) -> None:
    """Each prompt once: at most `concurrency` in flight, or Poisson arrivals at `rate`."""
    progress = _Progress(len(prompts), enabled=not args.quiet)
    sem = asyncio.Semaphore(args.concurrency) if args.concurrency else None
    rng = random.Random(args.seed)

    async def task(p: str) -> None:
        if sem is not None:
            async with sem:
                r = await one_request(client, args.url, args.model, p, args.output_len, not args.no_ignore_eos)
        else:
            r = await one_request(client, args.url, args.model, p, args.output_len, not args.no_ignore_eos)
        results.append(r)
        progress.tick(r.ok)

    tasks = []
    for p in prompts:
        tasks.append(asyncio.create_task(task(p)))
        if args.rate:
            await asyncio.sleep(rng.expovariate(args.rate))
    await asyncio.gather(*tasks)
    progress.close()


async def _for_duration(client: httpx.AsyncClient, args: argparse.Namespace, prompts: list[str],
                        results: list[Result]) -> None:
    """`concurrency` clients in a closed loop for `duration` seconds. A refused client waits what the
    server's Retry-After asks (capped at 5 s), as the OpenAI SDK's retry does, before its next request."""
    deadline = time.monotonic() + args.duration

    async def client_loop(i: int) -> None:
        k = i
        while time.monotonic() < deadline:
            r = await one_request(client, args.url, args.model, prompts[k % len(prompts)], args.output_len,
                                  not args.no_ignore_eos)
            results.append(r)
            k += args.concurrency
            if r.status in (429, 503):
                await asyncio.sleep(min(r.retry_after or 1.0, 5.0, max(0.0, deadline - time.monotonic())))

    await asyncio.gather(*(client_loop(i) for i in range(args.concurrency or 1)))


async def _queue_wait(url: str) -> dict[str, float]:
    """The server's gateway_admission_wait_seconds buckets (cumulative counts by `le`), summed over labels."""
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient(timeout=30) as c:
        text = (await c.get(f"{url}/metrics")).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for sm in fam.samples:
            if sm.name == "gateway_admission_wait_seconds_bucket":
                out[sm.labels["le"]] = out.get(sm.labels["le"], 0.0) + sm.value
    return out


def _queue_wait_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Requests that waited for a slot during the run, and the smallest bucket holding all of them."""
    delta = {le: after.get(le, 0.0) - before.get(le, 0.0) for le in after}
    total = delta.get("+Inf", 0.0)
    bounds = sorted((float(le), n) for le, n in delta.items() if le != "+Inf")
    max_le = next((le for le, n in bounds if n >= total), float("inf"))
    return {"requests": total, "all_waited_at_most_s": max_le, "buckets": delta}


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.failed, self.enabled = total, 0, 0, enabled
        self.t0 = time.perf_counter()

    def tick(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        if self.enabled:
            width = 30
            fill = int(width * self.done / max(self.total, 1))
            rate = self.done / max(time.perf_counter() - self.t0, 1e-9)
            sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} "
                             f"failed {self.failed}  {rate:.2f} req/s")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def plot(results: list[Result], path: str) -> None:
    """A PNG of the TTFT, TPOT, ITL and e2e distributions (needs matplotlib: pip install .[bench])."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.ok]
    series = {
        "TTFT (ms)": [r.ttft * 1000 for r in ok],
        "TPOT (ms)": [t * 1000 for r in ok if (t := r.tpot) is not None],
        "ITL (ms)": [g * 1000 for r in ok for g in r.itl],
        "e2e (ms)": [r.e2e * 1000 for r in ok],
    }
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.5))
    for ax, (name, vals) in zip(axes, series.items(), strict=True):
        ax.hist(vals, bins=30, color="#4c72b0")
        for q, style in ((0.5, "-"), (0.99, "--")):
            if vals:
                ax.axvline(_pct(vals, q), color="#c44e52", linestyle=style, label=f"p{int(q * 100)}")
        ax.set_title(name)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def print_report(s: dict[str, Any]) -> None:
    print(f"completed {s['completed']}  failed {s['failed']}  in {s['duration_s']:.2f} s")
    print(f"request throughput {s['request_throughput']:.2f} req/s   output {s['output_token_throughput']:.1f} tok/s   "
          f"goodput {s['goodput']:.2f} req/s (SLO met by {s['slo']['met']})")
    print(f"{'metric':<6} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9} {'max':>9}  (ms)")
    for name in ("ttft", "tpot", "itl", "e2e"):
        m = s[name]
        print(f"{name:<6} " + " ".join(f"{m[k] * 1000:>9.1f}" for k in ("mean", "p50", "p90", "p99", "max")))
    if s.get("rejected"):
        ra = s.get("retry_after_s", {})
        print(f"rejected (429) {s['rejected']}  Retry-After min/p50/max {ra.get('min')}/{ra.get('p50')}/{ra.get('max')} s"
              f"  without Retry-After {s['rejected_without_retry_after']}")
    print(f"server errors (5xx) {s['server_errors']}")
    if "server_queue_wait" in s:
        q = s["server_queue_wait"]
        print(f"server queue wait: {q['requests']:.0f} requests, all within {q['all_waited_at_most_s']} s")
    for e in s["errors"]:
        print(f"error: {e}")


def add_parser(sub: Any) -> None:
    b = sub.add_parser("bench", help="load-test an OpenAI-compatible server (client-side latencies)")
    b.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL (without /v1)")
    b.add_argument("--model", default="smollm2-135m-instruct")
    b.add_argument("--num-prompts", type=int, default=32)
    b.add_argument("--input-len", type=int, default=128, help="synthetic prompt length in words (~tokens)")
    b.add_argument("--output-len", type=int, default=64)
    b.add_argument("--prompts-file", help="one prompt per line instead of synthetic prompts (.jsonl: a JSON string "
                   "or {\"prompt\": ...} per line)")
    mode = b.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int, default=None, help="fixed number of requests in flight")
    mode.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests per second")
    b.add_argument("--duration", type=float, default=None,
                   help="seconds: run `--concurrency` closed-loop clients this long (prompts are reused)")
    b.add_argument("--server-metrics", action="store_true",
                   help="read the gateway's /metrics before and after: the queue wait of accepted requests")
    b.add_argument("--warmup", type=int, default=2)
    b.add_argument("--no-ignore-eos", action="store_true", help="for servers that reject ignore_eos")
    b.add_argument("--slo-ttft", type=float, default=None, help="seconds, for goodput")
    b.add_argument("--slo-tpot", type=float, default=None, help="seconds per token, for goodput")
    b.add_argument("--timeout", type=float, default=600)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--json", default=None, help="write the full result here")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.add_argument("--plot", default=None, metavar="PNG", help="write a latency distribution chart (needs matplotlib)")
    b.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if not args.concurrency and not args.rate:
        args.concurrency = 1
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("error: --plot needs matplotlib: pip install 'llm-gateway[bench]'", file=sys.stderr)
            return 2
    summary = asyncio.run(run(args))
    print_report(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2, default=str))
    return 0 if summary["failed"] - summary["rejected"] == 0 else 1


__all__ = ["Result", "add_parser", "summarise"]
