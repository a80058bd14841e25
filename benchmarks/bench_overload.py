"""Overload: `gateway bench` at 4x the slot count against a real `gateway serve`, for a while.

For each admission setting, reports what clients saw (completed, refused with 429 and the
Retry-After they were given, 5xx, TTFT of the accepted) and what the server measured (every
accepted request's wait for its slot, from gateway_admission_wait_seconds, whose buckets include
the --max-queue-wait limit).

    .venv/bin/python benchmarks/bench_overload.py [--duration 120] [--parallel 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.bench_vs_llama_server import _wait  # noqa: E402


def serve(port: int, parallel: int, extra: list[str]) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--engine", "cpu", "--port", str(port),
           "--parallel", str(parallel), *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "GATEWAY_LOG_LEVEL": "warning", "GATEWAY_CHECK_MODELS": "0"})
    try:
        _wait(f"http://127.0.0.1:{port}", proc)
    except RuntimeError:
        proc.kill()
        raise
    return proc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=120)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--port", type=int, default=18080)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    concurrency = 4 * args.parallel
    settings = {
        "defaults (queue 64, wait 30 s)": [],
        "--max-queue-wait 2.5": ["--max-queue-wait", "2.5"],
    }
    rows = []
    for name, extra in settings.items():
        proc = serve(args.port, args.parallel, extra)
        out = Path(f"/tmp/bench-overload-{args.port}.json")
        try:
            subprocess.run([sys.executable, "-m", "gateway.cli", "bench", "--url", f"http://127.0.0.1:{args.port}",
                            "--concurrency", str(concurrency), "--duration", str(args.duration),
                            "--num-prompts", "256", "--input-len", str(args.input_len),
                            "--output-len", str(args.output_len), "--server-metrics", "--quiet",
                            "--json", str(out)], cwd=ROOT, check=False)
            s = json.loads(out.read_text())
        finally:
            proc.terminate()
            proc.wait(timeout=120)
        rows.append((name, s))
    print(f"\n{concurrency} closed-loop clients, {args.parallel} slots, {args.duration:.0f} s each, "
          f"{args.input_len}-word prompts, {args.output_len} output tokens")
    print("| admission | completed | refused 429 | Retry-After min/p50/max (s) | 5xx | TTFT p50 / p95 (s) "
          "| tok/s | accepted waits all ≤ (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, s in rows:
        ra = s.get("retry_after_s")
        ra_txt = f"{ra['min']:g} / {ra['p50']:g} / {ra['max']:g}" if ra else "—"
        q = s["server_queue_wait"]
        print(f"| {name} | {s['completed']} | {s['rejected']} | {ra_txt} | {s['server_errors']} | "
              f"{s['ttft']['p50']:.2f} / {s['ttft']['p95']:.2f} | {s['output_token_throughput']:.1f} | "
              f"{q['all_waited_at_most_s']:g} ({q['requests']:.0f} requests) |")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(rows), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
