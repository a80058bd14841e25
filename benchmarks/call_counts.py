"""Python calls per generated token, before and after a change: a count, not a timing, so it holds
on a noisy machine. Each version serves the default model with the engine in the gateway's own
process (`GATEWAY_WORKERS=0`: the engine's step loop and the gateway's event path in one profile),
under cProfile, twice: for a few single-stream requests of 128 + 128 tokens and for more. The
difference of the two runs' counts is what the extra tokens cost, start-up and imports left out;
every function called at least once per token in either version whose count differs is listed.

    python benchmarks/call_counts.py --baseline ../before   # a directory holding the other revision
"""

from __future__ import annotations

import argparse
import os
import pstats
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
Counts = dict[tuple[str, str], int]


def profile(tree: Path, out: Path, requests: int, output_len: int) -> int:
    """Serve from `tree` under cProfile, run the requests; the tokens generated (warm-up included)."""
    from benchmarks.bench_vs_llama_server import _wait
    from gateway.host.ports import free_port

    port = free_port()
    env = {**os.environ, "GATEWAY_WORKERS": "0", "GATEWAY_CHECK_MODELS": "0", "GATEWAY_LOG_LEVEL": "warning",
           "PYTHONPATH": str(tree)}
    server = subprocess.Popen([sys.executable, __file__, "--profile-serve", str(out), "--port", str(port), "--parallel",
                               "1", "--engine", "cpu"], cwd=tree, env=env)
    try:
        _wait(f"http://127.0.0.1:{port}", server)
        warmup = 2
        subprocess.run([sys.executable, "-m", "gateway.cli", "bench", "--url", f"http://127.0.0.1:{port}", "--model",
                        MODEL, "--concurrency", "1", "--num-prompts", str(requests), "--warmup", str(warmup),
                        "--output-len", str(output_len), "--quiet"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    finally:
        server.send_signal(signal.SIGINT)  # a clean exit writes the profile
        server.wait(timeout=120)
    return (requests + warmup) * output_len


def profiled_serve(out: str, argv: list[str]) -> None:
    """`gateway serve ARGV` with every thread profiled (the engine steps on its own thread), the
    profiles merged into `out` on exit."""
    import cProfile
    import runpy
    import threading

    profiles = [cProfile.Profile()]
    run = threading.Thread.run

    def profiled_run(self: threading.Thread) -> None:
        p = cProfile.Profile()
        profiles.append(p)
        p.enable()
        try:
            run(self)
        finally:
            p.disable()

    threading.Thread.run = profiled_run  # type: ignore[method-assign]
    sys.argv = ["gateway", "serve", *argv]
    profiles[0].enable()
    try:
        runpy.run_module("gateway.cli", run_name="__main__")
    except SystemExit:
        pass
    finally:
        profiles[0].disable()
        merged = None
        for p in profiles:
            p.create_stats()
            if p.stats:  # type: ignore[attr-defined]
                merged = pstats.Stats(p) if merged is None else merged.add(p)
        assert merged is not None
        merged.dump_stats(out)


def counts(path: Path, tree: Path) -> Counts:
    """Calls per function, named by its file relative to the tree (or this checkout: the shared venv)."""
    out: Counts = {}
    for (file, _, name), (_, calls, *_rest) in pstats.Stats(str(path)).stats.items():  # type: ignore[attr-defined]
        key = (file.replace(str(tree) + "/", "").replace(str(ROOT) + "/", ""), re.sub(r" at 0x[0-9a-f]+", "", name))
        out[key] = out.get(key, 0) + calls
    return out


def main() -> int:
    if sys.argv[1:2] == ["--profile-serve"]:  # the served gateway: its tree's code (PYTHONPATH), not this one's
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks"]
        profiled_serve(sys.argv[2], sys.argv[3:])
        return 0
    sys.path.insert(0, str(ROOT))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, type=Path, help="a directory holding the revision to compare with")
    ap.add_argument("--requests", default="4,12", help="the two runs' request counts")
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()
    trees = {"baseline": args.baseline.resolve(), "this": ROOT}
    few, many = (int(n) for n in args.requests.split(","))
    got: dict[str, dict[tuple[str, str], float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, tree in trees.items():
            runs = []
            for n in (few, many):
                path = Path(tmp) / f"{name}-{n}.prof"
                runs.append((profile(tree, path, n, args.output_len), counts(path, tree)))
            (t0, c0), (t1, c1) = runs
            tokens = t1 - t0
            got[name] = {k: (c1.get(k, 0) - c0.get(k, 0)) / tokens for k in set(c0) | set(c1)}
    base, this = got["baseline"], got["this"]
    per_token = [(k, base.get(k, 0.0), this.get(k, 0.0)) for k in set(base) | set(this)]
    hot = [(k, b, t) for k, b, t in per_token if max(b, t) >= 1.0]
    print(f"per token, from {tokens} more tokens; {len(hot)} functions called at least once per token in either version")
    print(f"calls per token in them: baseline {sum(b for _, b, _ in hot):.1f}, this {sum(t for _, _, t in hot):.1f}")
    for (file, name), b, t in sorted(hot, key=lambda r: -abs(r[2] - r[1])):
        if round(b, 1) != round(t, 1):
            print(f"  {b:7.2f} -> {t:7.2f}  {file}:{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
