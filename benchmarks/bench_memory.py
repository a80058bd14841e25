"""How close the memory estimate (gateway/models/memory.py) comes to what a served model really
takes: for each model x context x sequences, a real `gateway serve` loads it in its worker process,
answers a request that fills every sequence, and the worker's resident memory (and, on a GPU, its
memory there, from nvidia-smi) is set beside the estimate that residency decisions use.

    .venv/bin/python benchmarks/bench_memory.py [--engine cpu|cuda] [--models ID,ID] [--json FILE]

Models: those of models.yaml (or --config), plus any GGUF given with --gguf PATH (e.g. the random
Llama-3-8B-shaped Q4_K_M of benchmarks/make_random_llama.py on the H100).

The host prefix cache is part of the estimate: --prefix-cache MIB sizes it (default: the gateway's
own default, a quarter of the free memory up to 8 GiB; 0: none), and the cache is filled with
distinct prompts (until it holds 90% of its bound, or --fill-max prompts) before the worker is
measured, so a cache that grows as it is used is measured full; the heavier requests (logprobs
over the vocabulary, a grammar) run once more then. The table sets the estimate beside the worker's
resident memory at the end (anonymous and file-backed, such as the mapped weights) and beside its
peak (VmHWM), the figure a budget has to hold.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.host.ports import free_port  # noqa: E402

MiB = 1 << 20
CONFIGS = ((512, 1), (2048, 1), (2048, 4), (8192, 1), (8192, 4))


def gpu_used(pid: int) -> int | None:
    """The process's memory on the GPU (nvidia-smi), None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        p, _, mib = line.partition(",")
        if p.strip() == str(pid):
            return int(mib.strip()) * MiB
    return 0


def cache_bytes(url: str, model: str) -> tuple[int, int]:
    """(bytes held, bound) of the model's host prefix cache, from /metrics."""
    held = bound = 0
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if f'model="{model}"' not in line:
            continue
        if line.startswith("gateway_prefix_cache_bytes{"):
            held = int(float(line.rsplit(" ", 1)[1]))
        elif line.startswith("gateway_prefix_cache_limit_bytes{"):
            bound = int(float(line.rsplit(" ", 1)[1]))
    return held, bound


def fill_cache(url: str, model: str, ctx: int, parallel: int, most: int) -> tuple[int, int, int]:
    """Distinct prompts of about half the context, `parallel` at a time, until the cache holds 90%
    of its bound (or `most` prompts): (prompts sent, bytes held, bound)."""
    sent = 0
    held, bound = cache_bytes(url, model)

    def one(i: int) -> None:
        words = " ".join(f"w{i}x{k}" for k in range(ctx // 8))
        httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
            "model": model, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": words}]}).raise_for_status()

    with ThreadPoolExecutor(parallel) as pool:
        while bound and held < 0.9 * bound and sent < most:
            list(pool.map(one, range(sent, sent + parallel)))
            sent += parallel
            held, bound = cache_bytes(url, model)
    return sent, held, bound


def _proc_memory(pid: int) -> dict[str, int]:
    """The worker's peak resident memory (VmHWM) and its resident memory by kind (anonymous, file
    pages such as the mapped weights), from /proc (the gateway runs on this host)."""
    fields = {"VmHWM": "peak_ram", "RssAnon": "rss_anon", "RssFile": "rss_file"}
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in fields:
                out[fields[key]] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def measure(model: dict[str, Any], ctx: int, parallel: int, engine: str, tmp: Path,
            prefix_cache: str | None = None, fill_max: int = 400, logs: Path | None = None) -> dict[str, Any]:
    spec = {**model, "context_length": ctx, "parallel": parallel}
    cfg = tmp / f"models-{ctx}-{parallel}.yaml"
    cfg.write_text(yaml.safe_dump({"default": spec["id"], "models": [spec]}, sort_keys=False))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = (logs or tmp) / f"gateway-{spec['id']}-{ctx}x{parallel}.log"
    log = log_path.open("w")
    began = time.monotonic()

    def phase(what: str) -> None:
        print(f"{spec['id']} {ctx}x{parallel}: {what} at {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)

    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg), "--port", str(port),
                             "--engine", engine, "--keep-alive", "-1",
                             *(["--prefix-cache", prefix_cache] if prefix_cache is not None else [])],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(log_path.read_text()[-3000:])
            time.sleep(0.5)
        phase("ready")
        words = " ".join(f"item{i}" for i in range(min(ctx // 4, 1500)))

        def one(i: int) -> None:
            r = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
                "model": spec["id"], "max_tokens": 16, "temperature": 0,
                "messages": [{"role": "user", "content": f"{i}: {words}"}]})
            r.raise_for_status()

        def heavy() -> None:
            """The heavier paths: logprobs over the vocabulary, and a grammar."""
            for extra in ({"logprobs": True, "top_logprobs": 5}, {"response_format": {"type": "json_object"}}):
                httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
                    "model": spec["id"], "max_tokens": 16, "temperature": 0, **extra,
                    "messages": [{"role": "user", "content": words[: 4 * ctx // 2]}]}).raise_for_status()

        with ThreadPoolExecutor(parallel) as pool:
            list(pool.map(one, range(parallel)))
        heavy()
        phase("loaded every sequence")
        sent, held, bound = fill_cache(url, spec["id"], ctx, parallel, fill_max)
        heavy()  # again with the cache full: the peak the budget has to hold
        phase(f"cache filled ({sent} prompts, {held / MiB:.0f} of {bound / MiB:.0f} MiB)")
        row = httpx.get(f"{url}/health", timeout=30).json()["models"][spec["id"]]
        est = row["memory"]["estimate"]
        pid = row["worker"]["pid"]
        return {"model": spec["id"], "context": ctx, "parallel": parallel, "engine": engine,
                "cache_bound": bound, "cache_held": held, "fill_prompts": sent, "parts": est.get("parts_bytes"),
                "estimate_ram": est["ram_bytes"], "estimate_gpu": est["gpu_bytes"],
                "measured_ram": row["worker"]["rss_bytes"], **_proc_memory(pid),
                "measured_gpu": gpu_used(pid) if engine == "cuda" else None}
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "models.yaml"))
    ap.add_argument("--models", default="smollm2-135m-instruct,gemma-3-270m")
    ap.add_argument("--gguf", action="append", default=[], help="also measure this GGUF file")
    ap.add_argument("--engine", default="cpu")
    ap.add_argument("--configs", default=",".join(f"{c}x{p}" for c, p in CONFIGS), help="CONTEXTxSEQUENCES,...")
    ap.add_argument("--prefix-cache", default=None, metavar="MIB",
                    help="the host prefix cache's size (default: the gateway's default; 0: none)")
    ap.add_argument("--fill-max", type=int, default=400, help="at most this many prompts to fill the cache")
    ap.add_argument("--json", default=None)
    ap.add_argument("--logs", default=None, metavar="DIR", help="keep each gateway's log in DIR (default: discarded)")
    args = ap.parse_args()
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
    data = yaml.safe_load(Path(args.config).read_text())
    by_id = {m["id"]: m for m in data["models"]}
    models = [by_id[m] for m in args.models.split(",") if m]
    models += [{"id": Path(g).stem.lower(), "formats": {"gguf": {"path": str(Path(g).resolve())}}} for g in args.gguf]
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for m in models:
            for ctx, par in configs:
                try:
                    rows.append(measure(m, ctx, par, args.engine, Path(tmp), args.prefix_cache, args.fill_max,
                                        Path(args.logs) if args.logs else None))
                except Exception as exc:  # noqa: BLE001 - a config that cannot run is reported, not fatal
                    print(f"{m['id']} {ctx}x{par}: {exc}", file=sys.stderr)
                    continue
                r = rows[-1]
                print(json.dumps(r), file=sys.stderr, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    print(f"Memory estimate vs measured, engine {args.engine}; {cpu}, {os.cpu_count()} threads; commit {commit}\n")
    print("| model | context x seqs | host cache held / bound | estimate RAM | worker RSS (anon + file) | error "
          "| worker peak RSS | error |" + (" estimate GPU | measured GPU | error |" if args.engine == "cuda" else ""))
    print("|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if args.engine == "cuda" else ""))
    for r in rows:
        err = (r["estimate_ram"] - r["measured_ram"]) / r["measured_ram"] * 100
        peak = r.get("peak_ram") or r["measured_ram"]
        kinds = f" ({r['rss_anon'] / MiB:.0f} + {r['rss_file'] / MiB:.0f})" if "rss_anon" in r else ""
        line = (f"| {r['model']} | {r['context']} x {r['parallel']} | "
                f"{r['cache_held'] / MiB:.0f} / {r['cache_bound'] / MiB:.0f} MiB | {r['estimate_ram'] / MiB:.0f} MiB | "
                f"{r['measured_ram'] / MiB:.0f} MiB{kinds} | {err:+.0f}% | {peak / MiB:.0f} MiB | "
                f"{(r['estimate_ram'] - peak) / peak * 100:+.0f}% |")
        if args.engine == "cuda" and r["measured_gpu"]:
            gerr = (r["estimate_gpu"] - r["measured_gpu"]) / r["measured_gpu"] * 100
            line += f" {r['estimate_gpu'] / MiB:.0f} MiB | {r['measured_gpu'] / MiB:.0f} MiB | {gerr:+.0f}% |"
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"commit": commit, "cpu": cpu, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
