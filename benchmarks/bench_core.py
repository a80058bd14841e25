"""Core benchmark: cold start, and decode tok/s through the gateway vs llama-cpp-python directly.

    .venv/bin/python benchmarks/bench_core.py [--tokens 128] [--runs 3] [--concurrency 1,4,8]

Starts `gateway serve` as a subprocess on a free loopback port, measures on the client side, and
prints a Markdown table (append it to BENCHMARKS.md with the machine and commit it prints).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.host.ports import free_port  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
MODEL = "smollm2-135m-instruct"


def stream_once(url: str, tokens: int) -> dict[str, float]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    n = len(stamps)
    return {"ttft": stamps[0] - t0, "decode_tps": (n - 1) / (stamps[-1] - stamps[0]), "tokens": n, "e2e": stamps[-1] - t0}


def direct(model_path: str, tokens: int, runs: int, threads: int, gpu_layers: int = 0) -> list[dict[str, float]]:
    from llama_cpp import Llama

    llm = Llama(model_path=model_path, n_ctx=2048, n_threads=threads or None, n_gpu_layers=gpu_layers, verbose=False)
    eos = llm.token_eos()
    out = []
    for _ in range(runs + 1):
        llm.reset()
        t0 = time.perf_counter()
        stamps = []
        for _chunk in llm.create_completion(PROMPT, max_tokens=tokens, temperature=0, stream=True, logit_bias={eos: -1e9}):
            stamps.append(time.perf_counter())
        out.append({"ttft": stamps[0] - t0, "decode_tps": (len(stamps) - 1) / (stamps[-1] - stamps[0]), "tokens": len(stamps)})
    del llm
    return out[1:]  # first run is warm-up


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--json", default=None)
    ap.add_argument("--config", default=str(ROOT / "models.yaml"), help="models.yaml to take the model from")
    ap.add_argument("--engine", default="auto", help="gateway serve --engine")
    ap.add_argument("--gpu-layers", type=int, default=0, help="direct llama-cpp-python run: layers on the GPU (-1 all)")
    ap.add_argument("--gateway", default=str(ROOT / ".venv/bin/gateway"), help="command that runs the gateway CLI")
    args = ap.parse_args()
    from gateway.models.registry import load_registry

    reg = load_registry(args.config)
    model_path = str(reg.resolve(reg.models[MODEL], "gguf"))
    conc = [int(c) for c in args.concurrency.split(",")]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "GATEWAY_LOG_LEVEL": "warning", "GATEWAY_CHECK_MODELS": "0", "GATEWAY_CONFIG": args.config}
    t_spawn = time.perf_counter()
    proc = subprocess.Popen([*shlex.split(args.gateway), "serve", "--engine", args.engine, "--port", str(port), "--parallel", str(max(conc))],
                            env=env, cwd=ROOT)
    results: dict[str, object] = {}
    try:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        t_ready = time.perf_counter() - t_spawn
        first = stream_once(url, 2)
        results["cold_start_ready_s"] = t_ready
        results["cold_start_first_token_s"] = t_ready + first["ttft"]
        gw = [stream_once(url, args.tokens) for _ in range(args.runs + 1)][1:]
        results["gateway_single"] = gw
        agg = {}
        for c in conc:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(c) as pool:
                rs = list(pool.map(lambda _: stream_once(url, args.tokens), range(c * 2)))
            dt = time.perf_counter() - t0
            agg[c] = {"aggregate_tps": sum(r["tokens"] for r in rs) / dt,
                      "p50_ttft": statistics.median(r["ttft"] for r in rs),
                      "max_ttft": max(r["ttft"] for r in rs)}
        results["gateway_concurrency"] = agg
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    results["direct_single"] = direct(model_path, args.tokens, args.runs, 0, args.gpu_layers)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    gw_tps = statistics.median(r["decode_tps"] for r in results["gateway_single"])  # type: ignore[union-attr,index]
    dr_tps = statistics.median(r["decode_tps"] for r in results["direct_single"])  # type: ignore[union-attr,index]
    gw_ttft = statistics.median(r["ttft"] for r in results["gateway_single"])  # type: ignore[union-attr,index]
    dr_ttft = statistics.median(r["ttft"] for r in results["direct_single"])  # type: ignore[union-attr,index]
    print(f"\nmachine: {platform.machine()} {os.cpu_count()} cores, {platform.platform()}; commit {commit}")
    print(f"model {MODEL}, {args.tokens} tokens, median of {args.runs} runs after 1 warm-up\n")
    print("| measure | value |\n|---|---|")
    print(f"| cold start: spawn -> /health 200 | {results['cold_start_ready_s']:.2f} s |")
    print(f"| cold start: spawn -> first token | {results['cold_start_first_token_s']:.2f} s |")
    print(f"| decode tok/s, gateway (SSE, client side) | {gw_tps:.1f} |")
    print(f"| decode tok/s, llama-cpp-python `Llama` direct | {dr_tps:.1f} |")
    print(f"| gateway / direct | {gw_tps / dr_tps:.3f} |")
    print(f"| TTFT gateway / direct | {gw_ttft * 1000:.0f} ms / {dr_ttft * 1000:.0f} ms |")
    for c, a in agg.items():
        print(f"| aggregate tok/s at concurrency {c} | {a['aggregate_tps']:.1f} (p50 TTFT {a['p50_ttft'] * 1000:.0f} ms) |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
