"""Agent-sized prompts: conversations beyond the slot count, long stable prefixes, and long prompts
arriving beside running streams. The gateway (with and without its host-memory prefix cache) vs
llama-server from the same llama.cpp (its default prompt cache), one run, servers alternated.

    .venv/bin/python benchmarks/bench_prefix_cache.py [--parts conversations,agent,interference,together]

- conversations: N conversations of 4 turns at once (each turn sends the whole history; the
  workload of bench_cluster's affinity part) on one server of 8 sequences, N = 8 and 16, SmolLM2:
  share of follow-up prompt tokens served from cache, follow-up TTFT p50/p95. Also the gateway with
  one KV cache of 8 sequences' size shared by 16 (kv_unified + sequences), and llama-server with 16
  slots over the same cells.
- agent: sessions with a long stable prefix (instructions, tool list) and a growing history,
  Gemma-3-270M at 32k context, more sessions than sequences: TTFT of each turn after the first, as
  a share of a cold prefill of the same prefix. Also the gateway with those sequences' KV shared by
  as many sequences as sessions.
- interference: streams decoding while a long prompt arrives (Gemma-3-270M): the running streams'
  inter-token latency p50/p99 while it is prefilled, and its TTFT against the same prompt alone;
  the gateway at several prefill budgets.
- together: requests sent at once with one long system prompt and each its own question (agents'
  sessions or sub-agents started together), SmolLM2: their TTFT against one such prompt alone, and
  the share of their prompt tokens from cache. Also the gateway with GATEWAY_PREFIX_FOLLOW=off
  (each request prefills the shared prefix itself).

Prints Markdown tables with machine and commit; --json keeps every number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.host.ports import free_port  # noqa: E402

SMOL, GEMMA = "smollm2-135m-instruct", "gemma-3-270m"
WORDS = ("file", "tool", "call", "schema", "path", "read", "write", "shell", "patch", "apply", "search", "result",
         "error", "retry", "branch", "commit", "test", "build", "json", "string", "number", "array", "object",
         "limit", "offset", "query", "match", "line", "column", "token", "agent", "review", "diff", "merge")


def text_of(n_words: int, seed: int) -> str:
    """Varied text (no long repeats a tokenizer would compress): ~1.3 tokens a word."""
    rng = random.Random(seed)
    lines = []
    for i in range(0, n_words, 12):
        lines.append(f"{i // 12}. " + " ".join(rng.choice(WORDS) for _ in range(12)) + ".")
    return "\n".join(lines)


@dataclass
class Server:
    name: str
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None  # the server's output
    extra_body: dict[str, Any] = field(default_factory=dict)  # what its requests add (interference part)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        self.port = free_port()
        cmd = [c.replace("{port}", str(self.port)) for c in self.cmd]
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-{self.name.replace(' ', '').replace(',', '-')}.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **self.env}, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.name} not ready")

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


CONFIG = str(ROOT / "models.yaml")
# llama-server closes idle connections after 5 s; a pooled one reused later fails ("Server
# disconnected"): each request opens its own connection, on both servers.
NO_KEEPALIVE = httpx.Limits(max_keepalive_connections=0)


def gateway(model: str, parallel: int, *extra: str, name: str = "gateway", env: dict[str, str] | None = None) -> Server:
    return Server(name, [sys.executable, "-m", "gateway.cli", "serve", "--port", "{port}", "--model", model,
                         "--config", CONFIG, "--parallel", str(parallel), "--max-queue-wait", "600", *extra],
                  # BENCH_LOG_LEVEL=debug: the engine's step-by-step log in the server's log file
                  env={"GATEWAY_LOG_LEVEL": os.environ.get("BENCH_LOG_LEVEL", "warning"), "GATEWAY_CHECK_MODELS": "0",
                       **(env or {})})


def variant_env(variant: str) -> tuple[str, dict[str, str]]:
    """--gateway-variant's 'NAME:VAR=VALUE[,VAR=VALUE]': the server's name and its environment."""
    label, _, settings = variant.partition(":")
    return f"gateway, {label}", dict(kv.split("=", 1) for kv in settings.split(",") if kv)


def derived_config(model: str, label: str, **fields: Any) -> str:
    """A copy of the models.yaml in use with `fields` set on `model`; its path."""
    import yaml

    data = yaml.safe_load(Path(CONFIG).read_text())
    next(m for m in data["models"] if m["id"] == model).update(fields)
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-prefix-{label}-{os.getpid()}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def llama_server(bin_dir: str, model_path: str, parallel: int, ctx: int, template: str | None, *extra: str,
                 name: str = "llama-server") -> Server:
    threads = str(os.cpu_count() or 1)
    cmd = [f"{bin_dir}/llama-server", "-m", model_path, "--port", "{port}", "-np", str(parallel),
           "-c", str(ctx * parallel), "-t", threads, "-tb", threads, *extra]
    if template:
        path = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-template-{abs(hash(template))}.jinja"
        path.write_text(template)
        cmd += ["--jinja", "--chat-template-file", str(path)]
    # Its own per-chunk count of generated tokens (the gateway's: stream_options.continuous_usage_stats).
    return Server(name, cmd, extra_body={"timings_per_token": True})


@dataclass
class Reply:
    ttft: float
    stamps: list[float]
    text: str
    prompt_tokens: int
    cached: int | None


async def ask(client: httpx.AsyncClient, url: str, model: str, messages: list[dict[str, str]], max_tokens: int,
              ignore_eos: bool = False, stamps: list[float] | None = None, counts: list[int] | None = None,
              extra: dict[str, Any] | None = None) -> Reply:
    """One streamed chat request; `stamps` (when given) collects the arrival times of the chunks with
    text even if the request is cancelled, and `counts` the tokens generated up to each (a chunk can
    carry several tokens' text: one that ends inside a UTF-8 character sends none). The count comes
    from the gateway's per-chunk usage (vLLM's continuous_usage_stats) or llama-server's per-chunk
    timings (timings_per_token)."""
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                            **(extra or {})}
    if ignore_eos:
        body["ignore_eos"] = True
    t0 = time.perf_counter()
    stamps = [] if stamps is None else stamps
    text: list[str] = []
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
            for ch in chunk.get("choices", []):
                piece = ch.get("delta", {}).get("content")
                if piece:
                    stamps.append(time.perf_counter())
                    text.append(piece)
                    if counts is not None:
                        counts.append(int((chunk.get("usage") or {}).get("completion_tokens")
                                          or (chunk.get("timings") or {}).get("predicted_n") or 0))
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    if cached is None and "cache_n" in timings:  # llama-server's own field
        cached = timings["cache_n"]
    return Reply(stamps[0] - t0 if stamps else time.perf_counter() - t0, stamps, "".join(text),
                 usage.get("prompt_tokens", 0), cached)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))] if s else float("nan")


# --- conversations beyond the slot count ------------------------------------------------------

async def conversations(url: str, n: int, turns: int) -> dict[str, float]:
    follow: list[Reply] = []

    async def one(i: int, client: httpx.AsyncClient) -> None:
        messages = [{"role": "system", "content": f"You are assistant number {i}. " + "Answer briefly and politely. " * 30}]
        for t in range(turns):
            messages.append({"role": "user", "content": f"Question {t} of conversation {i}: name a colour and a city."})
            r = await ask(client, url, SMOL, messages, 24)
            messages.append({"role": "assistant", "content": r.text})
            if t:
                follow.append(r)

    async with httpx.AsyncClient(timeout=600, limits=NO_KEEPALIVE) as client:
        await asyncio.gather(*(one(i, client) for i in range(n)))
    ttfts = [r.ttft * 1000 for r in follow]
    known = [r for r in follow if r.cached is not None]
    return {"cached_share": sum(r.cached or 0 for r in known) / max(1, sum(r.prompt_tokens for r in known)),
            "ttft_p50_ms": statistics.median(ttfts), "ttft_p95_ms": pct(ttfts, 0.95), "turns": len(follow)}


# --- sessions opened at once with one system prompt ---------------------------------------------

async def together(url: str, model: str, sessions: int, prefix_words: int) -> dict[str, Any]:
    """`sessions` requests at once sharing one long system prompt, each with its own question (agents'
    sessions or sub-agents started together, n choices), after one request with a system prompt of the
    same size alone (the cold reference; it shares no prefix with them)."""
    rules = " ".join(f"Rule {i}: keep every change small, tested and explained." for i in range(prefix_words // 9))
    system = "You are a coding agent working in a large repository. " + rules

    def chat(head: str, question: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": head + system}, {"role": "user", "content": question}]

    async with httpx.AsyncClient(timeout=1800, limits=NO_KEEPALIVE) as client:
        cold = await ask(client, url, model, chat("Alone. ", "Say hello."), 8)
        replies = await asyncio.gather(*(ask(client, url, model, chat("", f"Task {i}: name a colour."), 8)
                                         for i in range(sessions)))
    ttfts = sorted(r.ttft * 1000 for r in replies)
    known = [r for r in replies if r.cached is not None]
    return {"cold_ms": cold.ttft * 1000, "prompt_tokens": replies[0].prompt_tokens, "ttfts_ms": [round(t) for t in ttfts],
            "ttft_p50_ms": statistics.median(ttfts), "ttft_max_ms": ttfts[-1],
            "cached_share": sum(r.cached or 0 for r in known) / max(1, sum(r.prompt_tokens for r in known))}


# --- agent sessions: a long stable prefix, a growing history ----------------------------------

async def agent(url: str, model: str, sessions: int, turns: int, prefix_words: int) -> dict[str, Any]:
    per_turn: dict[int, list[float]] = {}
    later_replies: list[Reply] = []

    # The later turns are measured after every session's first (cold) turn: otherwise they would
    # queue behind other sessions' cold prefills, which says nothing about the cache.
    first_done = asyncio.Barrier(sessions)

    async def one(i: int, client: httpx.AsyncClient) -> None:
        messages = [{"role": "user", "content": "Instructions and tools:\n" + text_of(prefix_words, 1000 + i)}]
        for t in range(turns):
            if t == 1:
                await first_done.wait()
            if t:
                messages.append({"role": "user", "content": f"Step {t}: " + text_of(90, 50_000 + 100 * i + t)})
            r = await ask(client, url, model, messages, 32, ignore_eos=True)
            messages.append({"role": "assistant", "content": r.text})
            per_turn.setdefault(t, []).append(r.ttft)
            if t:
                later_replies.append(r)

    async with httpx.AsyncClient(timeout=1800, limits=NO_KEEPALIVE) as client:
        await asyncio.gather(*(one(i, client) for i in range(sessions)))
        # A cold prefill of a prefix of the same size, alone.
        cold = await ask(client, url, model, [{"role": "user", "content": "Instructions and tools:\n"
                                                + text_of(prefix_words, 999)}], 1)
        cache = await prefix_cache_metrics(client, url)
    later = [x for t, xs in per_turn.items() if t for x in xs]
    return {"cold_ms": cold.ttft * 1000, "cold_prompt_tokens": cold.prompt_tokens,
            "first_turn_p50_ms": statistics.median(per_turn[0]) * 1000,
            "later_p50_ms": statistics.median(later) * 1000, "later_p95_ms": pct(later, 0.95) * 1000,
            "later_p50_share": statistics.median(later) / cold.ttft, "later_max_share": max(later) / cold.ttft,
            "later_cached_share": sum(r.cached or 0 for r in later_replies) / max(1, sum(r.prompt_tokens for r in later_replies)),
            "later_ttfts_ms": [round(x * 1000) for x in later], "prefix_cache": cache}


async def prefix_cache_metrics(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The gateway's gateway_prefix_cache_* series (hits, saves, copy rates, pinned...) and
    gateway_kv_preemptions_total; {} elsewhere."""
    r = await client.get(f"{url}/metrics")
    if r.status_code != 200:
        return {}
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(r.text):
        for sm in fam.samples:
            if sm.name.startswith(("gateway_prefix_cache_", "gateway_kv_")) and not sm.name.endswith("_created"):
                name = sm.name.removeprefix("gateway_prefix_cache_")
                out[name] = out.get(name, 0.0) + sm.value
    return out


# --- a long prompt arriving beside running streams -------------------------------------------

async def loop_lag(lags: list[tuple[float, float]], tick: float = 0.002) -> None:
    """Until cancelled: (when, ms late) of each wake-up of this event loop, asked every `tick`.
    A gap the client measures while its own loop was late is the client's, not the server's."""
    while True:
        t = time.perf_counter()
        await asyncio.sleep(tick)
        now = time.perf_counter()
        lags.append((now, (now - t - tick) * 1000))


def _ask_alone_process(url: str, model: str, text: str) -> tuple[float, float, int]:
    """In a process of its own: one streamed request of `text`; (when sent, TTFT s, prompt tokens).
    perf_counter is CLOCK_MONOTONIC, one clock for every process of the machine."""
    async def go() -> tuple[float, float, int]:
        async with httpx.AsyncClient(timeout=1800, limits=NO_KEEPALIVE) as client:
            t0 = time.perf_counter()
            r = await ask(client, url, model, [{"role": "user", "content": text}], 1)
            return t0, r.ttft, r.prompt_tokens
    return asyncio.run(go())


async def interference(url: str, model: str, streams: int, long_words: int, rounds: int = 1,
                       senders: tuple[str, ...] = ("process",), extra: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """`streams` streams decoding; then `rounds` long prompts (each its own text), one at a time,
    sent in turn by each of `senders`: 'loop', the streams' own client (one event loop reads the
    streams and sends the prompt), or 'process', a client in a process of its own (as another app
    would send it). One result per round."""
    import concurrent.futures
    import gc
    import multiprocessing

    pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(pool, time.perf_counter)  # the process started before anything is timed
    gc_pauses: list[tuple[float, float]] = []  # (when it ended, ms) of this process's collections
    gc_started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            gc_pauses.append((time.perf_counter(), (time.perf_counter() - gc_started[0]) * 1000))

    gc.callbacks.append(on_gc)
    out: list[dict[str, Any]] = []
    try:
        async with httpx.AsyncClient(timeout=1800, limits=NO_KEEPALIVE) as client:
            # The reference: the fastest of three such prompts alone (the first after a load can be slower).
            alones = [await ask(client, url, model, [{"role": "user", "content": text_of(long_words, seed)}], 1)
                      for seed in (5, 6, 7)]
            alone = min(alones, key=lambda r: r.ttft)
            stamps_of: list[list[float]] = [[] for _ in range(streams)]
            counts_of: list[list[int]] = [[] for _ in range(streams)]
            running = [asyncio.create_task(ask(client, url, model,
                                               [{"role": "user", "content": f"Story {i}: once upon a time"}],
                                               4096, ignore_eos=True, stamps=stamps_of[i], counts=counts_of[i],
                                               extra=extra))
                       for i in range(streams)]
            lags: list[tuple[float, float]] = []
            watch = asyncio.create_task(loop_lag(lags))
            await asyncio.sleep(3.0)  # all streams decoding
            # The client is the instrument: no collection of its own while it times the streams
            # (one took 51 ms in a round on the H100 and showed in every stream's gaps).
            gc.collect()
            gc.disable()
            windows: list[tuple[str, float, float, int]] = []
            for k in range(rounds):
                sender = senders[k % len(senders)]
                long_text = text_of(long_words, 8 + k)  # a prompt no sequence holds yet
                if sender == "loop":
                    t0 = time.perf_counter()
                    beside = await ask(client, url, model, [{"role": "user", "content": long_text}], 1)
                    ttft, tokens = beside.ttft, beside.prompt_tokens
                else:
                    t0, ttft, tokens = await loop.run_in_executor(pool, _ask_alone_process, url, model, long_text)
                windows.append((sender, t0, ttft, tokens))
                await asyncio.sleep(2.0)
            watch.cancel()
            for task in running:
                task.cancel()
            await asyncio.gather(watch, *running, return_exceptions=True)
    finally:
        gc.enable()
        gc.callbacks.remove(on_gc)
        pool.shutdown()
    first_t0 = windows[0][1]
    for sender, t0, ttft, tokens in windows:
        t1 = t0 + ttft
        # Inter-token gaps of the running streams while the long prompt was prefilled, and before
        # the first long prompt.
        # Per token: a chunk that brings k tokens' text after a gap counts k gaps of gap/k (the
        # tokens' own times are not seen); per chunk as the client sees text, in the JSON too.
        during: list[float] = []
        before: list[float] = []
        chunks_during: list[float] = []
        unknown = 0
        for st, cs in zip(stamps_of, counts_of, strict=True):
            for (a, ca), (b, cb) in zip(zip(st, cs, strict=True), zip(st[1:], cs[1:], strict=True), strict=False):
                k = cb - ca if ca and cb > ca else 1
                unknown += not (ca and cb > ca)
                gaps = [(b - a) * 1000 / k] * k
                if t0 <= b <= t1:
                    during += gaps
                    chunks_during.append((b - a) * 1000)
                elif b < first_t0:
                    before += gaps
        out.append({"sender": sender, "alone_ttft_ms": alone.ttft * 1000, "beside_ttft_ms": ttft * 1000,
                    "ttft_ratio": ttft / alone.ttft, "prompt_tokens": tokens,
                    "itl_before_p50_ms": statistics.median(before) if before else float("nan"),
                    "itl_during_p50_ms": statistics.median(during) if during else float("nan"),
                    "itl_during_p99_ms": pct(during, 0.99), "itl_during_max_ms": max(during) if during else float("nan"),
                    "gaps_during": len(during),
                    "chunk_itl_during_p99_ms": pct(chunks_during, 0.99),
                    "chunk_itl_during_max_ms": max(chunks_during, default=float("nan")),
                    "gaps_without_token_count": unknown,
                    # How late the streams' client's event loop woke while the prompt was prefilled, and its
                    # longest garbage collection then: a stall of the client shows in every stream's gaps at once.
                    "client_loop_late_max_ms": max((ms for when, ms in lags if t0 <= when <= t1), default=float("nan")),
                    "client_gc_max_ms": max((ms for when, ms in gc_pauses if t0 <= when <= t1), default=0.0)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="conversations,agent,interference")
    ap.add_argument("--backend", default="cpu", help="cpu or cuda (llama-server build and gateway --engine)")
    ap.add_argument("--server-bin", default=None, help="an existing llama-server build's bin dir")
    ap.add_argument("--parallel", type=int, default=8, help="sequences per server, conversations part")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--shared-sequences", type=int, default=None,
                    help="conversations part: also the gateway with one KV cache of --parallel sequences' size shared by "
                         "this many (kv_unified + sequences), and llama-server with as many slots over the same cells "
                         "(default 2 x --parallel; 0 = leave out)")
    ap.add_argument("--agent-sessions", type=int, default=4)
    ap.add_argument("--agent-parallel", type=int, default=2, help="fewer sequences than sessions: the cache's case")
    ap.add_argument("--agent-cold-ms", type=float, default=0.0,
                    help="agent part: the cold prefill (ms) the later turns are compared with (default: the "
                         "fastest server's own in this run)")
    ap.add_argument("--agent-turns", type=int, default=10)
    ap.add_argument("--agent-shared-sequences", type=int, default=None,
                    help="agent part: also the gateway with one KV cache of --agent-parallel sequences' size shared by "
                         "this many (default --agent-sessions; 0 = leave out)")
    ap.add_argument("--agent-prefix-words", type=int, default=9000, help="~12k tokens")
    ap.add_argument("--model", default=GEMMA, help="model id of the agent and interference parts")
    ap.add_argument("--long-model", default=None, help="model id of the interference part (default --model): "
                    "its context_length bounds the KV of streams + 1 sequences")
    ap.add_argument("--config", default=None, help="models.yaml with those models (default: the repo's)")
    ap.add_argument("--agent-skip-nocache", action="store_true", help="leave out the gateway without its host cache")
    ap.add_argument("--gateway-variant", action="append", default=[], metavar="NAME:VAR=VALUE[,VAR=VALUE]",
                    help="agent and interference parts: also a gateway with these environment settings, "
                         "e.g. 'pageable host cache:GATEWAY_PINNED_HOST_CACHE=0'")
    ap.add_argument("--together-sessions", type=int, default=4, help="together part: requests sent at once")
    ap.add_argument("--together-model", default=SMOL, help="together part: the model")
    ap.add_argument("--together-words", type=int, default=1000,
                    help="together part: words of the shared system prompt (1000: ~1.4k SmolLM2 tokens)")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--long-words", type=int, default=12000, help="~16k tokens")
    ap.add_argument("--rounds", type=int, default=1, help="interference part: long prompts, one after another, "
                    "per server (each its own text, 2 s apart, the streams decoding throughout)")
    ap.add_argument("--long-sender", default="process", help="interference part: who sends the long prompts, in "
                    "turn: 'process' (a client of its own, as another app) and/or 'loop' (the streams' own client), "
                    "e.g. 'process,loop'")
    ap.add_argument("--budgets", default="64,256", help="gateway prefill budgets to compare")
    ap.add_argument("--unified-budgets", default="", help="interference part: also the gateway with one KV cache "
                    "shared by its sequences (models.yaml kv_unified, llama-server's layout) at these budgets")
    ap.add_argument("--only", default="", help="run only the servers of these names, ';'-separated "
                    "(e.g. 'gateway;gateway, shared KV, 16 sequences')")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    only = {n.strip() for n in args.only.split(";") if n.strip()}

    def chosen(servers: list[Server]) -> list[Server]:
        return [s for s in servers if not only or s.name in only]

    parts = set(args.parts.split(","))
    from gateway.models.registry import load_registry

    global CONFIG
    CONFIG = str(Path(args.config).resolve()) if args.config else CONFIG
    reg = load_registry(CONFIG)
    smol_path = str(reg.resolve(reg.models[SMOL], "gguf")) if "conversations" in parts else ""
    gemma = reg.models[args.model]
    gemma_path = str(reg.resolve(gemma, "gguf"))
    bin_dir = args.server_bin or subprocess.run(
        ["bash", str(ROOT / "benchmarks/build-llama-server.sh"), args.backend], check=True, capture_output=True, text=True
    ).stdout.strip().splitlines()[-1]
    ngl = ["-ngl", "99"] if args.backend != "cpu" else []
    engine = ["--engine", args.backend] if args.backend != "cpu" else ["--engine", "cpu"]
    raw: dict[str, Any] = {}

    if "conversations" in parts:
        smol_ctx = reg.models[SMOL].context_length
        servers = [gateway(SMOL, args.parallel, *engine),
                   gateway(SMOL, args.parallel, *engine, "--prefix-cache", "0", name="gateway, no host cache"),
                   llama_server(bin_dir, smol_path, args.parallel, smol_ctx, None, *ngl)]
        shared = 2 * args.parallel if args.shared_sequences is None else args.shared_sequences
        if shared:
            cfg = derived_config(SMOL, "shared", kv_unified=True, sequences=shared)
            servers.insert(1, gateway(SMOL, args.parallel, *engine, "--config", cfg,
                                      name=f"gateway, shared KV, {shared} sequences"))
            servers.append(llama_server(bin_dir, smol_path, shared, smol_ctx * args.parallel // shared, None, *ngl,
                                        name=f"llama-server, {shared} slots"))
        for srv in chosen(servers):
            with srv:
                for n in (args.parallel, 2 * args.parallel):
                    r = asyncio.run(conversations(srv.url, n, args.turns))
                    raw.setdefault("conversations", {}).setdefault(srv.name, {})[n] = r
                    print(f"conversations {srv.name:<24} n={n:<3} {r}", file=sys.stderr, flush=True)

    if "together" in parts:
        spec = reg.models[args.together_model]
        path = str(reg.resolve(spec, "gguf"))
        k = args.together_sessions
        servers = [gateway(args.together_model, k, *engine),
                   gateway(args.together_model, k, *engine, name="gateway, each prefills its own",
                           env={"GATEWAY_PREFIX_FOLLOW": "off"}),
                   llama_server(bin_dir, path, k, spec.context_length, spec.chat_template, *ngl)]
        for srv in chosen(servers):
            with srv:
                r = asyncio.run(together(srv.url, args.together_model, k, args.together_words))
                raw.setdefault("together", {})[srv.name] = r
                print(f"together {srv.name:<24} {r}", file=sys.stderr, flush=True)

    if "agent" in parts:
        servers = [gateway(args.model, args.agent_parallel, *engine),
                   gateway(args.model, args.agent_parallel, *engine, "--prefix-cache", "0", name="gateway, no host cache"),
                   llama_server(bin_dir, gemma_path, args.agent_parallel, gemma.context_length, gemma.chat_template, *ngl)]
        if args.agent_skip_nocache:  # every later turn re-prefills the whole prefix: an hour on 2 cores
            servers.pop(1)
        shared = args.agent_sessions if args.agent_shared_sequences is None else args.agent_shared_sequences
        if shared:
            cfg = derived_config(args.model, "agent-shared", kv_unified=True, sequences=shared)
            servers.insert(1, gateway(args.model, args.agent_parallel, *engine, "--config", cfg,
                                      name=f"gateway, shared KV, {shared} sequences"))
        for variant in args.gateway_variant:
            name, env = variant_env(variant)
            servers.insert(1, gateway(args.model, args.agent_parallel, *engine, name=name, env=env))
        for srv in chosen(servers):
            with srv:
                r = asyncio.run(agent(srv.url, args.model, args.agent_sessions, args.agent_turns, args.agent_prefix_words))
                raw.setdefault("agent", {})[srv.name] = r
                print(f"agent {srv.name:<24} {r}", file=sys.stderr, flush=True)

    if "interference" in parts:
        long_id = args.long_model or args.model
        long_spec = reg.models[long_id]
        servers = [gateway(long_id, args.streams + 1, *engine, "--prefill-budget", b, "--prefix-cache", "0",
                           name=f"gateway, budget {b}") for b in args.budgets.split(",") if b]
        if args.unified_budgets:
            unified = derived_config(long_id, "unified", kv_unified=True)
            servers += [gateway(long_id, args.streams + 1, *engine, "--prefill-budget", b, "--prefix-cache", "0",
                                "--config", unified, name=f"gateway, unified KV, budget {b}")
                        for b in args.unified_budgets.split(",")]
        first_budget = next((b for b in args.budgets.split(",") if b), "512")
        for variant in args.gateway_variant:  # e.g. a second context for long prompts (GATEWAY_LONG_PROMPT_TOKENS)
            name, env = variant_env(variant)
            servers.append(gateway(long_id, args.streams + 1, *engine, "--prefill-budget", first_budget,
                                   "--prefix-cache", "0", name=name, env=env))
        servers.append(llama_server(bin_dir, str(reg.resolve(long_spec, "gguf")), args.streams + 1,
                                    long_spec.context_length, long_spec.chat_template, "--cache-ram", "0", *ngl))
        senders = tuple(x for x in args.long_sender.split(",") if x)
        for srv in chosen(servers):
            with srv:
                rs = asyncio.run(interference(srv.url, long_id, args.streams, args.long_words, args.rounds, senders,
                                              srv.extra_body))
                raw.setdefault("interference", {})[srv.name] = rs
                for r in rs:
                    print(f"interference {srv.name:<24} {r}", file=sys.stderr, flush=True)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    print(f"\nmachine: {cpu}, {os.cpu_count()} cores, {platform.platform()}; commit {commit}; llama-server from {bin_dir}\n")
    if "conversations" in raw:
        print(f"Conversations of {args.turns} turns on {args.parallel} sequences ({SMOL}); follow-up turns:\n")
        print("| server | conversations | prompt tokens from cache | follow-up TTFT p50 ms | p95 ms |")
        print("|---|---|---|---|---|")
        for name, by_n in raw["conversations"].items():
            for n, r in by_n.items():
                print(f"| {name} | {n} | {r['cached_share'] * 100:.0f} % | {r['ttft_p50_ms']:.0f} | {r['ttft_p95_ms']:.0f} |")
    if "agent" in raw:
        print(f"\nAgent sessions: {args.agent_sessions} at once on {args.agent_parallel} sequences, {args.agent_turns} "
              f"turns, ~{args.agent_prefix_words} words of stable prefix ({args.model}, {gemma.context_length} context):\n")
        # The share that the target means: of a cold prefill alone. A server's own cold prefill runs
        # beside the sessions' KV, which the shared layout may keep on the device (H100: 2.4x slower),
        # so the reference is the fastest cold prefill of the run, or --agent-cold-ms.
        ref = args.agent_cold_ms or min(r["cold_ms"] for r in raw["agent"].values())
        print(f"Reference cold prefill: {ref:.0f} ms ({'given' if args.agent_cold_ms else 'the fastest of this run'}).\n")
        print("| server | cold prefill ms (tokens) | first turn p50 ms | later turns p50 / p95 / max ms "
              "| later p50 / p95 / max as share of the reference | host cache: hits / saves / skipped, copy GB/s save / restore |")
        print("|---|---|---|---|---|---|")
        for name, r in raw["agent"].items():
            c = r.get("prefix_cache") or {}
            cache = (f"{c['hits_total']:.0f} / {c['saves_total']:.0f} / {c['skipped_saves_total']:.0f}, "
                     f"{c['save_bytes_per_second'] / 1e9:.1f} / {c['restore_bytes_per_second'] / 1e9:.1f}"
                     f"{' (pinned)' if c.get('pinned') else ''}") if c.get("limit_bytes") else "-"
            later_max = max(r["later_ttfts_ms"])
            shares = " / ".join(f"{x / ref * 100:.1f} %" for x in (r["later_p50_ms"], r["later_p95_ms"], later_max))
            print(f"| {name} | {r['cold_ms']:.0f} ({r['cold_prompt_tokens']}) | {r['first_turn_p50_ms']:.0f} | "
                  f"{r['later_p50_ms']:.0f} / {r['later_p95_ms']:.0f} / {later_max:.0f} | {shares} | {cache} |")
    if "together" in raw:
        print(f"\n{args.together_sessions} requests at once with one system prompt ({args.together_model}, "
              f"~{args.together_words} words), each its own question; cold: one such prompt alone:\n")
        print("| server | prompt tokens | cold prefill ms | TTFT p50 / max ms | max as × cold | prompt tokens from cache |")
        print("|---|---|---|---|---|---|")
        for name, r in raw["together"].items():
            print(f"| {name} | {r['prompt_tokens']} | {r['cold_ms']:.0f} | {r['ttft_p50_ms']:.0f} / {r['ttft_max_ms']:.0f} | "
                  f"{r['ttft_max_ms'] / r['cold_ms']:.2f} | {r['cached_share'] * 100:.0f} % |")
    if "interference" in raw:
        print(f"\nPrefill interference: {args.streams} streams decoding while a long prompt arrives "
              f"({args.long_model or args.model}):\n")
        print("Sent by: 'loop', the streams' own client; 'process', a client in a process of its own. "
              "Client: how late the streams' client's event loop woke, and its longest garbage collection, "
              "during the prefill.\n")
        print("ITL per token (a chunk with k tokens' text after a gap counts k gaps of gap/k); per chunk: as the "
              "client sees text arrive (a token that ends inside a UTF-8 character brings none: random weights "
              "write many).\n")
        print("| server | round, sent by | long prompt tokens | TTFT alone ms | TTFT beside streams ms (ratio) | "
              "streams' ITL before p50 ms | during p50 / p99 / max ms | per chunk: during p99 / max ms | "
              "client: loop late / GC, max ms |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, rs in raw["interference"].items():
            for k, r in enumerate(rs, 1):
                print(f"| {name} | {k}, {r['sender']} | {r['prompt_tokens']} | {r['alone_ttft_ms']:.0f} | "
                      f"{r['beside_ttft_ms']:.0f} ({r['ttft_ratio']:.2f}) | {r['itl_before_p50_ms']:.1f} | "
                      f"{r['itl_during_p50_ms']:.1f} / {r['itl_during_p99_ms']:.1f} / {r['itl_during_max_ms']:.1f} | "
                      f"{r['chunk_itl_during_p99_ms']:.1f} / {r['chunk_itl_during_max_ms']:.1f} | "
                      f"{r['client_loop_late_max_ms']:.1f} / {r['client_gc_max_ms']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
