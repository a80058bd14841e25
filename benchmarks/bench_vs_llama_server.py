"""The gateway vs llama-server, same llama.cpp, same model, same client, alternating.

    .venv/bin/python benchmarks/bench_vs_llama_server.py [--concurrency 1,4,8,16] [--output-len 128]

Builds llama-server from the llama.cpp vendored in the installed llama-cpp-python version
(benchmarks/build-llama-server.sh, cached), starts both servers with the same number of parallel
sequences and context per sequence, then for each concurrency runs `gateway bench` against the
gateway and against llama-server, one after the other (the idle server uses no CPU). Prints a
Markdown table with machine and commit; --json keeps every number.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.host.ports import free_port  # noqa: E402

MODEL = "smollm2-135m-instruct"


def _wait(url: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the gateway drains), then SIGKILL after 60 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def _bench(url: str, c: int, args: argparse.Namespace, out: Path) -> dict[str, object]:
    n = max(args.min_prompts, c * args.per_stream)
    subprocess.run([sys.executable, "-m", "gateway.cli", "bench", "--url", url, "--model", MODEL, "--concurrency", str(c),
                    "--num-prompts", str(n), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                    "--seed", str(args.seed * 1000 + c), "--quiet", "--json", str(out)], check=False, cwd=ROOT, stdout=subprocess.DEVNULL)
    result: dict[str, object] = json.loads(out.read_text())
    if result["failed"]:
        print(f"{url}: {result['failed']} requests failed: {result['errors']}", file=sys.stderr)
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--per-stream", type=int, default=3, help="requests per concurrent stream")
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--backend", default="cpu", help="llama-server build: cpu, vulkan, cuda")
    ap.add_argument("--server-bin", default=None, help="an existing llama-server build's bin dir")
    ap.add_argument("--seed", type=int, default=0, help="prompts differ per concurrency level: no prompt-cache hits")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    conc = [int(c) for c in args.concurrency.split(",")]
    np_ = max(conc)
    from gateway.models.registry import load_registry

    reg = load_registry(ROOT / "models.yaml")
    spec = reg.models[MODEL]
    model = str(reg.resolve(spec, "gguf"))
    bin_dir = args.server_bin or subprocess.run(
        ["bash", str(ROOT / "benchmarks/build-llama-server.sh"), args.backend], check=True, capture_output=True, text=True
    ).stdout.strip().splitlines()[-1]
    threads = str(os.cpu_count() or 1)
    gw_port, ls_port = free_port(), free_port()
    env = {**os.environ, "GATEWAY_LOG_LEVEL": "warning", "GATEWAY_CHECK_MODELS": "0"}
    gw = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--port", str(gw_port), "--parallel", str(np_)],
                          cwd=ROOT, env=env)
    ls = subprocess.Popen([f"{bin_dir}/llama-server", "-m", model, "--port", str(ls_port), "-np", str(np_),
                           "-c", str(spec.context_length * np_), "-t", threads, "-tb", threads, "--log-disable",
                           *(["-ngl", "99"] if args.backend != "cpu" else [])],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results: dict[str, dict[int, dict[str, object]]] = {"gateway": {}, "llama-server": {}}
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    try:
        _wait(f"http://127.0.0.1:{gw_port}", gw)
        _wait(f"http://127.0.0.1:{ls_port}", ls)
        for c in conc:
            for name, port in (("gateway", gw_port), ("llama-server", ls_port)):
                results[name][c] = _bench(f"http://127.0.0.1:{port}", c, args, tmp / f"bench-{name}-{c}.json")
                r = results[name][c]
                print(f"{name:<13} c={c:<3} {r['output_token_throughput']:8.1f} tok/s", file=sys.stderr)  # type: ignore[index]
    finally:
        for p in (gw, ls):
            p.terminate()
            p.wait(timeout=30)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    print(f"\nmachine: {platform.machine()} {os.cpu_count()} cores, {platform.platform()}; commit {commit}; "
          f"llama-server from {bin_dir}")
    print(f"{args.input_len} prompt tokens, {args.output_len} output tokens (ignore_eos), -np {np_} on both\n")
    print("| concurrency | gateway tok/s | llama-server tok/s | ratio | TTFT p50 / p95 ms gateway | TTFT p50 / p95 ms llama-server | TPOT p50 ms gw / ls |")
    print("|---|---|---|---|---|---|---|")
    for c in conc:
        g, s = results["gateway"][c], results["llama-server"][c]
        gt, st = g["output_token_throughput"], s["output_token_throughput"]  # type: ignore[index]
        print(f"| {c} | {gt:.1f} | {st:.1f} | {gt / st:.2f} | "  # type: ignore[operator]
              f"{g['ttft']['p50'] * 1e3:.0f} / {g['ttft']['p95'] * 1e3:.0f} | "  # type: ignore[index]
              f"{s['ttft']['p50'] * 1e3:.0f} / {s['ttft']['p95'] * 1e3:.0f} | "  # type: ignore[index]
              f"{g['tpot']['p50'] * 1e3:.1f} / {s['tpot']['p50'] * 1e3:.1f} |")  # type: ignore[index]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
