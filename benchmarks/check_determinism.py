"""Is greedy output the same across runs of one request on this build and device? Cold (the prompt
prefilled whole on a fresh worker) against warm (the prompt from the prefix cache but its last
token), and cold against cold. Prints the three comparisons (what failover can promise).

    .venv/bin/python benchmarks/check_determinism.py [--engine cuda] [--max-tokens 120]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.bench_failover import PROMPT, _wait_worker  # noqa: E402
from benchmarks.bench_vs_llama_server import MODEL, _wait  # noqa: E402
from gateway.host.ports import free_port  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="cpu")
    ap.add_argument("--max-tokens", type=int, default=120)
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--engine", args.engine, "--port", str(port),
                             "--parallel", "1"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            env={**os.environ, "GATEWAY_WORKER_MAX_CRASHES": "100"})

    def run() -> str:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
            "model": MODEL, "messages": PROMPT, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True})
        return str(r.json()["choices"][0]["message"]["content"])

    def fresh() -> None:
        pid = _wait_worker(url, MODEL, None)
        os.kill(pid, signal.SIGKILL)
        _wait_worker(url, MODEL, pid)
        time.sleep(0.5)

    try:
        _wait(url, proc)
        fresh()
        cold = run()
        warm = run()
        fresh()
        cold2 = run()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)

    def agree(a: str, b: str) -> str:
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        return "identical" if a == b else f"differ from character {n}"

    print(f"{args.engine}: cold vs warm: {agree(cold, warm)}; cold vs cold: {agree(cold, cold2)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
