"""The gap a client sees when the engine under its stream dies: one command.

    .venv/bin/python benchmarks/bench_failover.py [--rounds 10] [--engine cpu] [--model ID] [--kill-at 40]

Starts `gateway serve` (engines in worker processes, the default), then per round streams one
greedy chat of --max-tokens tokens from a fresh worker and kills it (SIGKILL) after --kill-at tokens. The gap
is the time between the last token before the kill and the first after it, as the client reads
them; beside it, the stream's ordinary inter-token gap (median). Each round also checks that the
stream finished whole (no error frame, finish_reason "length", the same text as an uninterrupted
run). Prints a Markdown table with machine and commit; --json keeps every number.

Peers have no such gap to measure: llama-server and Ollama drop the connection when their engine
dies, vLLM answers 500 and restarts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
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
from benchmarks.bench_vs_llama_server import MODEL, _stop, _wait  # noqa: E402
from gateway.host.ports import free_port  # noqa: E402

PROMPT = [{"role": "user", "content": "Tell a long story about a lighthouse keeper."}]


def _worker_pid(url: str, model: str) -> int | None:
    m = httpx.get(f"{url}/health", timeout=10).json()["models"].get(model, {})
    pid = m.get("worker", {}).get("pid")
    return int(pid) if pid and m.get("ready") else None


def _wait_worker(url: str, model: str, other_than: int | None, timeout: float = 300, standby: bool = False) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = _worker_pid(url, model)
        m = httpx.get(f"{url}/health", timeout=10).json()["models"].get(model, {})
        spare = m.get("worker", {}).get("standby", {}).get("ready")
        if pid is not None and pid != other_than and (spare or not standby):
            return pid
        time.sleep(0.05)
    raise RuntimeError("the worker did not come back")


def _fresh(url: str, model: str, standby: bool) -> None:
    """A worker that has not seen the prompt: it prefills it whole, as the reference run did and as
    the worker that takes over will (on CUDA a prompt half from the prefix cache already changes
    the greedy text: benchmarks/check_determinism.py)."""
    pid = _wait_worker(url, model, None, standby=standby)
    os.kill(pid, signal.SIGKILL)
    _wait_worker(url, model, pid, standby=standby)


def _round(url: str, model: str, max_tokens: int, kill_at: int, reference: str | None,
           standby: bool) -> dict[str, Any]:
    _fresh(url, model, standby)
    pid = _wait_worker(url, model, None, standby=standby)
    body = {"model": model, "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    arrivals: list[float] = []
    text, killed_at, frames = "", 0.0, []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            frames.append(chunk)
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                arrivals.append(time.perf_counter())
                text += chunk["choices"][0]["delta"]["content"]
                if len(arrivals) == kill_at:
                    os.kill(pid, signal.SIGKILL)
                    killed_at = arrivals[-1]
    after = [t for t in arrivals if t > killed_at]
    gap = after[0] - killed_at if after else float("nan")
    usual = statistics.median(b - a for a, b in zip(arrivals[:kill_at], arrivals[1:kill_at], strict=False))
    usage = next((f["usage"] for f in frames if f.get("usage")), {})
    clean = (not any("error" in f for f in frames)
             and [f["choices"][0]["finish_reason"] for f in frames if f.get("choices") and f["choices"][0]["finish_reason"]] == ["length"]
             and usage.get("completion_tokens") == max_tokens)
    same = reference is None or text == reference
    return {"gap_s": gap, "itl_s": usual, "whole": clean and same, "clean": clean, "same_text": same,
            "failovers": usage.get("failovers", 0), "completion_tokens": usage.get("completion_tokens")}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--engine", default="cpu")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--config", default=str(ROOT / "models.yaml"))
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--kill-at", type=int, default=40)
    ap.add_argument("--standby", action="store_true", help="the model keeps a warm standby worker (models.yaml standby)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.standby:
        import yaml

        cfg = yaml.safe_load(Path(args.config).read_text())
        for m in cfg["models"]:
            if m["id"] == args.model:
                m["standby"] = True
        cfg.setdefault("cache_dir", None)
        if cfg["cache_dir"] is None:
            del cfg["cache_dir"]
        tmp = Path(tempfile.mkdtemp()) / "models.yaml"
        tmp.write_text(yaml.safe_dump(cfg))
        args.config = str(tmp)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    env = {**os.environ, "GATEWAY_WORKER_MAX_CRASHES": "1000", "GATEWAY_FAILOVER_BUDGET": "2"}
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--engine", args.engine, "--port", str(port),
                             "--config", args.config, "--model", args.model, "--parallel", "1"],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    rows: list[dict[str, Any]] = []
    try:
        _wait(url, proc)
        _fresh(url, args.model, args.standby)
        ref = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
            "model": args.model, "messages": PROMPT, "max_tokens": args.max_tokens, "temperature": 0,
            "ignore_eos": True}).json()["choices"][0]["message"]["content"]
        for i in range(args.rounds):
            row = _round(url, args.model, args.max_tokens, args.kill_at, ref, args.standby)
            rows.append(row)
            print(f"round {i + 1}: gap {row['gap_s'] * 1000:.0f} ms (usual {row['itl_s'] * 1000:.1f} ms), "
                  f"no error and {args.max_tokens} tokens: {row['clean']}, the uninterrupted text: {row['same_text']}",
                  file=sys.stderr)
    finally:
        _stop(proc)
    gaps = sorted(r["gap_s"] for r in rows)
    p95 = gaps[min(len(gaps) - 1, round(0.95 * (len(gaps) - 1)))]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    standby = "with a warm standby" if args.standby else "no standby"
    print(f"\nFailover gap, {args.model} on {args.engine}, {standby}; {cpu}, {os.cpu_count()} cores; commit {commit}; "
          f"{args.rounds} rounds, SIGKILL at token {args.kill_at} of {args.max_tokens}\n")
    print("| gap p50 | gap p95 | gap max | usual ITL (median) | no error, all tokens | the uninterrupted text |")
    print("|---|---|---|---|---|---|")
    print(f"| {statistics.median(gaps) * 1000:.0f} ms | {p95 * 1000:.0f} ms | {gaps[-1] * 1000:.0f} ms | "
          f"{statistics.median(r['itl_s'] for r in rows) * 1000:.1f} ms | {sum(r['clean'] for r in rows)}/{len(rows)} | "
          f"{sum(r['same_text'] for r in rows)}/{len(rows)} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"commit": commit, "cpu": cpu, "args": vars(args), "rounds": rows}, indent=2))
    return 0 if all(r["clean"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
