"""Embeddings throughput, gateway vs `llama-server --embeddings --pooling mean` (same vendored
llama.cpp, same model), and tool-call request latency with the grammar cache cold and warm.

    .venv/bin/python benchmarks/bench_embeddings.py [--requests 40] [--json out.json]

Embeddings: closed loop, one client, batches of 1 and 32 inputs of ~16 words; inputs/s and
tokens/s (tokens as each server's usage reports them). The two servers run one after the other.
Tool calls: the first request with a new tool schema compiles its grammar (JSON schema -> GBNF);
later requests with the same tools reuse it. Each "cold" request uses a fresh tool name.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.bench_vs_llama_server import MODEL, _wait  # noqa: E402
from gateway.host.ports import free_port  # noqa: E402

WORDS = "the of and to in is was for on with as by at from it an be this that are or not cat sea".split()


def texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(16)) for _ in range(n)]


def embed_run(url: str, batch: int, requests: int, model: str) -> dict[str, float]:
    with httpx.Client(timeout=300) as c:
        c.post(f"{url}/v1/embeddings", json={"model": model, "input": texts(batch, 999)})  # warm-up
        tokens = inputs = 0
        t0 = time.perf_counter()
        for i in range(requests):
            r = c.post(f"{url}/v1/embeddings", json={"model": model, "input": texts(batch, i)})
            r.raise_for_status()
            body = r.json()
            inputs += len(body["data"])
            tokens += body["usage"]["prompt_tokens"]
        dt = time.perf_counter() - t0
    return {"inputs_per_s": inputs / dt, "tokens_per_s": tokens / dt, "seconds": dt}


def tool_latency(url: str, n: int) -> dict[str, float]:
    def tool(name: str) -> dict[str, object]:
        return {"type": "function", "function": {"name": name, "description": "Look up an order", "parameters": {
            "type": "object", "properties": {"order_id": {"type": "string"}, "items": {"type": "array", "items": {
                "type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                "required": ["sku", "qty"]}}, "express": {"type": "boolean"}}, "required": ["order_id"]}}}

    def one(c: httpx.Client, name: str) -> float:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Where is order 42?"}],
                "tools": [tool(name)], "tool_choice": "required", "max_tokens": 1, "temperature": 0}
        t0 = time.perf_counter()
        c.post(f"{url}/v1/chat/completions", json=body).raise_for_status()
        return time.perf_counter() - t0

    with httpx.Client(timeout=300) as c:
        one(c, "warmup")
        cold = [one(c, f"lookup_{i}_{random.randrange(1 << 30)}") for i in range(n)]
        warm = [one(c, "lookup_same") for _ in range(n)]
    return {"cold_ms_median": statistics.median(cold) * 1e3, "warm_ms_median": statistics.median(warm) * 1e3}


def grammar_compile(model_path: str, n: int = 20) -> dict[str, float]:
    """The grammar half of a tool-call request, in-process: JSON schema -> GBNF (cached by the
    engine per schema) and llama.cpp's parse of the GBNF into a sampler (done per request)."""
    import llama_cpp as lc

    from engines.llamacpp.grammar import _schema_grammar
    from gateway.chat.formats.base import Tool, ToolChoice, call_cap
    from gateway.chat.formats.rewrite import output_schema

    params = {"type": "object", "properties": {"order_id": {"type": "string"}, "express": {"type": "boolean"},
                                               "items": {"type": "array", "items": {"type": "object", "properties": {
                                                   "sku": {"type": "string"}, "qty": {"type": "integer"}}}}},
              "required": ["order_id"]}
    tools = [Tool(f"tool_{i}", "", params) for i in range(4)]
    schema = json.dumps(output_schema(tools, ToolChoice("auto"), True, call_cap(tools, ToolChoice("auto"), True)))
    cold, warm, parse = [], [], []
    mp = lc.llama_model_default_params()
    mp.vocab_only = True
    model = lc.llama_model_load_from_file(model_path.encode(), mp)
    vocab = lc.llama_model_get_vocab(model)
    try:
        for _ in range(n):
            _schema_grammar.cache_clear()
            t0 = time.perf_counter()
            gbnf = _schema_grammar(schema)
            cold.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            _schema_grammar(schema)
            warm.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            smpl = lc.llama_sampler_init_grammar(vocab, gbnf, b"root")
            parse.append(time.perf_counter() - t0)
            lc.llama_sampler_free(smpl)
    finally:
        lc.llama_model_free(model)
    return {"schema_to_gbnf_ms": statistics.median(cold) * 1e3, "cached_ms": statistics.median(warm) * 1e3,
            "gbnf_parse_ms": statistics.median(parse) * 1e3, "gbnf_bytes": len(gbnf)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=40, help="requests per measurement")
    ap.add_argument("--server-bin", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from gateway.models.registry import load_registry

    reg = load_registry(ROOT / "models.yaml")
    spec = reg.models[MODEL]
    model_path = str(reg.resolve(spec, "gguf"))
    bin_dir = args.server_bin or subprocess.run(
        ["bash", str(ROOT / "benchmarks/build-llama-server.sh"), "cpu"], check=True, capture_output=True, text=True
    ).stdout.strip().splitlines()[-1]
    threads = str(os.cpu_count() or 1)
    results: dict[str, dict[str, object]] = {}
    port = free_port()
    gw = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--engine", "cpu", "--port", str(port)],
                          cwd=ROOT, env={**os.environ, "GATEWAY_LOG_LEVEL": "warning", "GATEWAY_CHECK_MODELS": "0"})
    try:
        _wait(f"http://127.0.0.1:{port}", gw)
        url = f"http://127.0.0.1:{port}"
        results["gateway"] = {f"batch {b}": embed_run(url, b, args.requests, MODEL) for b in (1, 32)}
        results["tools"] = tool_latency(url, 10)
    finally:
        gw.terminate()
        gw.wait(timeout=60)
    port = free_port()
    # The same per-sequence context and 8 sequences, as the gateway's embedding context has.
    ls = subprocess.Popen([f"{bin_dir}/llama-server", "-m", model_path, "--port", str(port), "--embeddings",
                           "--pooling", "mean", "-np", "8", "-c", str(spec.context_length * 8),
                           "-b", str(spec.context_length), "-ub", str(spec.context_length),
                           "-t", threads, "-tb", threads, "--log-disable"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait(f"http://127.0.0.1:{port}", ls)
        url = f"http://127.0.0.1:{port}"
        results["llama-server"] = {f"batch {b}": embed_run(url, b, args.requests, MODEL) for b in (1, 32)}
    finally:
        ls.terminate()
        ls.wait(timeout=60)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    print(f"\nmachine: {platform.machine()} {os.cpu_count()} cores; commit {commit}; llama-server from {bin_dir}")
    print("| server | batch | inputs/s | tokens/s |")
    print("|---|---|---|---|")
    for name in ("gateway", "llama-server"):
        for b in (1, 32):
            r = results[name][f"batch {b}"]
            print(f"| {name} | {b} | {r['inputs_per_s']:.1f} | {r['tokens_per_s']:.0f} |")  # type: ignore[index]
    t = results["tools"]
    print(f"\ntool-call request (1 output token), median of 10: new tool schema {t['cold_ms_median']:.1f} ms, "
          f"same tools again {t['warm_ms_median']:.1f} ms (the second also reuses the prompt's KV)")
    g = results["grammar"] = grammar_compile(model_path)
    print(f"grammar for 4 tools ({g['gbnf_bytes']} bytes of GBNF), median of 20: JSON schema -> GBNF "
          f"{g['schema_to_gbnf_ms']:.2f} ms cold, {g['cached_ms']:.4f} ms cached; llama.cpp parse "
          f"{g['gbnf_parse_ms']:.2f} ms per request")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
