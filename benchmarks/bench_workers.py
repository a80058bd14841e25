"""Engines in worker processes vs in the gateway process vs llama-server: same llama.cpp build,
same model, same client, servers alternated round by round.

    .venv/bin/python benchmarks/bench_workers.py [--concurrency 1,8,16] [--rounds 3] [--backend cpu]

Starts the gateway twice (GATEWAY_WORKERS=1, the default, and GATEWAY_WORKERS=0) and llama-server
(benchmarks/build-llama-server.sh, from the llama.cpp vendored in the installed llama-cpp-python),
all with the same parallel sequences, and for each round and concurrency runs `gateway bench`
against each in turn (the idle ones use no CPU).  Prints medians with the spread, and the resident
memory of the gateway and of its worker process.  --json keeps every number.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.bench_vs_llama_server import MODEL, _bench, _wait  # noqa: E402
from engines.worker.connections import rss_bytes  # noqa: E402
from gateway.host.ports import free_port  # noqa: E402


def _build_id() -> str:
    out = subprocess.run([sys.executable, "-m", "engines.llamacpp.ggml_devices"], capture_output=True, text=True, cwd=ROOT)
    try:
        r = json.loads(out.stdout)
    except ValueError:
        return "?"
    return f"llama-cpp-python {r.get('version')} [{','.join(r.get('backends', []))}] build {r.get('build_id')}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,8,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--per-stream", type=int, default=3, help="requests per concurrent stream")
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--backend", default="cpu", help="cpu, vulkan or cuda: the gateway's --engine and llama-server's build")
    ap.add_argument("--server-bin", default=None, help="an existing llama-server build's bin dir")
    ap.add_argument("--no-llama-server", action="store_true")
    ap.add_argument("--in-process-lib", default=None,
                    help="LLAMA_CPP_LIB_PATH for the in-process gateway: one process loads one build, so a "
                         "side-by-side build (e.g. CUDA next to an installed Vulkan package) must be named")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    conc = [int(c) for c in args.concurrency.split(",")]
    np_ = max(conc)
    from gateway.models.registry import load_registry

    reg = load_registry(ROOT / "models.yaml")
    spec = reg.models[MODEL]
    model = str(reg.resolve(spec, "gguf"))
    threads = str(os.cpu_count() or 1)
    servers: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
    for name, workers in (("gateway (workers)", "1"), ("gateway (in-process)", "0")):
        port = free_port()
        env = {**os.environ, "GATEWAY_LOG_LEVEL": "warning", "GATEWAY_CHECK_MODELS": "0", "GATEWAY_WORKERS": workers}
        if workers == "0" and args.in_process_lib:
            env["LLAMA_CPP_LIB_PATH"] = args.in_process_lib
        servers[name] = (subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--port", str(port),
                                           "--parallel", str(np_), "--engine", args.backend], cwd=ROOT, env=env), port)
    bin_dir = ""
    if not args.no_llama_server:
        bin_dir = args.server_bin or subprocess.run(
            ["bash", str(ROOT / "benchmarks/build-llama-server.sh"), args.backend], check=True, capture_output=True,
            text=True).stdout.strip().splitlines()[-1]
        port = free_port()
        servers["llama-server"] = (subprocess.Popen(
            [f"{bin_dir}/llama-server", "-m", model, "--port", str(port), "-np", str(np_),
             "-c", str(spec.context_length * np_), "-t", threads, "-tb", threads, "--log-disable",
             # llama.cpp's default (-ngl auto) offloads to any GPU the build has: a CPU row must say none.
             *(["-ngl", "99"] if args.backend != "cpu" else ["-ngl", "0", "--device", "none"])],
            # Its shared libraries sit beside it (a build copied from another machine keeps them there).
            env={**os.environ, "LD_LIBRARY_PATH": ":".join(filter(None, (bin_dir, os.environ.get("LD_LIBRARY_PATH"))))},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), port)
    results: dict[str, dict[int, list[dict[str, Any]]]] = {n: {c: [] for c in conc} for n in servers}
    memory: dict[str, dict[str, int]] = {}
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    try:
        for proc, port in servers.values():
            _wait(f"http://127.0.0.1:{port}", proc)
        for r in range(args.rounds):
            for c in conc:
                order = list(servers) if r % 2 == 0 else list(reversed(servers))
                for name in order:
                    url = f"http://127.0.0.1:{servers[name][1]}"
                    res = _bench(url, c, argparse.Namespace(**{**vars(args), "seed": args.seed + r}),
                                 tmp / f"bench-workers-{c}.json")
                    results[name][c].append(res)
                    print(f"round {r} {name:<22} c={c:<3} {res['output_token_throughput']:8.1f} tok/s", file=sys.stderr)
        for name, (proc, port) in servers.items():
            memory[name] = {"server": rss_bytes(proc.pid) or 0}
            if name.startswith("gateway"):
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()["models"][MODEL]
                if "worker" in health:
                    memory[name]["worker"] = health["worker"]["rss_bytes"]
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    print(f"\nmachine: {platform.machine()} {os.cpu_count()} cores, {platform.platform()}; commit {commit}; {_build_id()}"
          + (f"; llama-server from {bin_dir}" if bin_dir else ""))
    print(f"{args.input_len} prompt tokens, {args.output_len} output tokens (ignore_eos), -np {np_} everywhere, "
          f"{args.rounds} rounds alternated; medians [min-max]\n")
    names = list(servers)
    print("| streams | " + " | ".join(f"{n} tok/s" for n in names) + " | workers / in-process | "
          + " | ".join(f"TTFT p50 ms {n}" for n in names) + " |")
    print("|---" * (2 * len(names) + 2) + "|")
    for c in conc:
        cells, ttft, med = [], [], {}
        for n in names:
            tps = [x["output_token_throughput"] for x in results[n][c]]
            med[n] = statistics.median(tps)
            cells.append(f"{med[n]:.1f} [{min(tps):.0f}-{max(tps):.0f}]")
            ttft.append(f"{statistics.median(x['ttft']['p50'] for x in results[n][c]) * 1e3:.0f}")
        ratio = med["gateway (workers)"] / med["gateway (in-process)"]
        print(f"| {c} | " + " | ".join(cells) + f" | {ratio:.2f} | " + " | ".join(ttft) + " |")
    print("\nresident memory: " + "; ".join(
        f"{n}: " + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in m.items()) for n, m in memory.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "memory": memory}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
