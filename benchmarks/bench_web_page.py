"""Does the web page cost serving anything? `gateway bench` at 8 streams against one real
`gateway serve`, with the page open in headless Chromium (polling /api/status every 2 s and
redrawing its charts) and with no browser at all, alternated run by run.

Also times /api/status itself, the one request the open page repeats.

    .venv/bin/python benchmarks/bench_web_page.py [--reps 4] [--num-prompts 48] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.bench_overload import serve  # noqa: E402


def bench(url: str, server: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    server0, browser0, t0 = cpu_seconds(server), cpu_seconds(match="chromium"), time.monotonic()
    subprocess.run([sys.executable, "-m", "gateway.cli", "bench", "--url", url, "--concurrency", "8",
                    "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
                    "--output-len", str(args.output_len), "--quiet", "--json", str(out)], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)
    wall = time.monotonic() - t0
    s: dict[str, Any] = json.loads(out.read_text())
    return {"tok_s": s["output_token_throughput"], "ttft_p50": s["ttft"]["p50"], "ttft_p95": s["ttft"]["p95"],
            "tpot_p50": s["tpot"]["p50"], "failed": s["failed"],
            # CPU the gateway spent per generated token, and the share of one core the browser used.
            "server_cpu_ms_per_token": 1000 * (cpu_seconds(server) - server0) / s["total_output_tokens"],
            "browser_cores": (cpu_seconds(match="chromium") - browser0) / wall}


def _procs() -> list[tuple[int, int, str, float]]:
    """(pid, parent pid, command line, CPU seconds so far) of every process (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out.append((int(d.name), int(fields[1]), cmd, (int(fields[11]) + int(fields[12])) / tick))  # utime + stime
    return out


def cpu_seconds(root: int | None = None, match: str = "") -> float:
    """CPU time so far of `root` and its descendants (the gateway and its engine workers), or of
    every process whose command line contains `match`."""
    procs = _procs()
    if root is None:
        return sum(cpu for _, _, cmd, cpu in procs if match in cmd)
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, ppid, _, _ in procs if ppid in tree} - tree
        tree |= more
        grew = bool(more)
    return sum(cpu for pid, _, _, cpu in procs if pid in tree)


def status_latency(url: str, n: int = 200) -> dict[str, float]:
    times = []
    with httpx.Client() as c:
        for _ in range(n):
            t0 = time.perf_counter()
            c.get(f"{url}/api/status").raise_for_status()
            times.append(time.perf_counter() - t0)
    times.sort()
    return {"p50_ms": 1000 * statistics.median(times), "p95_ms": 1000 * times[int(0.95 * (n - 1))]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=4, help="runs per condition, alternated")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--port", type=int, default=18090)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    exe = shutil.which("chromium")
    if exe is None:
        print("needs Debian's chromium (apt-get install --no-install-recommends chromium)", file=sys.stderr)
        return 2
    url = f"http://127.0.0.1:{args.port}"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the gateway below on `timeout` / kill too
    proc = serve(args.port, 4, [])
    out = Path(f"/tmp/bench-web-page-{args.port}.json")
    rows: dict[str, list[dict[str, Any]]] = {"no page": [], "page open": []}
    try:
        bench(url, proc.pid, argparse.Namespace(**{**vars(args), "num_prompts": 16}), out)  # warm-up
        with sync_playwright() as p:
            for rep in range(args.reps):
                order = ["no page", "page open"] if rep % 2 == 0 else ["page open", "no page"]
                for cond in order:
                    if cond == "no page":
                        rows[cond].append(bench(url, proc.pid, args, out))
                        continue
                    browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-dev-shm-usage"])
                    page = browser.new_page(viewport={"width": 1280, "height": 900})
                    page.goto(url)
                    page.wait_for_selector("#chart-ttft[data-points]")
                    page.evaluate("performance.setResourceTimingBufferSize(100000)")
                    page.wait_for_timeout(3000)  # the browser's own start-up work is not the page's cost
                    t0 = time.monotonic()
                    r = bench(url, proc.pid, args, out)
                    polls = page.evaluate("performance.getEntriesByType('resource')"
                                          ".filter(e => e.name.includes('/api/status')).length")
                    r["polls_per_s"] = polls / (time.monotonic() - t0)
                    rows[cond].append(r)
                    browser.close()
                print(f"rep {rep + 1}: " + "; ".join(f"{c} {rows[c][-1]['tok_s']:.1f} tok/s" for c in order), flush=True)
        latency = status_latency(url)
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    print(f"\n8 streams, {args.num_prompts} requests per run, {args.input_len}-word prompts, {args.output_len} output tokens")
    cols = "tok/s, TTFT p50 / p95 (s), TPOT p50 (ms), server CPU ms/token, browser cores"
    print(f"| run | no page: {cols} | page open: {cols} |")
    print("|---|---|---|")

    def cell(r: dict[str, Any]) -> str:
        return (f"{r['tok_s']:.1f}, {r['ttft_p50']:.2f} / {r['ttft_p95']:.2f}, {1000 * r['tpot_p50']:.1f}, "
                f"{r['server_cpu_ms_per_token']:.2f}, {r['browser_cores']:.3f}")

    for i, (a, b) in enumerate(zip(rows["no page"], rows["page open"], strict=True), 1):
        print(f"| {i} | {cell(a)} | {cell(b)} |")
    keys = ("tok_s", "ttft_p50", "ttft_p95", "tpot_p50", "server_cpu_ms_per_token", "browser_cores")
    med = {c: {k: statistics.median(r[k] for r in rs) for k in keys}
           for c, rs in rows.items()}
    print(f"| median | {cell(med['no page'])} | {cell(med['page open'])} |")
    polls = statistics.median(r["polls_per_s"] for r in rows["page open"])
    print(f"\npage polls of /api/status during the runs: {polls:.2f}/s; /api/status alone: "
          f"p50 {latency['p50_ms']:.2f} ms, p95 {latency['p95_ms']:.2f} ms per call (client-side, idle server)")
    if any(r["failed"] for rs in rows.values() for r in rs):
        print("some requests failed", file=sys.stderr)
        return 1
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": rows, "median": med, "status_latency": latency}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
